"""The JSON shapes of Tinker requests, read into the operations' typed requests with clear
errors: the HTTP face's translator.

Owns: reading fields out of the SDK's JSON bodies (ignoring unknown fields, since newer SDKs add
some), and saying precisely which field was wrong and what is accepted. Does not own: what the
operation does with them (operations.py), or checks that need the state (a token id against the
model's vocabulary: the operation knows the model).
"""

from __future__ import annotations

import math
import re
from typing import Any

from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest
from tinsmith.limits import (
    INT32_MAX,
    INT64_MAX,
    MAX_METADATA_ENTRIES,
    MAX_NUM_SAMPLES,
    MAX_TOPK_LOGPROBS,
    TTL_MAX_S,
    UINT64_MAX,
)
from tinsmith.tensors import tensor_proto_from_json

from . import operations as ops

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


def _short(value: object) -> str:
    digits = str(value)
    return digits if len(digits) <= 40 else f"{digits[:20]}...({len(digits)} digits)"


def lora_config(value: Any) -> bus.LoraConfig:
    """A LoRA config (its rank bounded by what the field holds; the operation checks it against
    the server's maximum)."""
    if not isinstance(value, dict):
        raise InvalidRequest("field 'lora_config' is required: {rank, train_mlp, train_attn, ...}")
    rank = req_int(value, "rank", minimum=1, maximum=INT32_MAX, default=32)
    config = bus.LoraConfig(
        rank=rank,
        train_mlp=bool(value.get("train_mlp", True)),
        train_attn=bool(value.get("train_attn", True)),
        train_unembed=bool(value.get("train_unembed", True)),
    )
    if value.get("seed") is not None:
        config.seed = req_int(value, "seed", minimum=0, maximum=UINT64_MAX)
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
        token_ids(ids, f"prompt chunk {i} tokens")
        tokens.extend(ids)
    return tokens


def token_ids(ids: list[int], what: str) -> list[int]:
    """Token ids as the wire holds them (int32, non-negative); the operation checks them
    against the model's vocabulary."""
    bad = next((t for t in ids if not 0 <= t <= INT32_MAX), None)
    if bad is not None:
        raise InvalidRequest(
            f"{what} contains token id {_short(bad)}, outside the vocabulary: ids are in "
            "[0, vocab_size)"
        )
    return ids


def sampling_params(value: Any) -> tp.SamplingParams:
    value = {} if value is None else value
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
        params.stop_tokens.values.extend(token_ids(stop, "stop token ids"))
        params.stop_tokens.SetInParent()  # [] means: no stop at all, not even end-of-sequence
    else:
        raise InvalidRequest("stop must be a string, a list of strings, or a list of token ids")
    return params


def target_prompt_logprobs(value: Any) -> tp.Tensor:
    """The token ids to score at each prompt position, as an int64 tensor (the operation checks
    its shape against the prompt, and its ids against the vocabulary)."""
    what = "target_prompt_logprobs"
    if not isinstance(value, dict):
        raise InvalidRequest(f"{what} must be a TensorData object")
    tensor = tensor_proto_from_json(value, what)
    if tensor.dtype != tp.DTYPE_INT64:
        raise InvalidRequest(f"{what} must be an int64 tensor of token ids")
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


# -- Tinker JSON bodies as the operations' typed requests --------------------------------------


def create_session(body: dict[str, Any]) -> ops.CreateSession:
    return ops.CreateSession(
        tags=tuple(str_list(body, "tags")),
        user_metadata=str_map(body, "user_metadata"),
        project_id=text(body, "project_id"),
        display_name=opt_str(body, "display_name") or "",
        sdk_version=opt_str(body, "sdk_version") or "",
    )


def session_ref(body: dict[str, Any]) -> ops.SessionRef:
    return ops.SessionRef(req_str(body, "session_id"))


def finish_session(session_id: str, body: dict[str, Any]) -> ops.SessionRef:
    reason = body.get("reason") or {}
    if not isinstance(reason, dict) or not isinstance(reason.get("type", ""), str):
        raise InvalidRequest("field 'reason' must be an object like {'type': 'success'}")
    return ops.SessionRef(session_id, reason.get("type", ""), opt_str(body, "detail") or "")


def create_model(body: dict[str, Any]) -> ops.CreateModel:
    optimizer = body.get("optimizer_config") or {"type": "adamw"}
    family = optimizer.get("type", "adamw") if isinstance(optimizer, dict) else None
    return ops.CreateModel(
        session_id=req_str(body, "session_id"),
        model_seq_id=req_int(body, "model_seq_id", minimum=0, maximum=INT32_MAX),
        base_model=req_str(body, "base_model"),
        lora=lora_config(body.get("lora_config")),
        optimizer=family if isinstance(family, str) else repr(family),
        user_metadata=str_map(body, "user_metadata"),
    )


