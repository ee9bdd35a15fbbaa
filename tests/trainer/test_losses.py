"""The Tinker built-in losses against plain, loop-based float64 references of the doc formulas.

Each reference below is written from the Tinker docs (https://tinker-docs.thinkingmachines.ai/
losses and its per-loss pages), token by token, without calling the module under test; the
module's loss value, per-token terms, logprobs and gradient w.r.t. the logits must match it.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest
import torch

from services.trainer.losses import compute
from tinsmith.failures import InvalidRequest
from tinsmith.losses import LOSSES, check_inputs, resolve_config

VOCAB = 13
LENGTHS = (5, 9, 1, 14)

Scalars = list[torch.Tensor]  # one float64 0-d tensor per token, with its autograd graph
Floats = list[float]
# A reference loss: (p, q, A, low, high, beta) -> one loss term per token.
Terms = Callable[[Scalars, Floats, Floats, Floats, Floats, float], Scalars]


def _logits(seed: int, lengths: tuple[int, ...] = LENGTHS) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(2.0 * torch.randn(n, VOCAB, generator=gen)).requires_grad_(True) for n in lengths]


def _targets(seed: int, lengths: tuple[int, ...], k: int | None = None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (lambda n: (n,)) if k is None else (lambda n: (n, k))
    return [torch.randint(0, VOCAB, shape(n), generator=gen) for n in lengths]


def _reference_logprob(row: torch.Tensor, target: int) -> torch.Tensor:
    """log softmax(row)[target], spelled out."""
    return row[target] - torch.log(torch.exp(row).sum())


def _reference_logprobs(logits64: list[torch.Tensor], targets: list[torch.Tensor]) -> list[Any]:
    """Per datum: a list of per-token log-probabilities (a list of K of them for (N, K))."""
    out: list[Any] = []
    for rows, tokens in zip(logits64, targets, strict=True):
        if tokens.ndim == 1:
            out.append([_reference_logprob(rows[t], int(tokens[t])) for t in range(len(tokens))])
        else:
            out.append(
                [
                    [_reference_logprob(rows[t], int(tokens[t, j])) for j in range(tokens.shape[1])]
                    for t in range(tokens.shape[0])
                ]
            )
    return out


def _as64(logits: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.detach().double().requires_grad_(True) for x in logits]


def _assert_matches(
    result_total: torch.Tensor,
    logits: list[torch.Tensor],
    ref_total: torch.Tensor,
    logits64: list[torch.Tensor],
) -> None:
    """Same loss value, and the same gradient w.r.t. every datum's logits."""
    result_total.backward()  # type: ignore[no-untyped-call]
    ref_total.backward()  # type: ignore[no-untyped-call]
    torch.testing.assert_close(
        result_total.detach().double(), ref_total.detach(), rtol=1e-5, atol=1e-6
    )
    for ours, theirs in zip(logits, logits64, strict=True):
        assert ours.grad is not None
        # A datum whose every reference term is clipped (a constant) gets no gradient at all.
        expected = theirs.grad if theirs.grad is not None else torch.zeros_like(theirs)
        torch.testing.assert_close(ours.grad.double(), expected, rtol=1e-5, atol=1e-6)


# -- cross_entropy ----------------------------------------------------------------------------


