"""The JSON shapes of Tinker requests, read into bus messages with clear errors.

Owns: reading fields out of the SDK's JSON bodies (ignoring unknown fields, since newer SDKs add
some), and saying precisely which field was wrong and what is accepted. Does not own: what the
operation does with them (handlers.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest
from tinsmith.limits import (
    INT32_MAX,
    INT64_MAX,
    MAX_METADATA_ENTRIES,
    MAX_TOPK_LOGPROBS,
    UINT64_MAX,
)
from tinsmith.tensors import sparse_cells, tensor_proto_from_json

# What a sample without max_tokens gets.
DEFAULT_MAX_TOKENS = 256


def req_str(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"field {name!r} is required and must be a non-empty string")
    return value


class NonFinite:
    """What the JSON reader makes of ``NaN``, ``Infinity`` and ``-Infinity`` (Python's parser
    accepts them; no number in the Tinker API may be one): not a number, so whichever field
    holds one refuses it, by name."""

    def __init__(self, literal: str) -> None:
        self.literal = literal

    def __repr__(self) -> str:
        return self.literal


def text(body: dict[str, Any], name: str, maximum: int = 1024) -> str:
    """An optional free-text field ("" when absent): printable, at most ``maximum`` characters."""
    value = opt_str(body, name) or ""
    if len(value) > maximum or not value.isprintable():
        raise InvalidRequest(
            f"field {name!r} must be at most {maximum} printable characters, got {value!r:.60}"
        )
    return value


def opt_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"field {name!r} must be a string")
    return value


def req_int(
    body: dict[str, Any],
    name: str,
    *,
    minimum: int = -INT64_MAX - 1,
    maximum: int = INT64_MAX,
    default: int | None = None,
) -> int:
    """An integer field within ``[minimum, maximum]`` (by default what an int64 holds: every
    integer ends up in a protobuf field)."""
    value = body.get(name)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"field {name!r} is required and must be an integer")
    if value < minimum:
        raise InvalidRequest(f"field {name!r} must be >= {minimum}, got {value}")
    if value > maximum:
        raise InvalidRequest(f"field {name!r} must be <= {maximum}, got {_short(value)}")
    return value


def number(
    body: dict[str, Any],
    name: str,
    default: float | None = None,
    *,
    minimum: float = -math.inf,
    maximum: float = math.inf,
) -> float:
    """A finite number within ``[minimum, maximum]``: NaN and the infinities are refused
    wherever a number is read, whether they came as JSON's literals (``NonFinite``), as floats
    from gRPC, or as integers too large for a float."""
    value = body.get(name, default)
    if isinstance(value, NonFinite):
        raise InvalidRequest(f"field {name!r} must be a finite number, got {value.literal}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"field {name!r} is required and must be a number")
    try:
        number = float(value)
    except OverflowError:  # an integer of hundreds of digits
        number = math.inf
    if not math.isfinite(number):
        raise InvalidRequest(f"field {name!r} must be a finite number, got {number}")
    if not minimum <= number <= maximum:
        raise InvalidRequest(f"field {name!r} must be in [{minimum}, {maximum}], got {number}")
    return number


def str_list(body: dict[str, Any], name: str) -> list[str]:
    value = body.get(name) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidRequest(f"field {name!r} must be a list of strings")
    if len(value) > MAX_METADATA_ENTRIES:
        raise InvalidRequest(
            f"field {name!r} has {len(value)} entries; at most {MAX_METADATA_ENTRIES} are accepted"
        )
    return value


def str_map(body: dict[str, Any], name: str) -> dict[str, str]:
    value = body.get(name) or {}
    if not isinstance(value, dict) or not all(
        isinstance(v, str | int | float | bool) for v in value.values()
    ):
        raise InvalidRequest(f"field {name!r} must be an object of strings")
    if len(value) > MAX_METADATA_ENTRIES:
        raise InvalidRequest(
            f"field {name!r} has {len(value)} entries; at most {MAX_METADATA_ENTRIES} are accepted"
        )
    return {str(k): str(v) for k, v in value.items()}


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


def _short(value: object) -> str:
    digits = str(value)
    return digits if len(digits) <= 40 else f"{digits[:20]}...({len(digits)} digits)"


def lora_config(value: Any, max_rank: int) -> bus.LoraConfig:
    if not isinstance(value, dict):
        raise InvalidRequest("field 'lora_config' is required: {rank, train_mlp, train_attn, ...}")
    rank = req_int(value, "rank", minimum=1, default=32)
    if rank > max_rank:
        raise InvalidRequest(
            f"LoRA rank {_short(rank)} is above this server's maximum of {max_rank} "
            "(TINSMITH_MAX_LORA_RANK)"
        )
    config = bus.LoraConfig(
        rank=rank,
        train_mlp=bool(value.get("train_mlp", True)),
        train_attn=bool(value.get("train_attn", True)),
        train_unembed=bool(value.get("train_unembed", True)),
    )
    if value.get("seed") is not None:
        config.seed = req_int(value, "seed", minimum=0, maximum=UINT64_MAX)
    if not (config.train_mlp or config.train_attn or config.train_unembed):
        raise InvalidRequest("lora_config must train at least one of mlp, attn and unembed")
    return config


def adam_params(value: Any) -> bus.AdamParams:
    if not isinstance(value, dict):
        raise InvalidRequest(
            "field 'adam_params' is required: {learning_rate, beta1, beta2, eps, weight_decay, "
            "grad_clip_norm}"
        )
    adam = bus.AdamParams(
        learning_rate=number(value, "learning_rate", 1e-4),
        beta1=number(value, "beta1", 0.9),
        beta2=number(value, "beta2", 0.95),
        eps=number(value, "eps", 1e-12),
        weight_decay=number(value, "weight_decay", 0.0),
        grad_clip_norm=number(value, "grad_clip_norm", 0.0),
    )  # all finite: NaN slipped past the comparisons below, and ruined the run
    if adam.learning_rate < 0 or not 0 <= adam.beta1 < 1 or not 0 <= adam.beta2 < 1:
        raise InvalidRequest("adam_params needs learning_rate >= 0 and 0 <= beta1, beta2 < 1")
    if adam.eps <= 0 or adam.weight_decay < 0 or adam.grad_clip_norm < 0:
        raise InvalidRequest("adam_params needs eps > 0, weight_decay >= 0, grad_clip_norm >= 0")
    return adam


def model_input(value: Any) -> list[int]:
    """The tokens of a JSON ModelInput (chunks of type encoded_text)."""
    if not isinstance(value, dict) or not isinstance(value.get("chunks"), list):
        raise InvalidRequest("field 'prompt' must be a ModelInput: {'chunks': [...]}")
    tokens: list[int] = []
    for i, chunk in enumerate(value["chunks"]):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise InvalidRequest(
                f"prompt chunk {i} is {kind!r}; only encoded_text chunks are accepted by the "
                "text models this server hosts"
            )
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise InvalidRequest(f"prompt chunk {i} 'tokens' must be a list of integers")
        tokens.extend(ids)
    return tokens


def sampling_params(value: Any, vocab_size: int) -> tp.SamplingParams:
    value = value or {}
    if not isinstance(value, dict):
        raise InvalidRequest("field 'sampling_params' must be an object")
    params = tp.SamplingParams(
        max_tokens=req_int(
            value, "max_tokens", minimum=1, maximum=INT32_MAX, default=DEFAULT_MAX_TOKENS
        )
        if value.get("max_tokens") is not None
        else DEFAULT_MAX_TOKENS,
        # float32 on the wire: a larger temperature would become infinity there.
        temperature=number(value, "temperature", 1.0, minimum=0.0, maximum=1e30),
        top_k=req_int(value, "top_k", default=-1, minimum=-1, maximum=INT32_MAX),
        top_p=number(value, "top_p", 1.0),
    )
    if value.get("seed") is not None:
        params.seed = req_int(value, "seed", minimum=-(2**63), maximum=UINT64_MAX) % 2**64
    if not 0 < params.top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k == 0:
        raise InvalidRequest(f"top_k must be -1 (no limit) or >= 1, got {params.top_k}")
    stop = value.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        pass  # stop at end-of-sequence
    elif isinstance(stop, list) and stop and all(isinstance(s, str) for s in stop):
        if any(s == "" for s in stop):
            raise InvalidRequest("stop strings must not be empty")
        params.stop_strs.values.extend(stop)
        params.stop_strs.SetInParent()
    elif isinstance(stop, list) and all(
        isinstance(s, int) and not isinstance(s, bool) for s in stop
    ):
        check_vocab(stop, vocab_size, "stop token ids")
        params.stop_tokens.values.extend(stop)
        params.stop_tokens.SetInParent()  # [] means: no stop at all, not even end-of-sequence
    else:
        raise InvalidRequest("stop must be a string, a list of strings, or a list of token ids")
    return params


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
        raise InvalidRequest(
            f"{what} contains token id {_short(bad)}, outside the vocabulary: ids must be in "
            f"[0, {vocab_size})"
        )


def target_prompt_logprobs(value: Any, prompt_length: int, vocab_size: int) -> tp.Tensor:
    """The token ids to score at each prompt position: int64 ``[len(prompt) - 1, K]``, dense or
    CSR, ``-1`` for cells that ask for nothing, and at most ``MAX_TOPK_LOGPROBS`` distinct ids
    (the cost is ``len(prompt)`` times that, bounded like a top-k width)."""
    what = "target_prompt_logprobs"
    if not isinstance(value, dict):
        raise InvalidRequest(f"{what} must be a TensorData object")
    tensor = tensor_proto_from_json(value, what)
    if tensor.dtype != tp.DTYPE_INT64:
        raise InvalidRequest(f"{what} must be an int64 tensor of token ids")
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
    distinct = len(np.unique(named))
    if distinct > MAX_TOPK_LOGPROBS:
        raise InvalidRequest(
            f"{what} names {distinct} distinct token ids; at most {MAX_TOPK_LOGPROBS} are accepted"
        )
    return tensor


# A run's JSON request names its run and seq_id near the start, as the SDK writes it.
_JSON_MODEL_ID = re.compile(rb'"model_id"\s*:\s*"([A-Za-z0-9_:\-]{1,200})"')
_JSON_SEQ_ID = re.compile(rb'"seq_id"\s*:\s*([0-9]{1,10})\b')


def json_ids(prefix: bytes) -> tuple[str, int] | None:
    """The run and seq_id the first bytes of a JSON request name, if they name both."""
    model_id, seq_id = _JSON_MODEL_ID.search(prefix), _JSON_SEQ_ID.search(prefix)
    if model_id is None or seq_id is None:
        return None
    return model_id.group(1).decode(), int(seq_id.group(1))


def protobuf_ids(prefix: bytes) -> tuple[str, int] | None:
    """The run (field 1) and seq_id (field 2) at the start of a serialized
    ``ForwardBackwardRequest``: protobuf writes fields in the order of their numbers, so they
    come first, and the first bytes are enough (the whole message may be too large to read)."""
    found: dict[int, str | int] = {}
    pos = 0
    try:
        while pos < len(prefix) and len(found) < 2:
            key, pos = _varint(prefix, pos)
            field, wire_type = key >> 3, key & 7
            if wire_type == 0:
                value, pos = _varint(prefix, pos)
                if field == 2:
                    found[2] = value
            elif wire_type == 2:
                length, pos = _varint(prefix, pos)
                if field == 1 and pos + length > len(prefix):
                    return None  # cut off within the run's id
                if field == 1:
                    found[1] = prefix[pos : pos + length].decode()
                pos += length
            else:
                return None
            if field > 2:
                break
    except (IndexError, UnicodeDecodeError):
        return None
    model_id, seq_id = found.get(1), found.get(2)
    if not isinstance(model_id, str) or not isinstance(seq_id, int):
        return None
    return model_id, seq_id


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")
