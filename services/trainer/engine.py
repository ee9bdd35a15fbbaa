"""The trainer's torch engine: one frozen base model per base-model name, and per run its own
LoRA adapter (a named PEFT adapter on that base) and its own AdamW optimizer.

Owns: every torch call of the trainer; it runs on the process's one compute thread. Does not own:
ordering, the bus or storage (handlers.py). Losses are per-token sums, as the Tinker docs define
them, never means.
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
from tinsmith.failures import InvalidRequest, NotFound
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
            self.load(model_id, checkpoint, with_optimizer=command.load_optimizer)
        return str(self.model_dirs[command.base_model])

    def load(self, model_id: str, directory: Path, *, with_optimizer: bool) -> None:
        """Replace the run's adapter weights with a checkpoint's; restore its optimizer state
        too, or start a fresh optimizer."""
        run, model = self._activate(model_id)
        config = json.loads((directory / artifacts.ADAPTER_CONFIG).read_text())
        if int(config.get("r", 0)) != run.rank:
            raise InvalidRequest(
                f"the checkpoint has LoRA rank {config.get('r')}, the run has rank {run.rank}"
            )
        state = load_file(str(directory / artifacts.ADAPTER_WEIGHTS))
        result: Any = set_peft_model_state_dict(model, state, adapter_name=run.adapter)
        missing = [k for k in result.missing_keys if f".{run.adapter}." in k]
        if missing or result.unexpected_keys:
            raise InvalidRequest(
                "the checkpoint's adapter does not fit this run (different target modules?): "
                f"{len(missing)} missing and {len(result.unexpected_keys)} unexpected tensors"
            )
        run.optimizer = torch.optim.AdamW(list(run.params.values()), lr=1e-4)
        if with_optimizer:
            saved = directory / artifacts.OPTIMIZER_STATE
            if not saved.exists():
                raise InvalidRequest(
                    "the checkpoint has no optimizer state (a sampler checkpoint?)"
                )
            tensors = load_file(str(saved))
            for name, param in run.params.items():
                prefix = _neutral(name, run.adapter) + "."
                entry = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
                if entry:
                    run.optimizer.state[param] = entry
        pending = directory / artifacts.GRADIENTS
        grads = load_file(str(pending)) if pending.exists() else {}
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
        ``ForwardBackwardOutput``."""
        _run, model = self._activate(model_id)
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
        with torch.set_grad_enabled(grad):
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            result = losses.compute(
                request.loss_fn,
                [logits[i, :n] for i, n in enumerate(lengths)],
                inputs,
                config_of(request),
            )
            if grad:
                result.total.backward()  # type: ignore[no-untyped-call]
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
        """One AdamW step on the run's own accumulated gradients, then zero them."""
        run, _ = self._activate(model_id)
        params = [p for p in run.params.values() if p.grad is not None]
        max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        for group in run.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        before = [p.detach().clone() for p in params]
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        update = math.sqrt(
            sum(float((p.detach() - b).pow(2).sum()) for p, b in zip(params, before, strict=True))
        )
        return {
            "grad_norm:mean": grad_norm,
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


def _neutral(name: str, adapter: str) -> str:
    return name.replace(f".{adapter}.", ".")


def _adapter_name(model_id: str) -> str:
    """PEFT adapter names become module attribute names: no '.' and no ':'."""
    return "run_" + "".join(c if c.isalnum() else "_" for c in model_id)
