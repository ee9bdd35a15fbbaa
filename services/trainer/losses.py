"""The Tinker built-in loss functions, as the Tinker documentation defines them.

Owns: the catalogue of built-in losses (``LOSSES``: each one's loss_fn_inputs and loss_fn_config
keys), the validation of one datum's inputs and of a loss_fn_config, and the loss math itself:
target log-probabilities from per-datum logits, the per-token loss terms, their total (the tensor
``backward()`` runs on) and the loss metrics. Does not own: the forward pass or the padding of a
batch, decoding tensors off the wire, or encoding the outputs (engine.py and handlers.py do).

Every loss is a SUM of per-token terms over tokens and datums, never a mean, as the docs say
("for all objectives we sum the token-level losses over the sequence length"). With p the
learner's target log-probability, q the sampler's (``logprobs``), A ``advantages``, w ``weights``
and r = exp(p - q), the per-token terms are:

- ``cross_entropy``:       -w * p  (w defaults to ones; (N, K) targets give (N, K) terms)
- ``importance_sampling``: -r * A
- ``ppo``:                 -min(r * A, clamp(r, lo, hi) * A)
- ``cispo``:               -sg(clamp(r, lo, hi)) * p * A
- ``dro``:                 -(p * A - beta / 2 * (p - q)^2)
- ``gspo``:                -min(s_t * A, clamp(s_t, lo, hi) * A), with the sequence ratio
  s = exp(mean over the tokens that ``sequence_ratio_mask`` marks of (p - q)) and the GSPO-token
  ratio s_t = sg(s) * exp(p - sg(p)): s's value, each token's own gradient.

sg is stop-gradient. lo and hi bound the RATIO itself (defaults 0.8 and 1.2, i.e. epsilon 0.2);
a per-token ``clip_low_threshold`` / ``clip_high_threshold`` loss_fn_input overrides the
loss_fn_config scalar of the same name. Sources: https://tinker-docs.thinkingmachines.ai/losses
(and its per-loss pages /tinker/losses/{ppo,cispo,dro,gspo}), and the cookbook's
tutorials/202_loss_functions.py for the 0.8 / 1.2 defaults.

Where the docs are silent, this module chooses (and says so where it matters): ``beta`` defaults
to 0.05 (the docs' own example value); ``sequence_ratio_mask`` is required for ``gspo``, since a
default that counted prompt positions (whose sampler logprob is a placeholder 0) into the
sequence ratio would silently wreck it; a sequence whose mask marks no token has log-ratio 0
(ratio 1), as masked means in RL code divide by max(count, 1); loss_fn_inputs and loss_fn_config
keys a loss does not read are refused, not ignored, so a typo fails loudly. Not here: the SDK's
``stable_reinforce`` (alpha; it needs stability info recorded by the sampler) and ``custom``.

The catalogue of losses and the validation of their inputs and config are torch-free and live in
the shared library (tinsmith/losses.py), where the gateway uses them too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tinsmith.failures import InvalidRequest
from tinsmith.losses import resolve_config, spec_for


@dataclass
class LossResult:
    """One batch's loss: ``total`` to backpropagate, and what goes back to the client."""

    total: torch.Tensor
    """Scalar: the sum of every datum's ``elementwise`` terms, with its autograd graph."""
    logprobs: list[torch.Tensor]
    """Per datum, detached: the target log-probabilities, shaped like its target_tokens."""
    elementwise: list[torch.Tensor]
    """Per datum, detached: the per-token loss terms, shaped like its ``logprobs``."""
    metrics: dict[str, float]
    """``name:reduction`` keys, always with ``loss:sum``."""


def compute(
    loss_fn: str,
    logits: Sequence[torch.Tensor],
    inputs: Sequence[Mapping[str, torch.Tensor]],
    config: Mapping[str, object] | None,
) -> LossResult:
    """Run ``loss_fn`` over a batch: ``logits[i]`` is datum i's (n_i, V) logits.

    ``inputs[i]`` is datum i's loss_fn_inputs as dense tensors, already checked by
    ``check_inputs``. One fused log_softmax per datum gives the target log-probabilities
    (``target_logprobs``), then ``from_logprobs`` applies the loss. The trainer's engine computes
    the target log-probabilities itself, a chunk of positions at a time, and calls
    ``from_logprobs``."""
    spec_for(loss_fn)  # an unknown loss is refused before anything is computed
    if len(logits) != len(inputs):
        raise ValueError(f"{len(logits)} logits tensors for {len(inputs)} datums")
    lps = [
        target_logprobs(datum_logits, datum_inputs["target_tokens"], i)
        for i, (datum_logits, datum_inputs) in enumerate(zip(logits, inputs, strict=True))
    ]
    return from_logprobs(loss_fn, lps, inputs, config)


