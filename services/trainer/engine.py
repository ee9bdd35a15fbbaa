"""The trainer's torch engine: one frozen base model per base-model name, and per run its own
LoRA adapter (a named PEFT adapter on that base) and its own AdamW optimizer.

Owns: every torch call of the trainer; it runs on the process's one compute thread. Does not own:
ordering, the bus or storage (handlers.py). Losses are per-token sums, as the Tinker docs define
them, never means.

A request that fails leaves its run exactly as it was: a forward_backward accumulates its
gradients only once they, its loss and its log-probabilities are all finite (a non-finite one is
``Unprocessable``, with what was not finite and its likely cause); an optim_step whose gradients
are not finite, or whose update would make a weight non-finite, is refused with the weights, the
AdamW state and the gradients as they were; a load that fails puts the adapter back, and a run
created from a checkpoint that does not load is not created.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import (
    LoraConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from tinsmith import artifacts, models
from tinsmith import lora as lora_layout
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest, NotFound, Unprocessable
from tinsmith.losses import config_of
from tinsmith.tensors import batched, decode_tensor, model_input_tokens

from . import losses


@dataclass
class Run:
    model_id: str
    base_model: str
    adapter: str
    rank: int
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.AdamW


class TrainerEngine:
    def __init__(self, cache_dir: Path, threads: int = 1) -> None:
        self.cache_dir = cache_dir
        self.threads = threads
        self.bases: dict[str, PeftModel] = {}
        self._unwrapped: dict[str, PreTrainedModel] = {}  # loaded ahead, no run on them yet
        self.model_dirs: dict[str, Path] = {}
        self.runs: dict[str, Run] = {}
        self._active: dict[str, str] = {}  # base model -> the adapter currently active on it

    def init_compute_thread(self) -> None:
        """Run on the compute thread before any work: torch's thread count is per thread."""
        torch.set_num_threads(self.threads)

    def device(self) -> str:
        """Where the runs compute: the device of the base models' weights."""
        held: list[torch.nn.Module] = [*self.bases.values(), *self._unwrapped.values()]
        for model in held:
            return str(next(model.parameters()).device)
        return "cpu"

    def loaded(self) -> dict[str, int]:
        """Each loaded base model, with how many runs (adapters) are loaded on it. Read from
        other threads (the metrics), so it only copies plain state."""
        counts = dict.fromkeys([*self._unwrapped, *self.bases], 0)
        for run in list(self.runs.values()):
            counts[run.base_model] = counts.get(run.base_model, 0) + 1
        return counts

    def load_base(self, name: str) -> None:
        """Load base model ``name`` now (the start-up preload), so its first run does not wait
        for it; the PEFT wrapping waits for that run's adapter."""
        if name not in self.bases and name not in self._unwrapped:
            self._unwrapped[name] = self._load_base(name)

    def _load_base(self, name: str) -> PreTrainedModel:
        directory = models.materialize(name, self.cache_dir)
        base: PreTrainedModel = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        base.requires_grad_(False)
        base.eval()  # type: ignore[no-untyped-call]
        self.model_dirs[name] = directory
        return base

    # -- runs ----------------------------------------------------------------------------------

    def create_run(
        self, model_id: str, command: bus.CreateModel, checkpoint: Path | None = None
    ) -> str:
        """Create the run's adapter and optimizer, from ``checkpoint`` when given (with its
        optimizer state if ``command.load_optimizer``); return the tokenizer id for get_info."""
        if model_id in self.runs:
            return str(self.model_dirs[command.base_model])
        lora = command.lora
        targets = lora_layout.target_modules(
            models.get(command.base_model).arch,
            attn=lora.train_attn,
            mlp=lora.train_mlp,
            unembed=lora.train_unembed,
        )
        config = LoraConfig(
            r=lora.rank,
            lora_alpha=lora_layout.ALPHA,
            lora_dropout=lora_layout.DROPOUT,
            target_modules=targets,
            bias="none",
        )
        adapter = _adapter_name(model_id)
        seed = lora.seed if lora.HasField("seed") else int.from_bytes(np.random.bytes(8)) >> 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed % 2**63)
            peft_model = self._with_adapter(command.base_model, adapter, config)
        params = {
            name: param for name, param in peft_model.named_parameters() if f".{adapter}." in name
        }
        for param in params.values():
            param.requires_grad_(True)
        optimizer = torch.optim.AdamW(list(params.values()), lr=1e-4)
        self.runs[model_id] = Run(
            model_id, command.base_model, adapter, lora.rank, params, optimizer
        )
        if checkpoint is not None:
            try:
                self.load(model_id, checkpoint, with_optimizer=command.load_optimizer)
            except BaseException:
                self.unload(model_id)  # a run whose checkpoint does not load is not created
                raise
        return str(self.model_dirs[command.base_model])

    def load(self, model_id: str, directory: Path, *, with_optimizer: bool) -> None:
        """Replace the run's adapter weights with a checkpoint's; restore its optimizer state
        too, or start a fresh optimizer. A checkpoint that does not fit leaves the run as it
        was."""
        run, model = self._activate(model_id)
        config = json.loads((directory / artifacts.ADAPTER_CONFIG).read_text())
        if int(config.get("r", 0)) != run.rank:
            raise InvalidRequest(
                f"the checkpoint has LoRA rank {config.get('r')}, the run has rank {run.rank}"
            )
        saved = directory / artifacts.OPTIMIZER_STATE
        if with_optimizer and not saved.exists():
            raise InvalidRequest("the checkpoint has no optimizer state (a sampler checkpoint?)")
        weights = {name: param.detach().clone() for name, param in run.params.items()}
        try:
            state = load_file(str(directory / artifacts.ADAPTER_WEIGHTS))
            result: Any = set_peft_model_state_dict(model, state, adapter_name=run.adapter)
            missing = [k for k in result.missing_keys if f".{run.adapter}." in k]
            if missing or result.unexpected_keys:
                raise InvalidRequest(
                    "the checkpoint's adapter does not fit this run (different target modules?): "
                    f"{len(missing)} missing and {len(result.unexpected_keys)} unexpected tensors"
                )
            optimizer = torch.optim.AdamW(list(run.params.values()), lr=1e-4)
            if with_optimizer:
                tensors = load_file(str(saved))
                for name, param in run.params.items():
                    prefix = _neutral(name, run.adapter) + "."
                    entry = {
                        k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)
                    }
                    if entry:
                        optimizer.state[param] = entry
            pending = directory / artifacts.GRADIENTS
            grads = load_file(str(pending)) if pending.exists() else {}
        except BaseException:
            _put_back(run, weights)
            raise
        run.optimizer = optimizer
        for name, param in run.params.items():
            grad = grads.get(_neutral(name, run.adapter))
            param.grad = None if grad is None else grad.clone()

    def unload(self, model_id: str) -> None:
        """Drop the run's adapter and optimizer from memory (after it was snapshotted)."""
        run = self.runs.pop(model_id)
        self.bases[run.base_model].delete_adapter(run.adapter)
        self._active.pop(run.base_model, None)

    def _with_adapter(self, base_model: str, adapter: str, config: LoraConfig) -> PeftModel:
        peft_model = self.bases.get(base_model)
        if peft_model is None:
            base = self._unwrapped.pop(base_model, None)
            if base is None:
                base = self._load_base(base_model)
            peft_model = get_peft_model(base, config, adapter_name=adapter)
            self.bases[base_model] = peft_model
        else:
            peft_model.add_adapter(adapter, config)
        return peft_model

    def _activate(self, model_id: str) -> tuple[Run, PeftModel]:
        run = self.runs.get(model_id)
        if run is None:
            raise NotFound(f"training run {model_id!r} is not loaded on this trainer")
        model = self.bases[run.base_model]
        # On the PeftModel itself, which keeps its own record of the active adapter. That record
        # goes stale when an adapter of the same name is deleted and added again, so the engine
        # keeps its own, and skips the switch (a walk over every module) when nothing changed.
        if self._active.get(run.base_model) != run.adapter:
            model.set_adapter(run.adapter)
            self._active[run.base_model] = run.adapter
        for param in run.params.values():  # set_adapter freezes the others; keep ours trainable
            param.requires_grad_(True)
        return run, model

    # -- forward / backward --------------------------------------------------------------------

    def forward_backward(self, model_id: str, request: tp.ForwardBackwardRequest) -> bytes:
        """Run the whole batch in one right-padded forward pass, apply the loss to each datum's
        own positions, and accumulate gradients unless ``forward_only``. Returns a serialized
        ``ForwardBackwardOutput``.

        The gradients accumulated so far are set aside while this batch's are computed, and
        added to them only if everything came out finite: a batch that raises on the way, or
        whose loss, log-probabilities or gradients are not finite (``Unprocessable``), leaves
        them exactly as they were."""
        run, model = self._activate(model_id)
        tokens = [model_input_tokens(d.model_input) for d in request.data]
        lengths = [len(t) for t in tokens]
        ids = torch.zeros((len(tokens), max(lengths)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (row, n) in enumerate(zip(tokens, lengths, strict=True)):
            ids[i, :n] = torch.from_numpy(row.astype(np.int64))
            mask[i, :n] = 1
        inputs = [
            {
                name: torch.from_numpy(np.array(decode_tensor(tensor, name)))
                for name, tensor in datum.loss_fn_inputs.items()
            }
            for datum in request.data
        ]
        grad = not request.forward_only
        accumulated = {name: param.grad for name, param in run.params.items()}
        try:
            if grad:
                for param in run.params.values():
                    param.grad = None  # this batch's own gradients land here
            with torch.set_grad_enabled(grad):
                logits = model(input_ids=ids, attention_mask=mask).logits.float()
                result = losses.compute(
                    request.loss_fn,
                    [logits[i, :n] for i, n in enumerate(lengths)],
                    inputs,
                    config_of(request),
                )
                _check_loss(request.loss_fn, result, inputs)
                if grad:
                    result.total.backward()  # type: ignore[no-untyped-call]
                    summed = _accumulate(run, accumulated)
        except BaseException:
            for name, param in run.params.items():
                param.grad = accumulated[name]
            raise
        if grad:
            for name, param in run.params.items():
                param.grad = summed[name]
        out = tp.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
        record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(tokens))
        record.fields["logprobs"].CopyFrom(batched([lp.numpy() for lp in result.logprobs]))
        record.fields["elementwise_loss"].CopyFrom(
            batched([el.numpy() for el in result.elementwise])
        )
        for key, value in result.metrics.items():
            out.metrics[key] = value
        return out.SerializeToString()

    # -- optimizer -----------------------------------------------------------------------------

    def optim_step(self, model_id: str, adam: bus.AdamParams) -> dict[str, float]:
        """One AdamW step on the run's own accumulated gradients, then zero them.

        Refused (``Unprocessable``), with the weights, the AdamW state and the gradients exactly
        as they were, when the gradients or their norm are not finite, or when the step would
        make a weight non-finite (a learning rate far too large, say)."""
        run, _ = self._activate(model_id)
        named = {name: p.grad for name, p in run.params.items() if p.grad is not None}
        params = [run.params[name] for name in named]
        grads = list(named.values())
        broken = [name for name, g in named.items() if not bool(torch.isfinite(g).all())]
        if broken:
            raise Unprocessable(
                f"the gradients accumulated since the last optim_step are not finite in "
                f"{len(broken)} of {len(named)} adapter tensors (first: "
                f"{_neutral(broken[0], run.adapter)}); the step was not taken"
            )
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if not bool(torch.isfinite(norm)):
            raise Unprocessable(
                "the norm of the gradients accumulated since the last optim_step overflows "
                "(they are astronomically large: a loss scaled far too high, or weights or "
                "advantages of 1e19 and more?); the step was not taken"
            )
        max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf
        if math.isfinite(max_norm):  # as clip_grad_norm_ does, on copies: a refusal restores
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for param, g in zip(params, grads, strict=True):
                param.grad = g * scale
        groups = [{k: v for k, v in g.items() if k != "params"} for g in run.optimizer.param_groups]
        state = {
            p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for p, s in run.optimizer.state.items()
        }
        before = [p.detach().clone() for p in params]
        for group in run.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        lr = adam.learning_rate
        cause = "is not finite" if not math.isfinite(lr) else "is far too large for these gradients"
        refusal = (
            f"non-finite: the learning rate {lr:g} {cause} (norm {float(norm):g}); the step was "
            "not taken"
        )
        try:
            try:
                run.optimizer.step()
            except RuntimeError as exc:  # torch refuses a step size beyond float32's range
                if "overflow" not in str(exc):
                    raise
                raise Unprocessable(f"this step would make the adapter {refusal}") from exc
            broken = [name for name in named if not bool(torch.isfinite(run.params[name]).all())]
            if broken:
                raise Unprocessable(
                    f"this step would make {len(broken)} of {len(named)} adapter tensors (first: "
                    f"{_neutral(broken[0], run.adapter)}) {refusal}"
                )
        except BaseException:
            with torch.no_grad():
                for param, weight in zip(params, before, strict=True):
                    param.copy_(weight)
            run.optimizer.state.clear()
            run.optimizer.state.update(state)
            for group, saved in zip(run.optimizer.param_groups, groups, strict=True):
                group.update(saved)
            for param, g in zip(params, grads, strict=True):
                param.grad = g
            raise
        run.optimizer.zero_grad(set_to_none=True)
        update = math.sqrt(
            sum(float((p.detach() - b).pow(2).sum()) for p, b in zip(params, before, strict=True))
        )
        return {
            "grad_norm:mean": float(norm),
            "learning_rate:mean": adam.learning_rate,
            "update_norm:mean": update,
        }

    # -- export --------------------------------------------------------------------------------

    def export(
        self, model_id: str, directory: Path, *, with_optimizer: bool, with_gradients: bool = False
    ) -> dict[str, Any]:
        """Write the run's adapter in PEFT's on-disk format into ``directory``, plus its optimizer
        state for a training checkpoint, and the gradients accumulated since the last optim_step
        for a snapshot (a run unloaded between forward_backward and optim_step must not lose
        them)."""
        run, model = self._activate(model_id)
        directory.mkdir(parents=True, exist_ok=True)
        # Adapter tensors only: by default PEFT adds the whole base lm_head when it is a LoRA
        # target, which bloats every checkpoint and would overwrite the shared base on load.
        state = get_peft_model_state_dict(
            model, adapter_name=run.adapter, save_embedding_layers=False
        )
        save_file(
            {k: v.detach().contiguous() for k, v in state.items()},
            str(directory / artifacts.ADAPTER_WEIGHTS),
        )
        config = model.peft_config[run.adapter]
        config.base_model_name_or_path = run.base_model
        config.save_pretrained(str(directory))
        if with_optimizer:
            save_file(_optimizer_tensors(run), str(directory / artifacts.OPTIMIZER_STATE))
        grads = {
            _neutral(name, run.adapter): param.grad.detach().contiguous()
            for name, param in run.params.items()
            if param.grad is not None
        }
        if with_gradients and grads:
            save_file(grads, str(directory / artifacts.GRADIENTS))
        metadata = {"model_id": model_id, "base_model": run.base_model, "lora_rank": run.rank}
        (directory / artifacts.METADATA).write_text(json.dumps(metadata))
        return metadata


def _optimizer_tensors(run: Run) -> dict[str, torch.Tensor]:
    """AdamW's per-parameter state, keyed by adapter-neutral parameter names (as PEFT keys its
    weights), so any run with the same LoRA layout can load it."""
    tensors: dict[str, torch.Tensor] = {}
    for name, param in run.params.items():
        state = run.optimizer.state.get(param, {})
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_neutral(name, run.adapter)}.{key}"] = value.detach().contiguous()
    return tensors