def load_weights(body: dict[str, Any]) -> ops.LoadState | ops.LoadWeights:
    """Two forms: create a run from a checkpoint (``session_id`` + ``model_seq_id``, sent by
    ``create_training_client_from_state*``), or load one into a run (``model_id`` + ``seq_id``,
    sent by the deprecated ``TrainingClient.load_state*``)."""
    path = req_str(body, "path")
    with_optimizer = bool(body.get("optimizer", False))
    if body.get("model_id"):
        return ops.LoadWeights(
            model_id=req_str(body, "model_id"),
            seq_id=req_int(body, "seq_id", minimum=1, maximum=INT32_MAX),
            path=path,
            with_optimizer=with_optimizer,
        )
    return ops.LoadState(
        session_id=req_str(body, "session_id"),
        model_seq_id=req_int(body, "model_seq_id", minimum=0, maximum=INT32_MAX),
        path=path,
        with_optimizer=with_optimizer,
        base_model=opt_str(body, "base_model") or "",
        user_metadata=str_map(body, "user_metadata"),
    )


def model_ref(body: dict[str, Any]) -> ops.ModelRef:
    return ops.ModelRef(req_str(body, "model_id"))


def forward_backward(payload: bytes) -> ops.ForwardBackward:
    request = tp.ForwardBackwardRequest()
    try:
        request.ParseFromString(payload)
    except Exception as exc:
        raise InvalidRequest(
            "the body is not a valid tinker ForwardBackwardRequest protobuf message, the one "
            "form accepted (tinker SDKs before 0.25 send JSON unless the client config asks for "
            "protobuf, as this server's does)"
        ) from exc
    return ops.ForwardBackward(request)


def optim_step(body: dict[str, Any]) -> ops.OptimStep:
    return ops.OptimStep(
        model_id=req_str(body, "model_id"),
        seq_id=req_int(body, "seq_id", minimum=1, maximum=INT32_MAX),
        adam=adam_params(body.get("adam_params")),
    )


def save_weights(body: dict[str, Any], kind: bus.CheckpointKind) -> ops.SaveWeights:
    ttl = body.get("ttl_seconds")
    counter = body.get("sampling_session_seq_id")
    return ops.SaveWeights(
        model_id=req_str(body, "model_id"),
        seq_id=req_int(body, "seq_id", minimum=1, maximum=INT32_MAX),
        kind=kind,
        name=opt_str(body, "path") or "",
        overwrite=bool(body.get("overwrite", False)),
        ttl_seconds=None
        if ttl is None
        else req_int(body, "ttl_seconds", minimum=1, maximum=TTL_MAX_S),
        sampling_session_seq_id=None
        if counter is None
        else req_int(body, "sampling_session_seq_id", minimum=0, maximum=INT32_MAX),
        user_metadata=str_map(body, "user_metadata"),
        encrypted=bool(body.get("age_encryption_recipients")),
    )


def create_sampler(body: dict[str, Any]) -> ops.CreateSampler:
    return ops.CreateSampler(
        session_id=req_str(body, "session_id"),
        sampling_session_seq_id=req_int(
            body, "sampling_session_seq_id", minimum=0, maximum=INT32_MAX
        ),
        base_model=opt_str(body, "base_model") or "",
        model_path=opt_str(body, "model_path") or "",
    )


def sample(body: dict[str, Any], *, stream: bool = False) -> ops.Sample:
    sampler_id = req_str(body, "sampling_session_id")
    seq_id = req_int(body, "seq_id", minimum=0, maximum=INT64_MAX)
    command = bus.Sample(
        prompt=model_input(body.get("prompt")),
        params=sampling_params(body.get("sampling_params")),
        num_samples=req_int(body, "num_samples", minimum=1, default=1, maximum=MAX_NUM_SAMPLES),
        prompt_logprobs=bool(body.get("prompt_logprobs", False)),
        topk_prompt_logprobs=req_int(
            body, "topk_prompt_logprobs", minimum=0, maximum=MAX_TOPK_LOGPROBS, default=0
        ),
        topk_sample_logprobs=req_int(
            body, "topk_sample_logprobs", minimum=0, maximum=MAX_TOPK_LOGPROBS, default=0
        ),
        prompt_alt_tokens_k=req_int(
            body, "prompt_alt_tokens_k", minimum=0, maximum=MAX_TOPK_LOGPROBS, default=0
        ),
    )
    targets = body.get("target_prompt_logprobs")
    if targets is not None:
        command.target_prompt_logprobs.CopyFrom(target_prompt_logprobs(targets))
    if body.get("prompt_logprobs_last_n") is not None:
        command.prompt_logprobs_last_n = req_int(
            body, "prompt_logprobs_last_n", minimum=0, maximum=INT32_MAX
        )
    return ops.Sample(
        sampler_id=sampler_id,
        seq_id=seq_id,
        command=command,
        stream=stream,
    )


def request_ref(body: dict[str, Any]) -> ops.RequestRef:
    return ops.RequestRef(req_str(body, "request_id"))
