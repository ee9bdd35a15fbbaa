"""services/sampler/decoder.py: the sampler's lean forward gives what transformers' forward of
the same model gives, to float32 rounding, for each architecture it takes: a left-padded prefill
of rows routed to different adapters (and to none), then decoding steps on the cache."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)
from transformers.cache_utils import DynamicCache

from services import lora_slots
from services.lora_slots import NO_ADAPTER
from services.sampler import decoder as lean
from services.sampler.decoder import Decoder, why_not
from tests.calls import record_calls
from tinsmith import lora, models

SIZES = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 97,
    "max_position_embeddings": 128,
}
CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(
        **SIZES,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "mistral": MistralConfig(**SIZES, sliding_window=None),
    "qwen2": Qwen2Config(**SIZES),
    "qwen3": Qwen3Config(**SIZES, head_dim=24),  # a head size of its own, and q/k norms
    "llama, no grouped heads": LlamaConfig(**{**SIZES, "num_key_value_heads": 4}),
}
TOLERANCE = 1e-5  # float32


def _model(config: PretrainedConfig) -> PreTrainedModel:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms away from 1, so that their weights matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


def _slotted(model: PreTrainedModel) -> tuple[lora_slots.Slots, list[int]]:
    """The LoRA slot layer on every projection and the head, with two adapters of different
    ranks on different modules."""
    layout = lora.LAYOUTS["llama"]
    slots = lora_slots.install(model, {m for group in layout.values() for m in group}, 64)
    loaded = []
    for seed, rank, names in ((1, 4, ("q_proj", "v_proj", "down_proj")), (2, 16, None)):
        generator = torch.Generator().manual_seed(seed)
        weights = {
            path: (
                torch.randn(rank, module.base.in_features, generator=generator) * 0.2,
                torch.randn(module.base.out_features, rank, generator=generator) * 0.2,
            )
            for path, module in slots.modules.items()
            if names is None or path.rsplit(".", 1)[-1] in names
        }
        loaded.append(slots.load(weights, rank, 2.0))
    return slots, loaded


@torch.inference_mode()
@pytest.mark.parametrize("arch", CONFIGS)
def test_prefill_and_decoding_equal_transformers(arch: str) -> None:
    model = _model(CONFIGS[arch])
    _check(model, CONFIGS[arch].vocab_size)


@torch.inference_mode()
def test_the_built_in_model_equals_transformers() -> None:
    directory = models.materialize(models.TINY, models.default_cache_dir())
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    _check(model, model.config.vocab_size)


@torch.inference_mode()
def test_rows_of_an_adapter_apart_equal_transformers() -> None:
    """An adapter's rows that are no one range are gathered (``SlotLinear``'s other way than
    ranges of rows): the same logits."""
    _check(_model(CONFIGS["qwen2"]), CONFIGS["qwen2"].vocab_size, apart=True)


def _check(model: PreTrainedModel, vocab: int, apart: bool = False) -> None:
    """``apart``: the first adapter's rows are the first and the last (no one range)."""
    slots, (first, second) = _slotted(model)
    decoder = Decoder.of(model)
    assert decoder is not None
    route = [first, second, first] if apart else [first, NO_ADAPTER, second]
    lengths = [5, 9, 2]
    width = max(lengths)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (3, width), generator=generator)
    mask = torch.zeros(3, width, dtype=torch.long)
    positions = torch.zeros(3, width, dtype=torch.long)
    for row, length in enumerate(lengths):  # left-padded
        mask[row, width - length :] = 1
        positions[row, width - length :] = torch.arange(length)
    with slots.routed(route):
        want = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        got = decoder(ids, mask, positions, logits_to_keep=0)
    for row, length in enumerate(lengths):  # the padding's logits are no one's
        gap = (got.logits[row, width - length :] - want.logits[row, width - length :]).abs()
        assert float(gap.max()) <= TOLERANCE, (row, float(gap.max()))
    theirs, ours = want.past_key_values, got.past_key_values
    assert isinstance(theirs, DynamicCache)
    at = torch.tensor(lengths)[:, None]
    buffers: list[torch.Tensor] = []
    for step in range(6):
        if step == 4:  # rows leave, as the engine's do: new tensors, grown again from there
            keep = torch.tensor([2, 0])
            for cache in (theirs, ours):
                cache.reorder_cache(keep)
            route, mask, at = [route[2], route[0]], mask[keep], at[keep]
        rows = len(route)
        token = torch.randint(1, vocab, (rows, 1), generator=generator)
        mask = torch.cat([mask, torch.ones(rows, 1, dtype=torch.long)], dim=1)
        with slots.routed(route):
            want = model(
                input_ids=token,
                attention_mask=mask,
                position_ids=at,
                past_key_values=theirs,
                use_cache=True,
            )
            got = decoder(token, mask, at, ours, room=2)
        at = at + 1
        assert got.logits.shape == (rows, 1, vocab)
        gap = float((got.logits - want.logits[:, -1:]).abs().max())
        assert gap <= TOLERANCE, (step, gap)
        keys = ours.layers[0].keys
        assert keys is not None and keys.shape[-2] == mask.shape[1]
        buffers.append(keys)  # held, so that no buffer's address is reused by another
    # Grown by two columns to spare: a new buffer at the first step, the fourth (its room used
    # up) and the fifth (new rows), the same one otherwise.
    same = [buffers[i].data_ptr() == buffers[i - 1].data_ptr() for i in range(1, 6)]
    assert same == [True, True, False, False, True]