def _accumulate(
    run: Run, accumulated: dict[str, torch.Tensor | None]
) -> dict[str, torch.Tensor | None]:
    """The run's gradients once this batch's (in ``param.grad`` now) are added to ``accumulated``;
    ``Unprocessable`` if this batch's, or the sums, are not finite. Changes nothing itself."""
    fresh = {name: param.grad for name, param in run.params.items()}
    broken = [n for n, g in fresh.items() if g is not None and not bool(torch.isfinite(g).all())]
    if broken:
        raise Unprocessable(
            f"the gradients of this batch are not finite in {len(broken)} of {len(fresh)} "
            f"adapter tensors (first: {_neutral(broken[0], run.adapter)}), though its loss is: "
            "a loss term's gradient overflows (importance ratios or weights far too large?); "
            "nothing was accumulated"
        )
    summed: dict[str, torch.Tensor | None] = {}
    for name, new in fresh.items():
        old = accumulated[name]
        summed[name] = old if new is None else new if old is None else old + new
    broken = [n for n, g in summed.items() if g is not None and not bool(torch.isfinite(g).all())]
    if broken:
        raise Unprocessable(
            "adding the gradients of this batch to those accumulated since the last optim_step "
            f"overflows in {len(broken)} adapter tensors (first: "
            f"{_neutral(broken[0], run.adapter)}); nothing was accumulated"
        )
    return summed


