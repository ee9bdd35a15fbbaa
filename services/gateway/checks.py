"""What a request may ask, checked against its model and the deployment's bounds: the checks
that let a bad request fail at once with a clear 400, before anything is appended.

Owns: the checks of a request's content (tokens against the vocabulary and the context length,
losses and their inputs, LoRA configs, free-text sizes, the memory and result size a request
would take). Does not own: who may ask (operations.py), or reading the wire (wire.py). Pure: no
I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from tinsmith import limits, losses, models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest
from tinsmith.limits import MAX_BODY_BYTES, MAX_TOPK_LOGPROBS, Limits, mib
from tinsmith.tensors import decode_tensor, model_input_tokens, sparse_cells


def check_forward_backward(
    bounds: Limits, spec: models.ModelSpec, request: tp.ForwardBackwardRequest
) -> None:
    """A forward or forward_backward chunk: its loss and inputs, its tokens against the
    model's vocabulary and context, and its activation memory against the trainer's budget."""
    losses.resolve_config(request.loss_fn, losses.config_of(request))
    if not request.data:
        raise InvalidRequest("forward_backward needs at least one datum")
    lengths = []
    for i, datum in enumerate(request.data):
        tokens = model_input_tokens(datum.model_input)
        n = len(tokens)
        lengths.append(n)
        if n == 0:
            raise InvalidRequest(f"datum {i} has an empty model_input")
        if n > spec.max_context_length:
            raise InvalidRequest(
                f"datum {i} has {n} tokens; {spec.name} accepts at most {spec.max_context_length}"
            )
        check_vocab(tokens, spec.vocab_size, f"datum {i} model_input")
        inputs = {
            name: decode_tensor(tensor, f"datum {i} loss_fn_inputs[{name!r}]")
            for name, tensor in datum.loss_fn_inputs.items()
        }
        losses.check_inputs(request.loss_fn, inputs, n, i)
        check_vocab(inputs["target_tokens"], spec.vocab_size, f"datum {i} target_tokens")
    check_train_memory(bounds, spec, lengths, backward=not request.forward_only)


def check_train_memory(
    bounds: Limits, spec: models.ModelSpec, lengths: list[int], *, backward: bool
) -> None:
    """Refuse a request with a datum whose activations would not fit the trainer's budget even
    alone (``limits.datum_bytes``). A request may hold any number of datums: the trainer runs
    them in as many passes as its memory asks, but one datum is one pass."""
    budget = bounds.train_memory_mb << 20
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    n = lengths[longest]
    need = limits.datum_bytes(spec.shape, spec.vocab_size, n, backward=backward)
    if need <= budget:
        return
    low, high = 0, n  # the longest datum that fits: low fits (or is 0), high does not
    while high - low > 1:
        middle = (low + high) // 2
        fits = limits.datum_bytes(spec.shape, spec.vocab_size, middle, backward=backward)
        low, high = (middle, high) if fits <= budget else (low, middle)
    op = "forward_backward" if backward else "forward"
    alone = "alone, with activation checkpointing" if backward else "alone"
    raise InvalidRequest(
        f"datum {longest} of this {op} has {n} tokens of {spec.name}, which need about "
        f"{mib(need)} of activation memory even {alone}; the trainer's budget for one datum is "
        f"{mib(budget)} (TINSMITH_TRAIN_MEMORY_MB), datums of at most {low} tokens of this "
        "model: send shorter sequences (a request may hold any number of datums)"
    )


def check_sample(bounds: Limits, spec: models.ModelSpec, command: bus.Sample) -> None:
    """A sample request against its model (vocabulary, context) and the sampler's bounds."""
    prompt = command.prompt
    if not prompt:
        raise InvalidRequest("prompt must contain at least one token")
    check_vocab(list(prompt), spec.vocab_size, "prompt")
    if command.params.WhichOneof("stop") == "stop_tokens":
        check_vocab(list(command.params.stop_tokens.values), spec.vocab_size, "stop token ids")
    if len(prompt) + command.params.max_tokens > spec.max_context_length:
        raise InvalidRequest(
            f"prompt ({len(prompt)} tokens) plus max_tokens ({command.params.max_tokens}) exceeds "
            f"the context length of {spec.name} ({spec.max_context_length})"
        )
    if command.HasField("target_prompt_logprobs"):
        check_targets(command.target_prompt_logprobs, len(prompt), spec.vocab_size)
    check_sample_cost(bounds, spec, command)


def check_targets(tensor: tp.Tensor, prompt_length: int, vocab_size: int) -> None:
    """The token ids to score at each prompt position: int64 ``[len(prompt) - 1, K]``, ``-1``
    for cells that ask for nothing, at most ``MAX_TOPK_LOGPROBS`` distinct ids."""
    what = "target_prompt_logprobs"
    shape = list(tensor.shape)
    if len(shape) != 2 or shape[0] != prompt_length - 1 or shape[1] < 1:
        raise InvalidRequest(
            f"{what} must have shape [len(prompt) - 1, K] = [{prompt_length - 1}, K >= 1], "
            f"got {shape}"
        )
    _, _, ids = sparse_cells(tensor, what)
    named = ids[ids != -1]
    if not len(named):
        raise InvalidRequest(f"{what} names no token id (every cell is -1)")
    check_vocab(named, vocab_size, what)
    distinct = len(set(named.tolist()))
    if distinct > MAX_TOPK_LOGPROBS:
        raise InvalidRequest(
            f"{what} names {distinct} distinct token ids; at most {MAX_TOPK_LOGPROBS} are accepted"
        )


