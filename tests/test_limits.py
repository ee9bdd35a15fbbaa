"""What requests cost, against the default bounds: the abusive requests of the issue are over
them, and ordinary ones (the demo's batches, an RL group) are well under."""

from __future__ import annotations

import pytest

from tinsmith import limits, models
from tinsmith.bus import MAX_BODY_BYTES

SMOL = models.get(models.SMOLLM2)
TINY = models.get(models.TINY)
DEFAULTS = limits.Limits()


def _train(spec: models.ModelSpec, lengths: list[int], backward: bool = True) -> int:
    return limits.train_bytes(spec.shape, spec.vocab_size, lengths, backward=backward)


def test_four_sequences_of_1024_smollm2_tokens_take_many_gigabytes_in_one_pass() -> None:
    """They took the trainer to a 15 GB peak (12.5 GB measured in a bare forward_backward),
    when it computed every position's logits at once."""
    need = _train(SMOL, [1024] * 4)
    assert 11 * 2**30 < need < 20 * 2**30
    one_pass = limits.pass_bytes(SMOL.shape, SMOL.vocab_size, [1024] * 4, backward=True)
    assert one_pass > DEFAULTS.train_memory_mb << 20


def _datum(spec: models.ModelSpec, length: int, backward: bool = True) -> int:
    return limits.datum_bytes(spec.shape, spec.vocab_size, length, backward=backward)


def test_every_smollm2_datum_up_to_its_context_fits_the_bound_for_one_datum() -> None:
    """The bound is on one datum: a request's datums run in as many passes as the trainer's
    memory asks, so four datums of 1024 tokens, or a datum of SmolLM2's 8192, are accepted."""
    assert _datum(SMOL, 1024) < (DEFAULTS.train_memory_mb << 20) // 8
    assert _datum(SMOL, SMOL.max_context_length) < DEFAULTS.train_memory_mb << 20
    assert _datum(SMOL, SMOL.max_context_length, backward=False) < DEFAULTS.train_memory_mb << 20


def test_a_datum_alone_is_checkpointed_so_it_needs_less_than_its_plain_pass() -> None:
    plain = limits.pass_bytes(SMOL.shape, SMOL.vocab_size, [4096], backward=True)
    assert _datum(SMOL, 4096) < plain // 4
    forward = limits.pass_bytes(SMOL.shape, SMOL.vocab_size, [4096], backward=False)
    assert _datum(SMOL, 4096, backward=False) == forward


def test_a_thousand_samples_of_a_thousand_tokens_are_over_the_sampling_bounds() -> None:
    """One such request held the sampler for 387 s while every other user waited."""
    assert DEFAULTS.sample_max_tokens < 1024 * (3 + 1021)
    need = limits.sample_bytes(
        SMOL.shape,
        SMOL.vocab_size,
        prompt=3,
        max_tokens=1021,
        num_samples=1024,
        prompt_scores=False,
    )
    assert need > DEFAULTS.sample_memory_mb << 20


def test_an_rl_group_fits_the_sampling_bounds() -> None:
    assert DEFAULTS.sample_max_tokens >= 16 * (256 + 512)
    need = limits.sample_bytes(
        SMOL.shape,
        SMOL.vocab_size,
        prompt=256,
        max_tokens=512,
        num_samples=16,
        prompt_scores=True,
    )
    assert need < (DEFAULTS.sample_memory_mb << 20) // 4


def test_a_result_of_128_samples_with_top_20_logprobs_does_not_fit_a_message() -> None:
    """Such a result could never be stored: its request came back after every ack wait."""
    size = limits.sample_result_bytes(
        prompt=10,
        max_tokens=500,
        num_samples=128,
        topk_sample=20,
        topk_prompt=0,
        prompt_logprobs=False,
        target_cells=0,
        alt_tokens_k=0,
    )
    assert size > MAX_BODY_BYTES
    small = limits.sample_result_bytes(
        prompt=10,
        max_tokens=500,
        num_samples=8,
        topk_sample=20,
        topk_prompt=20,
        prompt_logprobs=True,
        target_cells=0,
        alt_tokens_k=0,
    )
    assert small < MAX_BODY_BYTES


def test_bounds_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINSMITH_TRAIN_MEMORY_MB", "64")
    monkeypatch.setenv("TINSMITH_MAX_LORA_RANK", " 16 ")
    bounds = limits.Limits.from_env()
    assert (bounds.train_memory_mb, bounds.max_lora_rank) == (64, 16)
    assert bounds.seq_window == DEFAULTS.seq_window
    monkeypatch.setenv("TINSMITH_SEQ_WINDOW", "0")
    with pytest.raises(SystemExit, match="TINSMITH_SEQ_WINDOW"):
        limits.Limits.from_env()
    monkeypatch.setenv("TINSMITH_SEQ_WINDOW", "many")
    with pytest.raises(SystemExit, match="not an integer"):
        limits.Limits.from_env()