@torch.inference_mode()
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_its_rotation_of_queries_and_keys_together_is_each_architectures_bit_for_bit(
    arch: str,
) -> None:
    model = _model(CONFIGS[arch])
    layer = model.model.layers[0]
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 5, SIZES["hidden_size"], generator=generator)
    heads = layer.self_attn.q_proj(hidden).view(3, 5, -1, layer.self_attn.head_dim)
    q, k = heads.transpose(1, 2), heads[:, :, :2].transpose(1, 2)
    positions = torch.arange(5).repeat(3, 1) + torch.tensor([[0], [3], [7]])
    cos, sin = model.model.rotary_emb(hidden, positions)
    modelling = sys.modules[type(layer).__module__]
    want_q, want_k = modelling.apply_rotary_pos_emb(q, k, cos, sin)
    signed_sin = lean._signed(sin.unsqueeze(1))  # once a forward, for every layer
    both = lean._rotate(torch.cat((q, k), dim=1), cos.unsqueeze(1), signed_sin)
    assert torch.equal(both[:, : q.shape[1]], want_q)
    assert torch.equal(both[:, q.shape[1] :], want_k)


@torch.inference_mode()
def test_the_hooks_of_its_modules_run() -> None:
    """It calls its modules' forwards, without the module call, until one has hooks, registered
    before it was made or after: then all are called as modules, and the hooks run."""
    model = _model(CONFIGS["qwen2"])
    seen: list[tuple[int, ...]] = []
    ids = torch.tensor([[5, 6, 7]])
    forward = Decoder(model)
    with pytest.MonkeyPatch.context() as patch:
        called = record_calls(patch, torch.nn.Module, "__call__")
        want = forward(ids, torch.ones_like(ids), torch.arange(3)[None]).logits
        assert called == []  # no module called as a module
        handle = model.model.layers[1].mlp.up_proj.register_forward_hook(
            lambda module, args, out: seen.append(tuple(out.shape))
        )
        got = forward(ids, torch.ones_like(ids), torch.arange(3)[None]).logits
    assert seen == [(1, 3, SIZES["intermediate_size"])]
    assert "Linear" in [type(args[0]).__name__ for args in called] and torch.equal(got, want)
    handle.remove()
    forward(ids, torch.ones_like(ids), torch.arange(3)[None])
    assert len(seen) == 1


def test_what_it_does_not_compute_runs_through_transformers() -> None:
    sliding = MistralConfig(**SIZES, sliding_window=16)
    assert "sliding-window" in str(why_not(_model(sliding)))
    assert Decoder.of(_model(sliding)) is None
    gpt2 = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)
    assert why_not(AutoModelForCausalLM.from_config(gpt2)) is not None
    split = LlamaConfig(**SIZES, pretraining_tp=2)
    assert "pretraining_tp" in str(why_not(_model(split)))