def _check_loss(
    loss_fn: str, result: losses.LossResult, inputs: list[dict[str, torch.Tensor]]
) -> None:
    """``Unprocessable`` unless the batch's log-probabilities and loss terms are all finite,
    saying which datum first has a non-finite one and the likely cause."""
    for i, (lp, terms) in enumerate(zip(result.logprobs, result.elementwise, strict=True)):
        if not bool(torch.isfinite(lp).all()):
            count = int((~torch.isfinite(lp)).sum())
            raise Unprocessable(
                f"datum {i}: the model's log-probabilities are not finite at {count} of "
                f"{lp.numel()} target positions: the run's weights or its logits are not "
                "finite (an earlier step diverged?)"
            )
        if bool(torch.isfinite(terms).all()):
            continue
        count = int((~torch.isfinite(terms)).sum())
        where = f"datum {i}: the {loss_fn} loss is not finite at {count} of {terms.numel()} tokens"
        for key, value in inputs[i].items():
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise Unprocessable(f"{where}: loss_fn_inputs[{key!r}] holds non-finite values")
        q = inputs[i].get("logprobs")
        if q is not None:
            gap = float((lp.reshape(-1) - q.reshape(-1).to(lp.dtype)).abs().max())
            term = "penalty (p - q)^2" if loss_fn == "dro" else "importance ratio exp(p - q)"
            raise Unprocessable(
                f"{where}: the {term} overflows, with the model's log-probabilities p up to "
                f"{gap:g} away from the sampler's, loss_fn_inputs['logprobs'] q (a sampling "
                "logprob of -1e30, or logprobs of other tokens or of another model?)"
            )
        raise Unprocessable(f"{where}: a loss term overflows (weights or advantages too large?)")
    if not math.isfinite(float(result.total.detach())):
        raise Unprocessable(
            f"the {loss_fn} loss of the batch overflows in its sum over tokens and datums "
            "(weights or advantages too large?)"
        )


def _put_back(run: Run, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in run.params.items():
            param.copy_(weights[name])


def _neutral(name: str, adapter: str) -> str:
    return name.replace(f".{adapter}.", ".")


def _adapter_name(model_id: str) -> str:
    """PEFT adapter names become module attribute names: no '.' and no ':'."""
    return "run_" + "".join(c if c.isalnum() else "_" for c in model_id)