def from_logprobs(
    loss_fn: str,
    lps: Sequence[torch.Tensor],
    inputs: Sequence[Mapping[str, torch.Tensor]],
    config: Mapping[str, object] | None,
    names: Sequence[int] | None = None,
) -> LossResult:
    """Run ``loss_fn`` over a batch whose target log-probabilities are known: ``lps[i]`` is datum
    i's, shaped like its target_tokens (float32, with their autograd graph when gradients are
    wanted); errors call it datum ``names[i]`` (default ``i``: a part of a request names its
    datums by their place in the request). ``inputs`` move to the log-probabilities' device
    here; the loss math runs once, vectorised over the batch's concatenated tokens. Each datum's
    terms depend on that datum alone (gspo's sequence ratio included), so the terms of a batch
    cut into parts are the terms of the whole, and the totals add up.

    Metrics: ``loss:sum`` always. The RL losses add ``ratio:mean``, the mean importance ratio
    (for gspo, each token's sequence ratio) over the tokens with a nonzero advantage, the ones
    that carry a policy-gradient signal (prompt positions carry 0), 1.0 if there are none; the
    clipped ones add ``clip_fraction:mean``, the share of those tokens whose ratio lies outside
    [low, high]; gspo adds ``sequence_ratio:mean``, its sequence ratio averaged over datums.
    """
    spec = spec_for(loss_fn)
    cfg = resolve_config(loss_fn, config)
    if len(lps) != len(inputs):
        raise ValueError(f"{len(lps)} logprobs tensors for {len(inputs)} datums")
    if not lps:
        raise InvalidRequest("forward_backward needs at least one datum")
    device = lps[0].device
    name = list(names) if names is not None else list(range(len(lps)))
    shapes = [lp.shape for lp in lps]
    p = torch.cat([lp.reshape(-1) for lp in lps])

    def flat(key: str, default: float | None = None) -> torch.Tensor:
        """The batch's values of one input, concatenated like ``p``; ``default`` where absent."""
        parts = []
        for i, (lp, datum_inputs) in enumerate(zip(lps, inputs, strict=True)):
            value = datum_inputs.get(key)
            if value is None:
                if default is None:
                    raise InvalidRequest(
                        f"datum {name[i]}: loss_fn {loss_fn!r} needs loss_fn_inputs[{key!r}]"
                    )
                parts.append(torch.full((lp.numel(),), default, dtype=p.dtype, device=device))
            elif value.numel() != lp.numel():
                raise InvalidRequest(
                    f"datum {name[i]}: loss_fn_inputs[{key!r}] has shape {tuple(value.shape)}; "
                    f"expected {tuple(lp.shape)}"
                )
            else:
                parts.append(value.to(device=device, dtype=p.dtype).reshape(-1))
        return torch.cat(parts)

    stats: dict[str, torch.Tensor] = {}
    if spec.name == "cross_entropy":
        elementwise = -(flat("weights", 1.0) * p)
    else:
        q = flat("logprobs")
        advantages = flat("advantages")
        active = advantages != 0
        ratio = torch.exp(p - q)
        if spec.name == "importance_sampling":
            elementwise = -(ratio * advantages)
        elif spec.name == "dro":
            elementwise = -(p * advantages - 0.5 * cfg["beta"] * (p - q) ** 2)
        else:
            low = flat("clip_low_threshold", cfg["clip_low_threshold"])
            high = flat("clip_high_threshold", cfg["clip_high_threshold"])
            _check_thresholds(low, high, shapes, name)
            if spec.name == "gspo":
                marked = flat("sequence_ratio_mask")
                ratio, stats["sequence_ratio:mean"] = _gspo_ratio(p, q, marked, shapes)
            clipped = torch.clamp(ratio, min=low, max=high)
            if spec.name == "cispo":
                elementwise = -(clipped.detach() * p * advantages)
            else:  # ppo and gspo: the pessimistic minimum of the two surrogates
                elementwise = -torch.minimum(ratio * advantages, clipped * advantages)
            outside = (ratio.detach() < low) | (ratio.detach() > high)
            stats["clip_fraction:mean"] = _masked_mean(outside.to(p.dtype), active, 0.0)
        stats["ratio:mean"] = _masked_mean(ratio.detach(), active, 1.0)

    total = elementwise.sum()
    keys = ["loss:sum", *stats]
    values = torch.stack([total.detach(), *stats.values()]).tolist()
    return LossResult(
        total=total,
        logprobs=_unflatten(p.detach(), shapes),
        elementwise=_unflatten(elementwise.detach(), shapes),
        metrics=dict(zip(keys, (float(v) for v in values), strict=True)),
    )


