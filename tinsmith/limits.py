"""Bounds on requests, and what a request costs: the numbers checked before a request is accepted,
so that no one request can take an engine's memory or time from every other user.

Owns: the bounds (configuration with safe defaults: ``Limits.from_env``; every service reads the
same variables) and the cost model they are checked against, computed from a model's shape
(``tinsmith.models.Shape``) alone, without torch:

- ``train_bytes``: the activation memory of a forward or forward_backward in float32, fitted to
  measurements of the trainer on this repository's models (SmolLM2-135M: about 3 MB per token
  with gradients and every position's logits, so 4 x 1024 tokens took 12.5 to 15 GB), with a
  term quadratic in each sequence's length for attention that materialises its weights;
- ``pass_bytes``: what one pass of the trainer holds, its layers' activations (``train_bytes``)
  and its LM head's, which computes its logits a chunk of positions at a time;
- ``datum_bytes``: the least one datum needs, a pass of it alone (with activation checkpointing
  for a backward): the trainer runs a request's datums in as many passes as its memory asks, so
  a request's longest datum is what no budget can split;
- ``sample_bytes``: the KV cache and logits of a sample request in the running batch;
- ``sample_result_bytes``: the size of a sample's stored result, which must fit one message.

Does not own: where each bound is checked (the gateway, before it appends anything), or the
engines' own accounting of memory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tinsmith.models import Shape

# The widest top-k of logprobs a sample request may ask for, per prompt or sampled position
# (vLLM's default max_logprobs, so both sampling engines can serve it).
MAX_TOPK_LOGPROBS = 20
# Samples one request may ask for.
MAX_NUM_SAMPLES = 1024
# Integer fields end up in protobuf messages: Tinker's seq ids and counters are int32 on the wire.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1
# Entries of a tags list or a user_metadata map.
MAX_METADATA_ENTRIES = 256
# A checkpoint's time to live, in seconds, at most (and at least, when set after the save).
TTL_MAX_S = 10 * 365 * 24 * 3600
TTL_MIN_S = 3600

# The embedded server and the deploy manifests run NATS with this max payload; the gateway tells
# the SDK to cut forward_backward chunks well below it.
MAX_PAYLOAD = 8 * 1024 * 1024
# What one message may carry besides its headers (the trace context, the message id) and the
# envelope of an event: the most a request's body or a result may take.
MAX_BODY_BYTES = MAX_PAYLOAD - 64 * 1024

_FLOAT = 4  # bytes; the engines compute in float32 on the CPU
_MIB = 2**20
# The float32 logits the trainer's LM head computes at once, with their log-softmax and
# gradient: a chunk of positions, whatever the sequence's length (a 4096-token sequence of a
# 128k vocabulary is 2 GiB of float32 logits, and its log-softmax and gradient as much again).
HEAD_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class Limits:
    """The bounds every request is checked against, each read from its environment variable
    (``VARIABLES``)."""

    # The largest LoRA rank a run may have (its adapter and AdamW state grow with it).
    max_lora_rank: int = 128
    # The activation memory one datum of a forward_backward (or forward) may need, in MiB
    # (``datum_bytes``): the trainer runs a request's datums in passes within its own budget, so
    # a request may hold any number of them. SmolLM2-135M's longest, 8,192 tokens, needs about
    # 3.6 GiB with gradients.
    train_memory_mb: int = 8192
    # The memory a sample request may take in the running batch (its KV cache and logits), in
    # MiB (``sample_bytes``). SmolLM2-135M: some 80,000 tokens of KV cache.
    sample_memory_mb: int = 4096
    # num_samples x (prompt + max_tokens) of one sample request, whatever the model: the work
    # one request may ask of the sampler.
    sample_max_tokens: int = 131072
    # How far past a run's next seq_id a request may be (the SDK sends a forward_backward's
    # chunks at once, the lowest last): beyond, 429 until the earlier requests arrive.
    seq_window: int = 128
    # The bytes of a call's tags, user_metadata, project_id and display_name together.
    max_metadata_bytes: int = 16384

    @classmethod
    def from_env(cls) -> Limits:
        limits = cls()
        for field, name in VARIABLES.items():
            value = count_from_env(name)
            if value is not None:
                limits = replace(limits, **{field: value})
        return limits


def count_from_env(name: str) -> int | None:
    """A positive integer from the environment variable ``name``; None when it is unset or
    empty. Anything else stops the process with a message that names the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not an integer") from None
    if value < 1:
        raise SystemExit(f"{name}={raw!r} must be at least 1")
    return value


def bound_from_env(name: str) -> int | None:
    """Like ``count_from_env``, where ``0`` is also taken: a bound that is off."""
    if os.environ.get(name, "").strip() == "0":
        return 0
    return count_from_env(name)


