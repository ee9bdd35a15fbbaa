"""The catalogue of Tinker's built-in losses, and the validation of their inputs and config.

Owns: which losses exist, the loss_fn_inputs and loss_fn_config keys each one reads (with the
config defaults), and refusing a datum or a config the loss cannot run on, with a message that
says what was wrong and what is accepted. The gateway uses it to refuse bad requests before they
are accepted; the trainer to resolve the config it runs with. Does not own: the math, which needs
torch and lives in the trainer (services/trainer/losses.py, with the formulas and their sources).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest

CLIP_LOW_DEFAULT = 0.8
CLIP_HIGH_DEFAULT = 1.2
DRO_BETA_DEFAULT = 0.05

_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_THRESHOLD_INPUTS = ("clip_low_threshold", "clip_high_threshold")
_CLIP_CONFIG = {"clip_low_threshold": CLIP_LOW_DEFAULT, "clip_high_threshold": CLIP_HIGH_DEFAULT}


@dataclass(frozen=True, eq=False)
class LossSpec:
    """What one built-in loss reads: its loss_fn_inputs keys and its loss_fn_config keys."""

    name: str
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...]
    config_defaults: Mapping[str, float]
    """The loss_fn_config keys the loss reads, each with the value used when it is absent."""
    multi_target: bool = False
    """Whether target_tokens (and weights) may be (N, K): K targets at each position."""

    @property
    def accepted_inputs(self) -> tuple[str, ...]:
        return self.required_inputs + self.optional_inputs


LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("cross_entropy", ("target_tokens",), ("weights",), {}, multi_target=True),
        LossSpec("importance_sampling", _RL_INPUTS, (), {}),
        LossSpec("ppo", _RL_INPUTS, _THRESHOLD_INPUTS, _CLIP_CONFIG),
        LossSpec("cispo", _RL_INPUTS, _THRESHOLD_INPUTS, _CLIP_CONFIG),
        LossSpec("dro", _RL_INPUTS, (), {"beta": DRO_BETA_DEFAULT}),
        LossSpec("gspo", (*_RL_INPUTS, "sequence_ratio_mask"), _THRESHOLD_INPUTS, _CLIP_CONFIG),
    )
}


def spec_for(loss_fn: str) -> LossSpec:
    """The spec of a built-in loss; an unknown name is an InvalidRequest naming the known ones."""
    spec = LOSSES.get(loss_fn)
    if spec is None:
        accepted = ", ".join(LOSSES)
        raise InvalidRequest(f"unknown loss_fn {loss_fn!r}; the built-in losses are: {accepted}")
    return spec


def check_inputs(
    loss_fn: str, inputs: Mapping[str, np.ndarray], n_tokens: int, datum_index: int
) -> None:
    """Refuse one datum's loss_fn_inputs unless ``loss_fn`` can run on them.

    Checks the loss name, that every required key is there and no unknown key is, dtypes
    (integer token ids; numeric everything else), shapes (leading length ``n_tokens``; (N, K)
    targets only where the loss takes them, with weights shaped like the targets), and values
    (finite, token ids and clip thresholds non-negative). Token ids against the vocabulary are
    checked by ``compute``, which knows the vocabulary size.
    """
    spec = spec_for(loss_fn)
    where = f"datum {datum_index}"
    for key in spec.required_inputs:
        if key not in inputs:
            raise InvalidRequest(
                f"{where}: loss_fn {loss_fn!r} needs loss_fn_inputs[{key!r}] "
                f"({_expected(spec, key, n_tokens)}), and it is missing"
            )
    for key in inputs:
        if key not in spec.accepted_inputs:
            raise InvalidRequest(
                f"{where}: loss_fn {loss_fn!r} does not take loss_fn_inputs[{key!r}]; "
                f"it takes {', '.join(spec.accepted_inputs)}"
            )

    targets = np.asarray(inputs["target_tokens"])
    if targets.dtype.kind not in "iu":
        raise InvalidRequest(
            f"{where}: loss_fn_inputs['target_tokens'] must hold integer token ids "
            f"({_expected(spec, 'target_tokens', n_tokens)}), not dtype {targets.dtype}"
        )
    ndims_ok = targets.ndim == 1 or (spec.multi_target and targets.ndim == 2)
    if not ndims_ok or targets.shape[0] != n_tokens or (targets.ndim == 2 and targets.shape[1] < 1):
        raise InvalidRequest(
            f"{where}: loss_fn_inputs['target_tokens'] has shape {tuple(targets.shape)}; "
            f"loss_fn {loss_fn!r} expects {_expected(spec, 'target_tokens', n_tokens)}, "
            f"one row per model_input token"
        )
    if targets.size and int(targets.min()) < 0:
        raise InvalidRequest(
            f"{where}: loss_fn_inputs['target_tokens'] holds the negative token id "
            f"{int(targets.min())}"
        )

    for key, value in inputs.items():
        if key == "target_tokens":
            continue
        array = np.asarray(value)
        shape = tuple(targets.shape) if key == "weights" else (n_tokens,)
        if array.dtype.kind not in "biuf":
            raise InvalidRequest(
                f"{where}: loss_fn_inputs[{key!r}] must be numeric "
                f"({_expected(spec, key, n_tokens)}), not dtype {array.dtype}"
            )
        if tuple(array.shape) != shape:
            expected = f"shape {shape}, like target_tokens" if key == "weights" else f"{shape}"
            raise InvalidRequest(
                f"{where}: loss_fn_inputs[{key!r}] has shape {tuple(array.shape)}; "
                f"expected {expected}, one entry per model_input token"
            )
        if not np.isfinite(array).all():
            raise InvalidRequest(f"{where}: loss_fn_inputs[{key!r}] holds a NaN or infinity")
        if key in _THRESHOLD_INPUTS and array.size and float(array.min()) < 0:
            raise InvalidRequest(
                f"{where}: loss_fn_inputs[{key!r}] holds {float(array.min())}; clip thresholds "
                f"bound the probability ratio and cannot be negative"
            )


def resolve_config(loss_fn: str, config: Mapping[str, object] | None) -> dict[str, float]:
    """The loss_fn_config ``loss_fn`` runs with: the given values over its defaults.

    Refuses keys the loss does not read, values that are not finite numbers, negative or crossed
    clip thresholds (low above high) and a negative ``beta``.
    """
    spec = spec_for(loss_fn)
    resolved = dict(spec.config_defaults)
    for key, value in (config or {}).items():
        if key not in spec.config_defaults:
            takes = ", ".join(spec.config_defaults) or "no keys"
            raise InvalidRequest(
                f"loss_fn {loss_fn!r} does not take loss_fn_config[{key!r}]; it takes {takes}"
            )
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequest(f"loss_fn_config[{key!r}] must be a number, not {value!r}")
        if not math.isfinite(value):
            raise InvalidRequest(f"loss_fn_config[{key!r}] must be finite, not {value}")
        resolved[key] = float(value)
    if "clip_low_threshold" in resolved:
        low, high = resolved["clip_low_threshold"], resolved["clip_high_threshold"]
        if not 0.0 <= low <= high:
            raise InvalidRequest(
                f"loss_fn_config clip thresholds bound the probability ratio and need "
                f"0 <= clip_low_threshold <= clip_high_threshold; got {low} and {high}"
            )
    if resolved.get("beta", 0.0) < 0:
        raise InvalidRequest(f"loss_fn_config['beta'] cannot be negative; got {resolved['beta']}")
    return resolved


def _expected(spec: LossSpec, key: str, n_tokens: int) -> str:
    """How a loss_fn_inputs key should look, for error messages."""
    if key == "target_tokens":
        k_shape = f" or ({n_tokens}, K)" if spec.multi_target else ""
        return f"int64 token ids of shape ({n_tokens},){k_shape}"
    if key == "weights":
        return "float32, shaped like target_tokens"
    return f"float32 of shape ({n_tokens},)"


def config_of(request: tp.ForwardBackwardRequest) -> dict[str, object]:
    """A request's loss_fn_config. The SDK writes numbers to both maps and text only to v2, so v2
    wins when it is there."""
    if request.loss_fn_config_v2:
        return {
            key: value.number if value.WhichOneof("value") == "number" else value.text
            for key, value in request.loss_fn_config_v2.items()
        }
    return dict(request.loss_fn_config)