def check_sample_cost(bounds: Limits, spec: models.ModelSpec, command: bus.Sample) -> None:
    """Refuse a sample request that would take more of the sampler than one request may, or
    whose result could not be stored, before it is accepted."""
    prompt, max_tokens = len(command.prompt), command.params.max_tokens
    n = command.num_samples
    tokens = n * (prompt + max_tokens)
    if tokens > bounds.sample_max_tokens:
        raise InvalidRequest(
            f"num_samples x (prompt + max_tokens) is {n} x ({prompt} + {max_tokens}) = "
            f"{tokens} tokens; one sample request may ask for at most "
            f"{bounds.sample_max_tokens} (TINSMITH_SAMPLE_MAX_TOKENS): ask for fewer samples "
            "or tokens, or send several requests"
        )
    wants_prompt = (
        command.prompt_logprobs
        or command.topk_prompt_logprobs > 0
        or command.prompt_alt_tokens_k > 0
        or command.HasField("target_prompt_logprobs")
    )
    memory = limits.sample_bytes(
        spec.shape,
        spec.vocab_size,
        prompt=prompt,
        max_tokens=max_tokens,
        num_samples=n,
        prompt_scores=wants_prompt,
    )
    budget = bounds.sample_memory_mb << 20
    if memory > budget:
        raise InvalidRequest(
            f"this sample request needs about {mib(memory)} of the sampler's memory (its KV "
            f"cache for {n} x ({prompt} + {max_tokens}) tokens of {spec.name}, and its "
            f"logits); one request may take {mib(budget)} (TINSMITH_SAMPLE_MEMORY_MB): ask "
            "for fewer samples or tokens"
        )
    cells = 0  # of target_prompt_logprobs: its stored ids (int64 column indices, if CSR)
    if command.HasField("target_prompt_logprobs"):
        targets = command.target_prompt_logprobs
        if targets.WhichOneof("encoding") == "sparse_csr":
            cells = len(targets.sparse_csr.col_indices) // 8
        else:
            cells = int(targets.shape[0]) * int(targets.shape[1])
    result = limits.sample_result_bytes(
        prompt=prompt,
        max_tokens=max_tokens,
        num_samples=n,
        topk_sample=command.topk_sample_logprobs,
        topk_prompt=command.topk_prompt_logprobs,
        prompt_logprobs=command.prompt_logprobs,
        target_cells=cells,
        alt_tokens_k=command.prompt_alt_tokens_k,
    )
    if result > MAX_BODY_BYTES:
        raise InvalidRequest(
            f"the result of this sample request could take {mib(result)} ({n} samples x "
            f"{max_tokens} tokens, top-{command.topk_sample_logprobs} logprobs each); a "
            f"result is stored as one message of at most {mib(MAX_BODY_BYTES)}: ask for "
            "fewer samples, tokens or top-k logprobs, or send several requests"
        )


def check_metadata(limit: int, *parts: str | Iterable[str] | dict[str, str]) -> None:
    """Refuse a call whose tags, user_metadata and other free text take more than ``limit``
    bytes together: they are kept in the log and in memory for good."""
    total = 0
    for part in parts:
        if isinstance(part, str):
            total += len(part.encode())
        elif isinstance(part, dict):
            total += sum(len(k.encode()) + len(v.encode()) for k, v in part.items())
        else:
            total += sum(len(item.encode()) for item in part)
    if total > limit:
        raise InvalidRequest(
            f"the call's tags, user_metadata and names take {total} bytes; at most {limit} are "
            "accepted (TINSMITH_MAX_METADATA_BYTES)"
        )


def check_vocab(tokens: list[int] | np.ndarray, vocab_size: int, what: str) -> None:
    """Refuse token ids outside ``[0, vocab_size)`` (Python integers of any size too)."""
    if not len(tokens):
        return
    if isinstance(tokens, np.ndarray):
        low, high = int(tokens.min()), int(tokens.max())
    else:
        low, high = min(tokens), max(tokens)
    if low < 0 or high >= vocab_size:
        bad = int(low) if low < 0 else int(high)
        digits = str(bad)
        shown = digits if len(digits) <= 40 else f"{digits[:20]}...({len(digits)} digits)"
        raise InvalidRequest(
            f"{what} contains token id {shown}, outside the vocabulary: ids must be in "
            f"[0, {vocab_size})"
        )


def check_lora(bounds: Limits, lora: bus.LoraConfig) -> None:
    if not 1 <= lora.rank <= bounds.max_lora_rank:
        raise InvalidRequest(
            f"LoRA rank {lora.rank} is outside [1, {bounds.max_lora_rank}], this server's "
            "range (TINSMITH_MAX_LORA_RANK)"
        )
    if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
        raise InvalidRequest("lora_config must train at least one of mlp, attn and unembed")