# Each bound's environment variable.
VARIABLES = {
    "max_lora_rank": "TINSMITH_MAX_LORA_RANK",
    "train_memory_mb": "TINSMITH_TRAIN_MEMORY_MB",
    "sample_memory_mb": "TINSMITH_SAMPLE_MEMORY_MB",
    "sample_max_tokens": "TINSMITH_SAMPLE_MAX_TOKENS",
    "seq_window": "TINSMITH_SEQ_WINDOW",
    "max_metadata_bytes": "TINSMITH_MAX_METADATA_BYTES",
}


def train_bytes(shape: Shape, vocab_size: int, lengths: Sequence[int], *, backward: bool) -> int:
    """The activation memory of one forward (``backward=False``) or forward_backward over
    sequences of ``lengths`` tokens, in float32: per token, what each layer keeps for the
    backward pass (or, forward only, what one layer holds at a time) plus the logits and their
    log-softmax and gradient; per sequence, attention weights of ``length**2`` per head."""
    tokens = sum(lengths)
    squares = sum(n * n for n in lengths)
    h, m, kv = shape.hidden_size, shape.intermediate_size, shape.kv_size
    heads = shape.num_attention_heads
    if backward:
        per_token = shape.num_hidden_layers * (18 * h + 4 * m + 4 * kv) + 5 * vocab_size
        attention = shape.num_hidden_layers * heads * squares
    else:
        per_token = 4 * h + 2 * m + 3 * vocab_size
        attention = heads * squares
    return _FLOAT * (tokens * per_token + attention)


def head_rows(vocab_size: int, head_chunk_bytes: int = HEAD_CHUNK_BYTES) -> int:
    """The positions whose float32 logits the trainer's LM head computes at once."""
    return max(1, head_chunk_bytes // (_FLOAT * vocab_size))


def pass_bytes(
    shape: Shape,
    vocab_size: int,
    lengths: Sequence[int],
    *,
    backward: bool,
    checkpointed: bool = False,
    layer_scale: float = 1.0,
    head_chunk_bytes: int = HEAD_CHUNK_BYTES,
) -> int:
    """The activation memory of one trainer pass over datums of ``lengths`` tokens: its layers'
    (``train_bytes`` over the batch right-padded to its longest datum, without the logits,
    times ``layer_scale`` for the base weights' dtype; with activation checkpointing, every
    layer's input and one layer's activations at a time), plus its LM head's (the hidden
    states of the datums' tokens, and one chunk of float32 logits with their log-softmax and,
    for a backward, their gradient)."""
    padded = [max(lengths)] * len(lengths)
    if checkpointed:
        one_layer = replace(shape, num_hidden_layers=1)
        layers = train_bytes(one_layer, 0, padded, backward=True) * layer_scale
        layers += shape.num_hidden_layers * sum(padded) * shape.hidden_size * _FLOAT
    else:
        layers = train_bytes(shape, 0, padded, backward=backward) * layer_scale
    tokens = sum(lengths)
    chunk = min(tokens, head_rows(vocab_size, head_chunk_bytes))
    head = tokens * shape.hidden_size * _FLOAT * 2
    head += chunk * vocab_size * _FLOAT * (4 if backward else 2)
    return int(layers) + head


def datum_bytes(shape: Shape, vocab_size: int, length: int, *, backward: bool) -> int:
    """The least activation memory the trainer needs for a datum of ``length`` tokens in
    float32: a pass of it alone, with activation checkpointing for a backward."""
    return pass_bytes(shape, vocab_size, [length], backward=backward, checkpointed=backward)


def sample_bytes(
    shape: Shape,
    vocab_size: int,
    *,
    prompt: int,
    max_tokens: int,
    num_samples: int,
    prompt_scores: bool,
) -> int:
    """The memory a sample request holds in the running batch: every sequence's KV cache at its
    full length, the logits of each step (and of the whole prompt when it asks for prompt
    logprobs), in float32."""
    kv_per_token = 2 * shape.num_hidden_layers * shape.kv_size
    cache = num_samples * (prompt + max_tokens) * kv_per_token
    logits = 3 * vocab_size * (num_samples + (prompt if prompt_scores else 1))
    return _FLOAT * (cache + logits)


def sample_result_bytes(
    *,
    prompt: int,
    max_tokens: int,
    num_samples: int,
    topk_sample: int,
    topk_prompt: int,
    prompt_logprobs: bool,
    target_cells: int,
    alt_tokens_k: int,
) -> int:
    """The most a sample request's stored ``SampleResponse`` can take: per sampled token its id,
    logprob and top-k; per prompt position its logprob, top-k and alternatives; the target
    logprobs; a little framing per sequence."""
    per_sampled = 8 + 8 * topk_sample
    per_prompt = 4 * int(prompt_logprobs) + 8 * topk_prompt + 12 * alt_tokens_k
    return (
        num_samples * (max_tokens * per_sampled + 64)
        + prompt * per_prompt
        + 4 * target_cells
        + 1024
    )


def mib(n: int) -> str:
    """``n`` bytes, for people."""
    return f"{n / _MIB:,.0f} MiB" if n >= 10 * _MIB else f"{n / _MIB:.1f} MiB"