def test_cross_entropy_sums_weighted_nll_with_negative_weights() -> None:
    """-sum w * log p, with weights of either sign, per position."""
    logits = _logits(0)
    targets = _targets(0, LENGTHS)
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(n, generator=gen) for n in LENGTHS]
    inputs = [{"target_tokens": t, "weights": w} for t, w in zip(targets, weights, strict=True)]

    result = compute("cross_entropy", logits, inputs, {})

    logits64 = _as64(logits)
    ref_lp = _reference_logprobs(logits64, targets)
    ref_terms = [
        [-float(w[t]) * lp[t] for t in range(len(lp))]
        for lp, w in zip(ref_lp, weights, strict=True)
    ]
    ref_total = sum(term for datum in ref_terms for term in datum)
    assert isinstance(ref_total, torch.Tensor)
    for i, n in enumerate(LENGTHS):
        assert result.logprobs[i].shape == (n,) and result.elementwise[i].shape == (n,)
        torch.testing.assert_close(
            result.logprobs[i].double(), torch.stack(ref_lp[i]).detach(), rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(
            result.elementwise[i].double(),
            torch.stack(ref_terms[i]).detach(),
            rtol=1e-5,
            atol=1e-6,
        )
    assert result.metrics["loss:sum"] == pytest.approx(float(ref_total.detach()), rel=1e-5)
    _assert_matches(result.total, logits, ref_total, logits64)


def test_cross_entropy_with_k_targets_per_position_weighs_each_target() -> None:
    """(N, K) targets and weights: K separate weighted terms at every position, all summed."""
    k = 3
    logits = _logits(1)
    targets = _targets(1, LENGTHS, k=k)
    gen = torch.Generator().manual_seed(8)
    weights = [torch.randn(n, k, generator=gen) for n in LENGTHS]
    inputs = [{"target_tokens": t, "weights": w} for t, w in zip(targets, weights, strict=True)]

    result = compute("cross_entropy", logits, inputs, None)

    logits64 = _as64(logits)
    ref_lp = _reference_logprobs(logits64, targets)
    ref_total = torch.zeros((), dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        ref_terms = torch.stack(
            [
                torch.stack([-float(weights[i][t, j]) * ref_lp[i][t][j] for j in range(k)])
                for t in range(n)
            ]
        )
        ref_total = ref_total + ref_terms.sum()
        assert result.logprobs[i].shape == (n, k) and result.elementwise[i].shape == (n, k)
        torch.testing.assert_close(
            result.elementwise[i].double(), ref_terms.detach(), rtol=1e-5, atol=1e-6
        )
    _assert_matches(result.total, logits, ref_total, logits64)


def test_cross_entropy_weights_default_to_ones() -> None:
    targets = _targets(2, LENGTHS)
    without = compute("cross_entropy", _logits(2), [{"target_tokens": t} for t in targets], {})
    ones = [{"target_tokens": t, "weights": torch.ones(len(t))} for t in targets]
    with_ones = compute("cross_entropy", _logits(2), ones, {})
    torch.testing.assert_close(without.total, with_ones.total)
    assert without.metrics["loss:sum"] == pytest.approx(
        -sum(lp.sum().item() for lp in without.logprobs)
    )


# -- the RL losses ----------------------------------------------------------------------------


def _ppo_term(ratio: torch.Tensor, a: float, low: float, high: float) -> torch.Tensor:
    """-min(r A, clip(r, low, high) A), by cases: the clipped branch is a constant."""
    r = float(ratio.detach())
    if a >= 0:
        objective = a * ratio if r < high else a * high * torch.ones_like(ratio)
    else:
        objective = a * ratio if r > low else a * low * torch.ones_like(ratio)
    return -objective


def _is_terms(
    p: Scalars, q: Floats, adv: Floats, low: Floats, high: Floats, beta: float
) -> Scalars:
    return [-torch.exp(p[t] - q[t]) * adv[t] for t in range(len(p))]


def _ppo_terms(
    p: Scalars, q: Floats, adv: Floats, low: Floats, high: Floats, beta: float
) -> Scalars:
    return [_ppo_term(torch.exp(p[t] - q[t]), adv[t], low[t], high[t]) for t in range(len(p))]


def _cispo_terms(
    p: Scalars, q: Floats, adv: Floats, low: Floats, high: Floats, beta: float
) -> Scalars:
    terms: Scalars = []
    for t in range(len(p)):
        coefficient = min(
            max(math.exp(float(p[t].detach()) - q[t]), low[t]), high[t]
        )  # a plain number
        terms.append(-coefficient * p[t] * adv[t])
    return terms


def _dro_terms(
    p: Scalars, q: Floats, adv: Floats, low: Floats, high: Floats, beta: float
) -> Scalars:
    return [-(p[t] * adv[t] - 0.5 * beta * (p[t] - q[t]) ** 2) for t in range(len(p))]


def _gspo_terms(
    p: Scalars, q: Floats, adv: Floats, low: Floats, high: Floats, beta: float, mask: Floats
) -> Scalars:
    marked = [t for t in range(len(p)) if mask[t] != 0]
    mean_log_ratio = (
        sum(float(p[t].detach()) - q[t] for t in marked) / len(marked) if marked else 0.0
    )
    s = math.exp(mean_log_ratio)
    # s's value, each token's own gradient: s * exp(p - stopgrad(p)).
    return [
        _ppo_term(s * torch.exp(p[t] - float(p[t].detach())), adv[t], low[t], high[t])
        for t in range(len(p))
    ]


def _rl_inputs(
    seed: int, logits: list[torch.Tensor], targets: list[torch.Tensor]
) -> list[dict[str, torch.Tensor]]:
    """Sampler logprobs near the learner's, so ratios straddle [0.8, 1.2]; mixed-sign advantages
    with a few zeros, as prompt positions have."""
    gen = torch.Generator().manual_seed(seed + 2)
    inputs = []
    for rows, tokens in zip(logits, targets, strict=True):
        p = torch.log_softmax(rows.detach(), -1).gather(-1, tokens[:, None])[:, 0]
        n = len(tokens)
        q = p + (torch.rand(n, generator=gen) - 0.5) * 0.8
        advantages = torch.randn(n, generator=gen)
        advantages[torch.rand(n, generator=gen) < 0.2] = 0.0
        mask = (torch.rand(n, generator=gen) < 0.7).float()
        inputs.append(
            {"target_tokens": tokens, "logprobs": q, "advantages": advantages, "mask": mask}
        )
    return inputs


def _reference_rl(
    loss_fn: str,
    logits64: list[torch.Tensor],
    inputs: list[dict[str, torch.Tensor]],
    config: Mapping[str, float],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    terms_fn: dict[str, Terms] = {
        "importance_sampling": _is_terms,
        "ppo": _ppo_terms,
        "cispo": _cispo_terms,
        "dro": _dro_terms,
    }
    targets = [datum["target_tokens"] for datum in inputs]
    ref_lp = _reference_logprobs(logits64, targets)
    total = torch.zeros((), dtype=torch.float64)
    per_datum: list[torch.Tensor] = []
    for lp, datum in zip(ref_lp, inputs, strict=True):
        n = len(lp)
        q = [float(x) for x in datum["logprobs"]]
        adv = [float(x) for x in datum["advantages"]]
        low = (
            [float(x) for x in datum["clip_low_threshold"]]
            if "clip_low_threshold" in datum
            else ([config.get("clip_low_threshold", 0.8)] * n)
        )
        high = (
            [float(x) for x in datum["clip_high_threshold"]]
            if "clip_high_threshold" in datum
            else [config.get("clip_high_threshold", 1.2)] * n
        )
        beta = config.get("beta", 0.05)
        if loss_fn == "gspo":
            mask = [float(x) for x in datum["sequence_ratio_mask"]]
            terms = _gspo_terms(lp, q, adv, low, high, beta, mask)
        else:
            terms = terms_fn[loss_fn](lp, q, adv, low, high, beta)
        per_datum.append(torch.stack(terms))
        total = total + per_datum[-1].sum()
    return total, per_datum


def _module_inputs(
    loss_fn: str, inputs: list[dict[str, torch.Tensor]]
) -> list[dict[str, torch.Tensor]]:
    """The loss_fn_inputs a client would send for ``loss_fn`` (the mask only for gspo)."""
    out = []
    for datum in inputs:
        sent = {k: v for k, v in datum.items() if k != "mask"}
        if loss_fn == "gspo":
            sent["sequence_ratio_mask"] = datum["mask"]
        out.append(sent)
    return out


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro", "gspo"])
def test_rl_loss_matches_the_doc_formula_in_value_terms_and_gradient(loss_fn: str) -> None:
    logits = _logits(10)
    targets = _targets(10, LENGTHS)
    inputs = _module_inputs(loss_fn, _rl_inputs(10, logits, targets))
    ratios = torch.cat(
        [
            torch.exp(
                torch.log_softmax(x.detach(), -1).gather(-1, d["target_tokens"][:, None])[:, 0]
                - d["logprobs"]
            )
            for x, d in zip(logits, inputs, strict=True)
        ]
    )
    assert (ratios < 0.8).any() and (ratios > 1.2).any()  # the data straddles the clip range
    assert ((ratios > 0.8) & (ratios < 1.2)).any()

    result = compute(loss_fn, logits, inputs, {})

    logits64 = _as64(logits)
    ref_total, ref_terms = _reference_rl(loss_fn, logits64, inputs, {})
    for ours, theirs in zip(result.elementwise, ref_terms, strict=True):
        torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-5, atol=1e-6)
    ref_lp = _reference_logprobs(logits64, targets)
    for ours, theirs in zip(result.logprobs, ref_lp, strict=True):
        torch.testing.assert_close(
            ours.double(), torch.stack(theirs).detach(), rtol=1e-5, atol=1e-6
        )
    assert result.metrics["loss:sum"] == pytest.approx(
        float(ref_total.detach()), rel=1e-5, abs=1e-6
    )
    assert all(key.count(":") == 1 for key in result.metrics)
    _assert_matches(result.total, logits, ref_total, logits64)


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo", "gspo"])
def test_config_thresholds_apply_and_per_datum_tensors_override_them(loss_fn: str) -> None:
    """Config scalars replace 0.8 / 1.2; a datum's own per-token thresholds beat the config."""
    logits = _logits(20)
    targets = _targets(20, LENGTHS)
    inputs = _module_inputs(loss_fn, _rl_inputs(20, logits, targets))
    # Datum 1: every ratio 1.15 with a positive advantage, so its high threshold decides it.
    gen = torch.Generator().manual_seed(21)
    n = LENGTHS[1]
    p1 = torch.log_softmax(logits[1].detach(), -1).gather(-1, targets[1][:, None])[:, 0]
    inputs[1]["logprobs"] = p1 - math.log(1.15)
    inputs[1]["advantages"] = 0.1 + torch.rand(n, generator=gen)
    inputs[1]["clip_low_threshold"] = 0.6 + 0.3 * torch.rand(n, generator=gen)
    inputs[1]["clip_high_threshold"] = 1.05 + 0.05 * torch.rand(n, generator=gen)
    config = {"clip_low_threshold": 0.97, "clip_high_threshold": 1.03}

    result = compute(loss_fn, logits, inputs, config)

    logits64 = _as64(logits)
    ref_total, ref_terms = _reference_rl(loss_fn, logits64, inputs, config)
    for ours, theirs in zip(result.elementwise, ref_terms, strict=True):
        torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-5, atol=1e-6)
    _assert_matches(result.total, logits, ref_total, logits64)

    # Each override matters: datum 1's terms differ under its own thresholds (high in
    # [1.05, 1.1]), the config's (1.03) and the defaults' (1.2, leaving 1.15 unclipped).
    bare = [{k: v for k, v in d.items() if not k.startswith("clip_")} for d in inputs]
    config_only = compute(loss_fn, _logits(20), bare, config)
    defaults_only = compute(loss_fn, _logits(20), bare, {})
    assert not torch.allclose(config_only.elementwise[1], result.elementwise[1])
    assert not torch.allclose(defaults_only.elementwise[1], config_only.elementwise[1])
    assert not torch.allclose(defaults_only.elementwise[1], result.elementwise[1])


def test_dro_honours_beta() -> None:
    logits = _logits(30)
    inputs = _module_inputs("dro", _rl_inputs(30, logits, _targets(30, LENGTHS)))
    totals = {}
    for beta in (0.0, 0.05, 2.0):
        fresh = _logits(30)
        result = compute("dro", fresh, inputs, {"beta": beta})
        logits64 = _as64(fresh)
        ref_total, _ = _reference_rl("dro", logits64, inputs, {"beta": beta})
        _assert_matches(result.total, fresh, ref_total, logits64)
        totals[beta] = result.metrics["loss:sum"]
    assert totals[0.0] < totals[0.05] < totals[2.0]  # a bigger quadratic penalty costs more
    default = compute("dro", _logits(30), inputs, None)
    assert default.metrics["loss:sum"] == pytest.approx(totals[0.05])


def test_gspo_sequence_ratio_uses_only_the_marked_tokens() -> None:
    """Sampler logprobs at unmarked tokens do not enter the sequence ratio; marked ones do."""
    logits = _logits(40)
    inputs = _module_inputs("gspo", _rl_inputs(40, logits, _targets(40, LENGTHS)))
    base = compute("gspo", _logits(40), inputs, {})

    moved_unmarked = [dict(d) for d in inputs]
    moved_marked = [dict(d) for d in inputs]
    for original, unmarked, marked in zip(inputs, moved_unmarked, moved_marked, strict=True):
        in_ratio = original["sequence_ratio_mask"] != 0
        unmarked["logprobs"] = torch.where(in_ratio, original["logprobs"], original["logprobs"] - 3)
        marked["logprobs"] = torch.where(in_ratio, original["logprobs"] - 0.5, original["logprobs"])
    same = compute("gspo", _logits(40), moved_unmarked, {})
    changed = compute("gspo", _logits(40), moved_marked, {})
    assert same.metrics["loss:sum"] == pytest.approx(base.metrics["loss:sum"], rel=1e-6)
    assert changed.metrics["loss:sum"] != pytest.approx(base.metrics["loss:sum"], rel=1e-3)

    # A sequence with nothing marked has ratio 1: plain -A * exp(p - sg(p)) terms.
    unmarked_everywhere = [
        dict(d, sequence_ratio_mask=torch.zeros(len(d["logprobs"]))) for d in inputs
    ]
    fresh = _logits(40)
    result = compute("gspo", fresh, unmarked_everywhere, {})
    assert result.metrics["sequence_ratio:mean"] == pytest.approx(1.0)
    logits64 = _as64(fresh)
    ref_total, _ = _reference_rl("gspo", logits64, unmarked_everywhere, {})
    _assert_matches(result.total, fresh, ref_total, logits64)


def test_rl_metrics_report_ratio_and_clipping_over_tokens_with_an_advantage() -> None:
    logits = _logits(50)
    inputs = _module_inputs("ppo", _rl_inputs(50, logits, _targets(50, LENGTHS)))
    result = compute("ppo", logits, inputs, {})
    p = torch.cat(result.logprobs)
    q = torch.cat([d["logprobs"] for d in inputs])
    active = torch.cat([d["advantages"] for d in inputs]) != 0
    ratio = torch.exp(p - q)[active]
    assert result.metrics["ratio:mean"] == pytest.approx(ratio.mean().item(), rel=1e-5)
    clipped = ((ratio < 0.8) | (ratio > 1.2)).float().mean().item()
    assert result.metrics["clip_fraction:mean"] == pytest.approx(clipped)
    assert result.metrics["loss:sum"] == pytest.approx(
        sum(e.sum().item() for e in result.elementwise), rel=1e-5
    )


# -- validation -------------------------------------------------------------------------------


def _np_rl(n: int) -> dict[str, np.ndarray]:
    return {
        "target_tokens": np.zeros(n, np.int64),
        "logprobs": np.full(n, -1.0, np.float32),
        "advantages": np.ones(n, np.float32),
    }


def test_check_inputs_accepts_what_each_loss_documents() -> None:
    check_inputs("cross_entropy", {"target_tokens": np.zeros(4, np.int64)}, 4, 0)
    check_inputs(
        "cross_entropy",
        {"target_tokens": np.zeros((4, 2), np.int64), "weights": -np.ones((4, 2), np.float32)},
        4,
        0,
    )
    for loss_fn in ("importance_sampling", "ppo", "cispo", "dro"):
        check_inputs(loss_fn, _np_rl(4), 4, 0)
    check_inputs("gspo", {**_np_rl(4), "sequence_ratio_mask": np.ones(4, np.float32)}, 4, 0)
    thresholds = {"clip_low_threshold": np.full(4, 0.5, np.float32)}
    check_inputs("ppo", {**_np_rl(4), **thresholds}, 4, 0)


def test_an_unknown_loss_is_refused_with_the_accepted_names() -> None:
    with pytest.raises(InvalidRequest) as caught:
        check_inputs("grpo", _np_rl(3), 3, 0)
    for name in LOSSES:
        assert name in caught.value.detail
    with pytest.raises(InvalidRequest, match="unknown loss_fn 'grpo'"):
        compute("grpo", _logits(0, (3,)), [{}], {})


def test_missing_advantages_names_the_datum_and_the_key() -> None:
    inputs = _np_rl(5)
    del inputs["advantages"]
    with pytest.raises(
        InvalidRequest, match=r"datum 2: loss_fn 'ppo' needs .*'advantages'.*\(5,\)"
    ):
        check_inputs("ppo", inputs, 5, 2)
    with pytest.raises(InvalidRequest, match="'sequence_ratio_mask'"):
        check_inputs("gspo", _np_rl(5), 5, 0)


def test_wrong_lengths_and_shapes_are_refused_with_the_expected_shape() -> None:
    with pytest.raises(InvalidRequest, match=r"datum 1: .*'target_tokens'.* shape \(6,\).*\(5,\)"):
        check_inputs(
            "importance_sampling", {**_np_rl(5), "target_tokens": np.zeros(6, np.int64)}, 5, 1
        )
    with pytest.raises(InvalidRequest, match=r"'logprobs'.* shape \(4,\); expected \(5,\)"):
        check_inputs("ppo", {**_np_rl(5), "logprobs": np.zeros(4, np.float32)}, 5, 0)
    # (N, K) targets only where the loss takes them, and weights shaped like the targets.
    with pytest.raises(InvalidRequest, match=r"shape \(5, 2\).*expects.*\(5,\)"):
        check_inputs("ppo", {**_np_rl(5), "target_tokens": np.zeros((5, 2), np.int64)}, 5, 0)
    with pytest.raises(InvalidRequest, match=r"'weights'.*shape \(5,\); expected shape \(5, 2\)"):
        check_inputs(
            "cross_entropy",
            {"target_tokens": np.zeros((5, 2), np.int64), "weights": np.ones(5, np.float32)},
            5,
            0,
        )
    with pytest.raises(InvalidRequest, match=r"\(5, 0\)"):
        check_inputs("cross_entropy", {"target_tokens": np.zeros((5, 0), np.int64)}, 5, 0)


def test_bad_values_dtypes_and_unknown_keys_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="integer token ids"):
        check_inputs("cross_entropy", {"target_tokens": np.zeros(3, np.float32)}, 3, 0)
    with pytest.raises(InvalidRequest, match="negative token id"):
        check_inputs("cross_entropy", {"target_tokens": np.array([1, -1, 2])}, 3, 0)
    with pytest.raises(InvalidRequest, match="NaN or infinity"):
        check_inputs("ppo", {**_np_rl(3), "advantages": np.array([1, np.nan, 0], np.float32)}, 3, 0)
    with pytest.raises(InvalidRequest, match=r"does not take loss_fn_inputs\['mask'\]"):
        check_inputs("importance_sampling", {**_np_rl(3), "mask": np.ones(3, np.float32)}, 3, 0)
    with pytest.raises(InvalidRequest, match="outside the model's vocabulary of 13"):
        compute("cross_entropy", _logits(0, (2,)), [{"target_tokens": torch.tensor([0, 13])}], {})