def _unflatten(values: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Cut the batch's concatenated per-token values back into one tensor per datum."""
    out, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(values[start : start + size].reshape(shape))
        start += size
    return out


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, index: int) -> torch.Tensor:
    """log_softmax(logits) at the targets, in float32: (n,) or (n, K), one fused log_softmax per
    datum. ``index`` names the datum in errors."""
    logits = logits.float()
    n, vocab = logits.shape
    ids = targets.to(device=logits.device, dtype=torch.long)
    check_targets(ids, n, vocab, index)
    return pick(logits, ids)


def pick(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits) at ``ids``, (n,) or (n, K), for float32 ``logits`` (n, V)."""
    if ids.ndim == 1:  # the fused kernel: log_softmax + pick, forward and backward
        return -torch.nn.functional.cross_entropy(logits, ids, reduction="none")
    return torch.log_softmax(logits, dim=-1).gather(-1, ids)


def check_targets(ids: torch.Tensor, n: int, vocab: int, index: int) -> None:
    """``InvalidRequest`` unless datum ``index``'s target ids have a row per model_input token
    and lie in the vocabulary."""
    if ids.shape[0] != n:
        raise InvalidRequest(
            f"datum {index}: target_tokens has {ids.shape[0]} rows for {n} model_input tokens"
        )
    if ids.numel():
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.numel():
            raise InvalidRequest(
                f"datum {index}: target_tokens holds token id {int(bad[0])}, outside the "
                f"model's vocabulary of {vocab}"
            )


def _gspo_ratio(
    p: torch.Tensor, q: torch.Tensor, mask: torch.Tensor, shapes: Sequence[torch.Size]
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO-token ratio per token (s's value, the token's own gradient), and mean s over datums.

    s = exp(mean over the datum's marked tokens of sg(p) - q); a datum with no marked token has
    s = 1 (its masked mean divides by max(count, 1), as RL code does).
    """
    import torch

    lengths = torch.tensor([math.prod(shape) for shape in shapes], device=p.device)
    datum = torch.repeat_interleave(torch.arange(len(shapes), device=p.device), lengths)
    marked = (mask != 0).to(p.dtype)
    zeros = torch.zeros(len(shapes), dtype=p.dtype, device=p.device)
    log_sums = zeros.index_add(0, datum, (p.detach() - q) * marked)
    counts = zeros.index_add(0, datum, marked)
    sequence_log_ratio = log_sums / counts.clamp(min=1.0)
    ratio = torch.exp(sequence_log_ratio[datum] + p - p.detach())
    return ratio, torch.exp(sequence_log_ratio).mean()


def _check_thresholds(
    low: torch.Tensor, high: torch.Tensor, shapes: Sequence[torch.Size], names: Sequence[int]
) -> None:
    """Refuse a token whose resolved low threshold is above its high one."""
    crossed = (low > high).nonzero()
    if crossed.numel():
        token = int(crossed[0, 0])
        ends = np.cumsum([math.prod(shape) for shape in shapes])
        datum = int(np.searchsorted(ends, token, side="right"))
        position = token - int(ends[datum]) + math.prod(shapes[datum])
        raise InvalidRequest(
            f"datum {names[datum]}: at token {position} the clip_low_threshold "
            f"{float(low[token])} is above the clip_high_threshold {float(high[token])}"
        )


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, empty: float) -> torch.Tensor:
    """Mean of ``values`` where ``mask``; ``empty`` when nothing is selected (no NaN metrics)."""
    import torch

    count = mask.sum()
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, empty))