def test_loss_fn_config_is_checked_and_defaulted() -> None:
    assert resolve_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_config("dro", {"beta": 1}) == {"beta": 1.0}
    with pytest.raises(InvalidRequest, match=r"'importance_sampling' does not take .*'beta'"):
        resolve_config("importance_sampling", {"beta": 0.1})
    with pytest.raises(InvalidRequest, match="clip_low_threshold <= clip_high_threshold"):
        resolve_config("cispo", {"clip_low_threshold": 1.3})
    with pytest.raises(InvalidRequest, match="must be a number"):
        resolve_config("dro", {"beta": "0.1"})
    # A per-token low threshold above the (config) high one is refused at that token.
    logits = _logits(0, (3,))
    datum = {
        **{k: torch.from_numpy(v) for k, v in _np_rl(3).items()},
        "clip_low_threshold": torch.tensor([0.8, 1.5, 0.8]),
    }
    with pytest.raises(InvalidRequest, match=r"datum 0: at token 1 the clip_low_threshold 1\.5"):
        compute("ppo", logits, [datum], {})


def test_the_catalogue_and_checks_import_without_torch() -> None:
    """The gateway must be able to validate requests without torch installed."""
    code = (
        "import sys, numpy as np; import tinsmith.losses as m; "
        "m.check_inputs('cross_entropy', {'target_tokens': np.zeros(2, int)}, 2, 0); "
        "m.resolve_config('ppo', {'clip_low_threshold': 0.9}); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
