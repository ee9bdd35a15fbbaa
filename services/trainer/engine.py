"""The trainer's torch engine: one frozen base model per base-model name, and per run its own
LoRA adapter (a slot of the base's LoRA layer, services/lora_slots.py) and its own AdamW
optimizer.

Owns: every torch call of the trainer; it runs on the process's one compute thread. Does not own:
ordering, the bus or storage (handlers.py). Losses are per-token sums, as the Tinker docs define
them, never means.

Device and precision (services/device.py's ``Placement``; one code path for CUDA, MPS and the
CPU): base models load onto ``placement.device`` in ``placement.dtype`` (bfloat16 by default on a
GPU). LoRA parameters, their gradients and the AdamW state are float32 whatever the base (the
slots are float32, and the engine initialises each adapter in float32 from its seed, as PEFT
would, so a seed gives the same adapter on every device and dtype); logits are cast to float32
before the log-softmax, and losses and logprobs are float32. Checkpoints are PEFT's format
(``adapter_config.json`` and ``adapter_model.safetensors``, float32 CPU tensors), so a run saved
on one device loads on any other, and in PEFT and vLLM.

Runs share their base model's LoRA layer: each run's adapter is a slot of it, its parameters
``Slots.bind``'s float32 views of that slot, keyed by PEFT's adapter-neutral names (what the
checkpoints hold). A forward routes each datum's row to its run's slot, so several runs' requests
run as one pass (``forward_backward_together``): each run gets the gradients of its own rows
only, and its outputs and gradients are what it gets alone, to float32 rounding.

Memory is a budget (``placement.memory_bytes``, ``TINSMITH_DEVICE_MEMORY_MB``): the engine counts
what it holds on the device (each base model's weights, each run's adapter with its gradients and
AdamW state) and estimates each forward or forward_backward's activations from its tokens before
running it. A batch that does not fit what is free, or is longer than a slice (``slice_tokens``:
another run's request can run between two passes, ``begin`` and ``advance``), runs in micro-batches
of datums whose gradients accumulate (the outputs and gradients are the one pass's, to float32
rounding); a datum that does not fit alone runs with activation checkpointing; one that does not fit
even so, and a run or base model that does not fit, is refused with ``OutOfBudget``, which says what
is needed and what is free (the handlers unload idle runs, least recently used first, and try
again). An out-of-memory error on the device fails its request alone (``Unavailable``), with the run
as it was and the allocator's cache released. The loss reads the base model's hidden states and runs
the LM head (its LoRA included, routed per position), the float32 log-softmax and the pick of the
targets a chunk of positions at a time, so no step holds every position's float32 logits at once.

A request that fails leaves its run exactly as it was: a forward_backward accumulates its
gradients only once they, its loss and its log-probabilities are all finite (a non-finite one is
``Unprocessable``, with what was not finite and its likely cause); an optim_step whose gradients
are not finite, or whose update would make a weight non-finite, is refused with the weights, the
AdamW state and the gradients as they were; a load that fails puts the adapter back, and a run
created from a checkpoint that does not load is not created.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from opentelemetry import trace
from peft import LoraConfig
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from services import base_model, lora_slots
from services import device as devices
from services.device import MEMORY_VARIABLE, Placement
from services.lora_slots import Slots
from tinsmith import artifacts, limits, models
from tinsmith import lora as lora_layout
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest, NotFound, TinsmithError, Unavailable, Unprocessable
from tinsmith.limits import HEAD_CHUNK_BYTES, mib
from tinsmith.losses import config_of
from tinsmith.tensors import batched, decode_tensor, model_input_tokens

from . import grouping, losses

_T = TypeVar("_T")

# The activation memory of the base model's layers relative to limits.train_bytes (fitted to
# float32 on the CPU), by the base weights' dtype. Half-precision layers keep half-precision
# activations, but each LoRA module computes in float32 on a float32 copy of its input, which it
# keeps for the backward pass, so the saving is small: measured with saved-tensor hooks, every
# module a LoRA target, a bfloat16 base keeps 0.85 of what a float32 one keeps on tinsmith/small
# and 0.92 on SmolLM2-135M (tests/trainer/test_memory.py checks the bound on tinsmith/tiny).
ACTIVATION_SCALE = {torch.float32: 1.0, torch.bfloat16: 0.95, torch.float16: 0.95}
# Per adapter tensor, what a run keeps: the weights, their gradients and AdamW's two moments,
# all float32. The weights live in the base's slot stacks, which the engine counts as they are
# (padded to a rank class, with free places); the other copies are the run's own.
_RUN_COPIES = 4
# What a forward_backward holds beyond its activations, in adapter sizes: the gradients
# accumulated so far set aside, this batch's, and their sum.
_STEP_COPIES = 3
# What an optim_step holds beside its run while it computes the step aside, in adapter sizes:
# the clipped gradients, the new moments and weights, and the moments' denominators (or, once
# those are dropped, the weights' changes whose norms are measured).
_OPTIM_COPIES = 5
# On a CPU, the AdamW arithmetic of runs stepped together (and the measure of the changes it
# makes) goes at most this many bytes of weights at a time, in whole runs (a larger run alone):
# over every run's weights, moments and gradients at once it works past the caches, and 16 runs
# of tinsmith/small stepped 0.71x as fast as one after another (bench/fused_training.py, part
# 3); in groups, 0.97x to 1.02x. On a GPU, all at once: there a step's cost is its launches.
CPU_STEP_GROUP_BYTES = 4 << 20


class OutOfBudget(Unprocessable):
    """What was asked does not fit what is free of the device's memory budget. ``short`` is how
    many bytes are missing: the handlers unload idle runs to free that much, and ask again."""

    def __init__(self, detail: str, short: int) -> None:
        super().__init__(detail)
        self.short = short


def default_pass_tokens(device: torch.device) -> int:
    """The fixed cost of a forward_backward pass in tokens' worth of compute: 64 on the CPU
    (measured there: about 60 for tinsmith/small, 45 for SmolLM2-135M, ``bench/mixed_lengths.py``);
    4096 on an accelerator, where a pass's launches cost far more than its tokens (on an H200 in
    bfloat16, from fused_training's runs alone at 16 and 4096 tokens: about 2,300 tokens' worth
    for tinsmith/small and 7,300 for SmolLM2-135M's shape, docs/performance.md).
    ``TINSMITH_TRAINER_PASS_TOKENS`` overrides it."""
    return 64 if device.type == "cpu" else 4096


def default_slice_tokens(device: torch.device) -> int:
    """The most padded tokens of one pass of a request (a single datum longer than that is a
    pass of its own): a larger request runs in passes of at most this many, its gradients
    accumulating, and the trainer serves other runs' requests between them, so that no run
    waits for the whole of another's large request. The sizes of a fused pass
    (fusion.default_limits): 2048 on the CPU, 16384 on an accelerator.
    ``TINSMITH_TRAINER_SLICE_TOKENS`` overrides it (0: no bound but the memory budget)."""
    return 2048 if device.type == "cpu" else 16384


@dataclass(frozen=True)
class Pass:
    """One forward (and backward) of a request: the datums it takes, by their place in the
    request, and whether it checkpoints the base model's layers."""

    datums: tuple[int, ...]
    checkpointed: bool = False


@dataclass
class Run:
    model_id: str
    base_model: str
    slot: int  # its adapter's slot in the base's LoRA layer
    rank: int
    targets: list[str]  # the module names its adapter is on (``q_proj``...)
    # PEFT's adapter-neutral names ("base_model.model.<module>.lora_A.weight") -> the slot's
    # float32 parameters (views of the stacks).
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    state_bytes: int = 0  # on the device: its adapter, gradients and AdamW state


@dataclass
class _Base:
    """A loaded base model, frozen, with its LoRA layer installed on every module a layout can
    target."""

    model: PreTrainedModel
    slots: Slots


@dataclass
class _Batch:
    """A forward_backward's datums, decoded on the host: token ids and loss inputs."""

    tokens: list[np.ndarray[Any, Any]]
    inputs: list[dict[str, torch.Tensor]]
    lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.lengths = [len(t) for t in self.tokens]


@dataclass(eq=False)
class Passes:
    """A forward or forward_backward request of one run in progress (``TrainerEngine.begin``):
    the passes it runs in, how many have run, the log-probabilities of their datums, and the
    gradients the run had accumulated before it, set aside until its last pass."""

    run: Run
    request: tp.ForwardBackwardRequest
    batch: _Batch
    plan: list[Pass]
    accumulated: dict[str, torch.Tensor | None]
    done: int = 0
    logprobs: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.logprobs = [None] * len(self.batch.tokens)

    @property
    def backward(self) -> bool:
        return not self.request.forward_only

    @property
    def aside_bytes(self) -> int:
        """What the gradients set aside hold on the device."""
        return sum(g.numel() * g.element_size() for g in self.accumulated.values() if g is not None)


class TrainerEngine:
    def __init__(
        self,
        cache_dir: Path,
        threads: int = 1,
        placement: Placement | None = None,
        *,
        head_chunk_bytes: int = HEAD_CHUNK_BYTES,
        pass_tokens: int | None = None,
        slice_tokens: int | None = None,
    ) -> None:
        """``placement``: where and in what precision to compute, and the memory budget there
        (the service passes ``placement_from_env()``); by default the CPU in float32, with the
        machine's memory, as the tests and tools use it. ``pass_tokens``: what one more pass
        costs, in padded tokens, when a batch of mixed lengths is cut into passes of similar
        lengths (``grouping.by_length``); by default ``default_pass_tokens`` of the device.
        ``slice_tokens``: the most padded tokens of a pass (``plan``); by default
        ``default_slice_tokens`` of the device, 0 for no bound."""
        self.cache_dir = cache_dir
        self.threads = threads
        self.placement = placement or Placement(
            torch.device("cpu"), torch.float32, devices.total_memory(torch.device("cpu"))
        )
        self.head_chunk_bytes = head_chunk_bytes
        self.pass_tokens = (
            default_pass_tokens(self.placement.device) if pass_tokens is None else pass_tokens
        )
        self.slice_tokens = (
            default_slice_tokens(self.placement.device) if slice_tokens is None else slice_tokens
        )
        # The requests begun and not yet ended (``begin``): what each set aside is held too.
        self._in_progress: list[Passes] = []
        self.bases: dict[str, _Base] = {}
        self.model_dirs: dict[str, Path] = {}
        self.runs: dict[str, Run] = {}
        self._base_bytes: dict[str, int] = {}  # base model -> its weights' bytes on the device
        self._shapes: dict[str, models.Shape] = {}
        self._vocab: dict[str, int] = {}  # base model -> rows of its LM head
        self.last_plan: list[Pass] = []  # the passes of the latest forward or forward_backward

    def init_compute_thread(self) -> None:
        """Run on the compute thread before any work: torch's thread count is per thread, and
        so is the current CUDA device (CUDA events and the allocator's cache follow it)."""
        torch.set_num_threads(self.threads)
        if self.placement.device.type == "cuda":
            torch.cuda.set_device(self.placement.device)

    def device(self) -> str:
        """Where the runs compute: the placement's device, e.g. ``cuda:0`` or ``cpu``."""
        return str(self.placement.device)

    # -- memory --------------------------------------------------------------------------------

    def held_bytes(self) -> int:
        """What the engine holds on the device: its base models, their slot stacks and the runs'
        gradients and AdamW state as it counts them, or what torch has allocated there, if
        more."""
        return max(self._counted_bytes(), devices.allocated(self.placement.device))

    def _counted_bytes(self) -> int:
        stacks = sum(base.slots.nbytes() for base in self.bases.values())
        own = sum(r.state_bytes * (_RUN_COPIES - 1) // _RUN_COPIES for r in self.runs.values())
        aside = sum(passes.aside_bytes for passes in self._in_progress)
        return sum(self._base_bytes.values()) + stacks + own + aside

    def free_bytes(self) -> int:
        return self.placement.memory_bytes - self.held_bytes()

    def activation_bytes(
        self, base_model: str, lengths: Sequence[int], *, backward: bool, checkpointed: bool = False
    ) -> int:
        """The activation memory of one pass over datums of ``lengths`` tokens on a loaded base
        model (``limits.pass_bytes``, its layers' scaled to the base weights' dtype)."""
        return limits.pass_bytes(
            self._shapes[base_model],
            self._vocab[base_model],
            lengths,
            backward=backward,
            checkpointed=checkpointed,
            layer_scale=ACTIVATION_SCALE.get(self.placement.dtype, 1.0),
            head_chunk_bytes=self.head_chunk_bytes,
        )

    def plan(self, model_id: str, lengths: Sequence[int], *, backward: bool) -> list[Pass]:
        """How a forward (``backward=False``) or forward_backward over datums of ``lengths``
        tokens runs: in groups of similar lengths where that saves more padding than the passes
        cost (``grouping.by_length`` with ``pass_tokens``; one group for most batches), and
        each group within what is free of the budget and of at most ``slice_tokens`` padded
        tokens: one pass if it is within both; else consecutive micro-batches of its datums,
        each as large as is within both, and a datum that does not fit alone with activation
        checkpointing. ``OutOfBudget`` if a datum does not fit even so."""
        run = self.runs[model_id]
        free = self.free_bytes() - (_step_bytes(run) if backward else 0)
        passes: list[Pass] = []
        for group in grouping.by_length(lengths, self.pass_tokens):
            passes += self._fitted(run.base_model, lengths, group, free, backward=backward)
        return passes

    def _fitted(
        self,
        base: str,
        lengths: Sequence[int],
        datums: tuple[int, ...],
        free: int,
        *,
        backward: bool,
    ) -> list[Pass]:
        """``datums`` in passes that each fit ``free`` bytes and a slice (``plan``)."""

        def fits(taken: Sequence[int], checkpointed: bool = False) -> bool:
            widths = [lengths[i] for i in taken]
            if len(widths) > 1 and 0 < self.slice_tokens < len(widths) * max(widths):
                return False  # too long a pass for one slice (a datum alone is always one)
            need = self.activation_bytes(base, widths, backward=backward, checkpointed=checkpointed)
            return need <= free

        if fits(datums):
            return [Pass(datums)]
        passes: list[Pass] = []
        current: list[int] = []
        for i in datums:
            if current and fits([*current, i]):
                current.append(i)
                continue
            if current:
                passes.append(Pass(tuple(current)))
                current = []
            if fits([i]):
                current = [i]
            elif backward and fits([i], checkpointed=True):
                passes.append(Pass((i,), checkpointed=True))
            else:
                need = self.activation_bytes(
                    base, [lengths[i]], backward=backward, checkpointed=backward
                )
                raise OutOfBudget(
                    f"datum {i} ({lengths[i]} tokens of {base}) needs about {mib(need)} of "
                    f"device memory for its activations"
                    + (" even with activation checkpointing" if backward else "")
                    + f", and {mib(max(free, 0))} of the trainer's budget of "
                    f"{mib(self.placement.memory_bytes)} ({MEMORY_VARIABLE}) are free: "
                    f"{self._holdings()}. Send shorter sequences, or give the trainer more "
                    f"device memory ({MEMORY_VARIABLE})",
                    short=need - free,
                )
        if current:
            passes.append(Pass(tuple(current)))
        return passes

    def _holdings(self) -> str:
        bases = sum(self._base_bytes.values())
        runs = self._counted_bytes() - bases
        held = self.held_bytes()
        text = (
            f"{len(self._base_bytes)} base models hold {mib(bases)} and {len(self.runs)} runs "
            f"{mib(runs)}"
        )
        if held > bases + runs:
            text += f" ({mib(held)} allocated on {self.placement.device})"
        return text

    def _fit(self, need: int, what: str, keep: str) -> None:
        """Make sure ``need`` more bytes fit the budget: drop base models no run uses (they load
        again when asked for), other than ``keep``; ``OutOfBudget`` if that is not enough."""
        used = {run.base_model for run in self.runs.values()}
        for name in [n for n in self.bases if n != keep and n not in used]:
            if self.free_bytes() >= need:
                return
            self._drop_base(name)
        free = self.free_bytes()
        if free < need:
            raise OutOfBudget(
                f"{what} needs {mib(need)} of device memory and {mib(max(free, 0))} of the "
                f"trainer's budget of {mib(self.placement.memory_bytes)} ({MEMORY_VARIABLE}) are "
                f"free: {self._holdings()}",
                short=need - free,
            )

    def _drop_base(self, name: str) -> None:
        del self.bases[name]
        self._base_bytes.pop(name, None)
        gc.collect()
        devices.release(self.placement.device)

    def _chunk_rows(self, vocab: int) -> int:
        return limits.head_rows(vocab, self.head_chunk_bytes)

    def _on_device(self, op: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run ``fn``; an out-of-memory error on the device becomes ``Unavailable`` for this
        request alone, once ``fn`` has put its run back as it was and the memory its frames held
        is released."""
        detail = ""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not devices.is_out_of_memory(exc):
                raise
            first = str(exc).strip().split("\n", 1)[0][:400]
            detail = (
                f"the device ({self.placement.device}) ran out of memory during this {op}; the "
                f"run is as it was before it. The trainer's budget is "
                f"{mib(self.placement.memory_bytes)} ({MEMORY_VARIABLE}): {self._holdings()}, "
                "so other work on the device (another process, or fragmentation) took what the "
                "trainer planned to use; send it again, and if it recurs lower "
                f"{MEMORY_VARIABLE} or send fewer tokens per call. torch: {first}"
            )
        # Out of the except block: the failed step's frames, and the tensors they held, are gone.
        gc.collect()
        devices.release(self.placement.device)
        raise Unavailable(detail)

    def loaded(self) -> dict[str, int]:
        """Each loaded base model, with how many runs (adapters) are loaded on it. Read from
        other threads (the metrics), so it only copies plain state."""
        counts = dict.fromkeys(list(self.bases), 0)
        for run in list(self.runs.values()):
            counts[run.base_model] = counts.get(run.base_model, 0) + 1
        return counts

    def load_base(self, name: str) -> None:
        """Load base model ``name`` now (the start-up preload), so its first run does not wait
        for it."""
        if name not in self.bases:
            self._on_device("load", self._load_base, name)

    def _load_base(self, name: str) -> _Base:
        """Load ``name`` onto the device in the placement's dtype, if its weights fit, with the
        LoRA layer on every module its architecture's layout can target (empty: a run's adapter
        goes into it)."""
        directory = models.materialize(name, self.cache_dir)
        dtype = self.placement.dtype
        self._fit(base_model.weights_bytes(directory, dtype), f"base model {name}", keep=name)
        model = base_model.load(directory, self.placement)
        tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
        head = model.get_output_embeddings()  # type: ignore[no-untyped-call]
        assert isinstance(head, torch.nn.Linear)
        layout = lora_layout.LAYOUTS.get(models.get(name).arch, {})
        names = [module for group in layout.values() for module in group]
        max_rank = limits.Limits.from_env().max_lora_rank
        base = _Base(model, lora_slots.install(model, names, max_rank=max_rank))
        self._base_bytes[name] = sum(t.numel() * t.element_size() for t in tensors.values())
        self._shapes[name] = models.get(name).shape
        self._vocab[name] = head.weight.shape[0]
        self.model_dirs[name] = directory
        self.bases[name] = base
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
        seed = lora.seed if lora.HasField("seed") else int.from_bytes(np.random.bytes(8)) >> 1
        self._on_device("create_model", self._create, model_id, command, targets, seed)
        if checkpoint is not None:
            try:
                self.load(model_id, checkpoint, with_optimizer=command.load_optimizer)
            except BaseException:
                self.unload(model_id)  # a run whose checkpoint does not load is not created
                raise
        return str(self.model_dirs[command.base_model])

    def _create(
        self, model_id: str, command: bus.CreateModel, targets: list[str], seed: int
    ) -> None:
        base_model, rank = command.base_model, command.lora.rank
        base = self.bases.get(base_model) or self._load_base(base_model)
        wanted = set(targets)
        shapes = {
            path: (module.base.in_features, module.base.out_features)
            for path, module in base.slots.modules.items()
            if path.rsplit(".", 1)[-1] in wanted
        }
        adapter_bytes = sum(4 * rank * (n_in + n_out) for n_in, n_out in shapes.values())
        state_bytes = _RUN_COPIES * adapter_bytes
        # The run's own copies, and the places its rank class's stacks grow by to take it.
        need = state_bytes - adapter_bytes + base.slots.growth_bytes(rank)
        self._fit(need, f"training run {model_id} (LoRA rank {rank})", base_model)
        zeros = {
            path: (torch.zeros(rank, n_in), torch.zeros(n_out, rank))
            for path, (n_in, n_out) in shapes.items()
        }
        slot = base.slots.load(zeros, rank, lora_layout.ALPHA / rank)
        try:
            params = {
                lora_slots.peft_key(path, part): param
                for path, pair in base.slots.bind(slot).items()
                for part, param in zip("AB", pair, strict=True)
            }
            _initialise(params, seed)
            optimizer = torch.optim.AdamW(list(params.values()), lr=1e-4)
        except BaseException:
            base.slots.unload(slot)
            raise
        self.runs[model_id] = Run(
            model_id, base_model, slot, rank, targets, params, optimizer, state_bytes
        )

    def load(self, model_id: str, directory: Path, *, with_optimizer: bool) -> None:
        """Replace the run's adapter weights with a checkpoint's; restore its optimizer state
        too, or start a fresh optimizer. A checkpoint that does not fit leaves the run as it
        was. The checkpoint's float32 CPU tensors go to the run's device."""
        self._on_device("load", self._load, model_id, directory, with_optimizer)

    def _load(self, model_id: str, directory: Path, with_optimizer: bool) -> None:
        run = self._run(model_id)
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
            missing = sorted(set(run.params) - set(state))
            unexpected = sorted(set(state) - set(run.params))
            if missing or unexpected:
                raise InvalidRequest(
                    "the checkpoint's adapter does not fit this run (different target modules?): "
                    f"{len(missing)} missing and {len(unexpected)} unexpected tensors"
                )
            wrong = [n for n, p in run.params.items() if tuple(state[n].shape) != tuple(p.shape)]
            if wrong:
                raise InvalidRequest(
                    f"the checkpoint's adapter does not fit this run: {wrong[0]} has shape "
                    f"{tuple(state[wrong[0]].shape)}, the run's {tuple(run.params[wrong[0]].shape)}"
                )
            with torch.no_grad():
                for name, param in run.params.items():
                    param.copy_(state[name])
            optimizer = torch.optim.AdamW(list(run.params.values()), lr=1e-4)
            if with_optimizer:
                tensors = load_file(str(saved))
                for name, param in run.params.items():
                    prefix = name + "."
                    entry = {
                        k[len(prefix) :]: _state_on(param, k[len(prefix) :], v)
                        for k, v in tensors.items()
                        if k.startswith(prefix)
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
            grad = grads.get(name)
            param.grad = None if grad is None else grad.to(param.device, param.dtype, copy=True)

    def unload(self, model_id: str) -> None:
        """Drop the run's adapter and optimizer from memory (after it was snapshotted), and give
        the device memory they held back."""
        run = self.runs.pop(model_id)
        slots = self.bases[run.base_model].slots
        slots.unload(run.slot)
        del run
        slots.shrink()  # its place, and whatever else is free, back to the device
        devices.release(self.placement.device)

    def _run(self, model_id: str) -> Run:
        run = self.runs.get(model_id)
        if run is None:
            raise NotFound(f"training run {model_id!r} is not loaded on this trainer")
        return run

    # -- forward / backward --------------------------------------------------------------------

    def forward_backward(self, model_id: str, request: tp.ForwardBackwardRequest) -> bytes:
        """Run the batch in as few right-padded forward passes as fit the device's memory and a
        slice (one, for most batches: ``plan``), apply the loss to each datum's own positions,
        and accumulate gradients unless ``forward_only``. Returns a serialized
        ``ForwardBackwardOutput``. The same as ``begin``, then ``advance`` until it is done,
        with nothing else between the passes.

        The gradients accumulated so far are set aside while this batch's are computed, and
        added to them only if everything came out finite: a batch that raises on the way, or
        whose loss, log-probabilities or gradients are not finite (``Unprocessable``), or that
        runs out of device memory (``Unavailable``), leaves them exactly as they were."""
        passes = self.begin(model_id, request)
        try:
            while (output := self.advance(passes)) is None:
                pass
        except BaseException:
            self.abandon(passes)  # refused for want of room (the rest ends it themselves)
            raise
        return output

    def begin(self, model_id: str, request: tp.ForwardBackwardRequest) -> Passes:
        """Begin a forward or forward_backward request: decode it, plan its passes (``plan``)
        and set the run's accumulated gradients aside. Nothing is computed yet: ``advance`` runs
        the passes one at a time, and between two of them the engine may run other runs' work
        (not this run's: a run's requests go one after another). ``InvalidRequest`` and
        ``OutOfBudget`` leave the run as it was."""
        run = self._run(model_id)
        batch = self._decode(run, request)
        backward = not request.forward_only
        plan = self.plan(model_id, batch.lengths, backward=backward)
        self.last_plan = plan
        passes = Passes(run, request, batch, plan, _set_aside(run) if backward else {})
        self._in_progress.append(passes)
        return passes

    def advance(self, passes: Passes) -> bytes | None:
        """Run the request's next pass; after its last, return its serialized
        ``ForwardBackwardOutput``, its gradients added to those set aside (None before). If the
        pass no longer fits what is free of the budget (work between the passes took memory),
        ``OutOfBudget`` with the request as it was: make room and advance again. Any other
        failure ends the request, with the run as it was before ``begin``."""
        op = "forward_backward" if passes.backward else "forward"
        return self._on_device(op, self._advance, passes)

    def abandon(self, passes: Passes) -> None:
        """End a request before its last pass: the run's gradients are those set aside again.
        Nothing, for one that has ended."""
        if passes in self._in_progress:  # by identity
            self._in_progress.remove(passes)
            _restore(passes.run, passes.accumulated)

    def _advance(self, passes: Passes) -> bytes | None:
        run, batch, request = passes.run, passes.batch, passes.request
        if self.runs.get(run.model_id) is not run:  # unloaded between two passes
            self.abandon(passes)
            raise NotFound(f"training run {run.model_id!r} is not loaded on this trainer")
        step = passes.plan[passes.done]
        grad = passes.backward
        if passes.done:
            self._check_room(passes, step)
        span = trace.get_current_span()
        span.set_attribute("tinsmith.micro_batches", len(passes.plan))
        span.set_attribute("tinsmith.pass", passes.done + 1)
        span.set_attribute("tinsmith.checkpointed_datums", sum(p.checkpointed for p in passes.plan))
        config = config_of(request)
        base = self.bases[run.base_model]
        try:
            part = _Part(run, batch, list(step.datums))
            inputs = [batch.inputs[i] for i in part.datums]
            with (
                self._checkpointing(base.model, step.checkpointed),
                torch.set_grad_enabled(grad),
                base.slots.routed(_row_slots([part])),  # the backward may recompute
            ):
                (lps,) = self._target_logprobs(base, [part], grad=grad)
                if grad:
                    result = losses.from_logprobs(request.loss_fn, lps, inputs, config, part.datums)
                    _check_loss(request.loss_fn, result, inputs, part.datums)
                    result.total.backward()  # type: ignore[no-untyped-call]
            for i, lp in zip(part.datums, lps, strict=True):
                passes.logprobs[i] = lp.detach()
            passes.done += 1
            if passes.done < len(passes.plan):
                return None
            # The outputs and metrics of the whole batch at once, as one pass would give them.
            ready = [lp for lp in passes.logprobs if lp is not None]
            result = losses.from_logprobs(request.loss_fn, ready, batch.inputs, config)
            _check_loss(request.loss_fn, result, batch.inputs)
            summed = _accumulate(run, passes.accumulated) if grad else {}
        except BaseException:
            self.abandon(passes)
            raise
        self._in_progress.remove(passes)
        _restore(run, summed)
        return _output(result, len(batch.tokens))

    def _check_room(self, passes: Passes, step: Pass) -> None:
        """``OutOfBudget`` where a later pass of a request no longer fits what is free, as the
        plan made at ``begin`` reckoned it (its gradients set aside are held already)."""
        run = passes.run
        lengths = [passes.batch.lengths[i] for i in step.datums]
        need = self.activation_bytes(
            run.base_model, lengths, backward=passes.backward, checkpointed=step.checkpointed
        )
        steps = _step_bytes(run) if passes.backward else 0
        free = self.free_bytes() + passes.aside_bytes - steps
        if need > free:
            raise OutOfBudget(
                f"pass {passes.done + 1} of {len(passes.plan)} of this request ({len(lengths)} "
                f"datums, {sum(lengths)} tokens of {run.base_model}) needs about {mib(need)} of "
                f"device memory, and {mib(max(free, 0))} of the trainer's budget of "
                f"{mib(self.placement.memory_bytes)} ({MEMORY_VARIABLE}) are free since other "
                f"work took some: {self._holdings()}",
                short=need - free,
            )

    def forward_backward_together(
        self, asks: Sequence[tuple[str, tp.ForwardBackwardRequest]]
    ) -> list[bytes | Exception | None]:
        """Several runs' forward_backward (or forward) requests on one base model as one pass:
        every datum a row of one right-padded batch, routed to its run's slot, each run's own
        loss function and config on its own rows, and one backward. A run's rows meet no other
        run's, so each run's outputs and gradients are what ``forward_backward`` gives it alone,
        to float32 rounding, and its accumulated gradients change only as they would there.

        For each request, in order: its serialized output; the error that fails it alone (an
        invalid request, or a loss or gradients not finite, which leave its run as it was); or
        None where it was not run and is to be run alone with ``forward_backward``: its run is
        not loaded here, it would be the only one, the requests are not all forwards or all
        forward_backwards of distinct runs on one base, the pass would not fit what is free of
        the budget in one go (alone, a request is split into micro-batches), or the device ran
        out of memory in it."""
        try:
            return self._on_device("forward_backward", self._together, asks)
        except Unavailable:
            return [None] * len(asks)

    def _together(
        self, asks: Sequence[tuple[str, tp.ForwardBackwardRequest]]
    ) -> list[bytes | Exception | None]:
        results: list[bytes | Exception | None] = [None] * len(asks)
        members: list[tuple[int, _Part, tp.ForwardBackwardRequest]] = []
        for k, (model_id, request) in enumerate(asks):
            run = self.runs.get(model_id)
            if run is None:
                continue
            try:
                batch = self._decode(run, request)
            except InvalidRequest as exc:
                results[k] = exc
                continue
            members.append((k, _Part(run, batch, list(range(len(batch.tokens)))), request))
        runs = [part.run for _, part, _ in members]
        modes = {request.forward_only for _, _, request in members}
        if (
            len({run.base_model for run in runs}) > 1
            or len(modes) > 1
            or len({run.model_id for run in runs}) < len(runs)
        ):
            return results
        if len(members) < 2:
            return results  # one request runs alone, where it may be split
        grad = not modes.pop()
        base_model = runs[0].base_model
        lengths = [n for _, part, _ in members for n in part.batch.lengths]
        steps = sum(_step_bytes(run) for run in runs) if grad else 0
        if self.activation_bytes(base_model, lengths, backward=grad) > self.free_bytes() - steps:
            return results
        base = self.bases[base_model]
        accumulated = {run.model_id: _set_aside(run) if grad else {} for run in runs}
        try:
            with (
                torch.set_grad_enabled(grad),
                base.slots.routed(_row_slots(p for _, p, _ in members)),
            ):
                per_part = self._target_logprobs(base, [p for _, p, _ in members], grad=grad)
                done: list[tuple[int, _Part, losses.LossResult]] = []
                for (k, part, request), lps in zip(members, per_part, strict=True):
                    inputs = part.batch.inputs
                    try:
                        result = losses.from_logprobs(
                            request.loss_fn, lps, inputs, config_of(request)
                        )
                        _check_loss(request.loss_fn, result, inputs)
                    except TinsmithError as exc:
                        results[k] = exc
                        continue
                    done.append((k, part, result))
                if grad and done:
                    total = torch.stack([result.total for _, _, result in done]).sum()
                    total.backward()  # type: ignore[no-untyped-call]
            for k, part, result in done:
                run = part.run
                if grad:
                    try:
                        summed = _accumulate(run, accumulated[run.model_id])
                    except Unprocessable as exc:
                        results[k] = exc
                        continue
                    accumulated[run.model_id] = summed
                results[k] = _output(result, len(part.batch.tokens))
        except BaseException:
            for run in runs:
                _restore(run, accumulated[run.model_id])
            raise
        for run in runs:
            _restore(run, accumulated[run.model_id])
        return results

    def _decode(self, run: Run, request: tp.ForwardBackwardRequest) -> _Batch:
        """The request's datums on the host, checked against the run's base model."""
        batch = _Batch(
            tokens=[model_input_tokens(d.model_input) for d in request.data],
            inputs=[
                {name: _host_tensor(tensor, name) for name, tensor in datum.loss_fn_inputs.items()}
                for datum in request.data
            ],
        )
        if not batch.tokens:
            raise InvalidRequest("forward_backward needs at least one datum")
        vocab = self._vocab[run.base_model]
        for i, (n, datum_inputs) in enumerate(zip(batch.lengths, batch.inputs, strict=True)):
            if "target_tokens" not in datum_inputs:
                raise InvalidRequest(f"datum {i}: loss_fn_inputs has no 'target_tokens'")
            losses.check_targets(datum_inputs["target_tokens"], n, vocab, i)
        return batch

    def _target_logprobs(
        self, base: _Base, parts: Sequence[_Part], *, grad: bool
    ) -> list[list[torch.Tensor]]:
        """For each part, the float32 target log-probabilities of its datums, all parts in one
        right-padded forward pass (run inside ``routed(_row_slots(parts))``): the base model's
        hidden states of the datums' tokens, then the LM head (its LoRA routed per position),
        the log-softmax and the pick of the targets, a chunk of positions at a time. With
        gradients and more than one chunk, each chunk is checkpointed: its logits are computed
        again in the backward pass instead of being kept."""
        placement = self.placement
        datums = [(part, i) for part in parts for i in part.datums]
        lengths = [part.batch.lengths[i] for part, i in datums]
        ids = torch.zeros((len(datums), max(lengths)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, ((part, i), n) in enumerate(zip(datums, lengths, strict=True)):
            ids[row, :n] = torch.from_numpy(part.batch.tokens[i].astype(np.int64))
            mask[row, :n] = 1
        ids, mask = ids.to(placement.device), mask.to(placement.device)
        decoder = base.model.get_decoder()  # type: ignore[no-untyped-call]
        head = base.model.get_output_embeddings()  # type: ignore[no-untyped-call]
        assert isinstance(decoder, torch.nn.Module) and isinstance(head, torch.nn.Module)
        hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        rows = hidden[mask.bool()]  # the datums' positions, datum after datum
        starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        targets = [part.batch.inputs[i]["target_tokens"].to(placement.device) for part, i in datums]
        # Datums whose targets have the same shape per position ((N,) or (N, K)) go together.
        groups: dict[tuple[int, ...], list[int]] = {}
        for k, target in enumerate(targets):
            groups.setdefault(tuple(target.shape[1:]), []).append(k)
        out: list[torch.Tensor | None] = [None] * len(datums)
        chunk = self._chunk_rows(self._vocab[parts[0].run.base_model])
        for members in groups.values():
            if len(members) == len(datums):
                picked = rows
            else:
                picked = torch.cat([rows[starts[k] : starts[k + 1]] for k in members])
            wanted = torch.cat([targets[k] for k in members]).long()
            slots = torch.cat(
                [
                    torch.full((lengths[k],), datums[k][0].run.slot, dtype=torch.long)
                    for k in members
                ]
            )
            lps = _head_logprobs(base.slots, head, picked, slots, wanted, chunk, grad=grad)
            offset = 0
            for k in members:
                out[k] = lps[offset : offset + lengths[k]]
                offset += lengths[k]
        found = iter(out)
        return [[next(found) for _ in part.datums] for part in parts]  # type: ignore[misc]

    @contextlib.contextmanager
    def _checkpointing(self, model: PreTrainedModel, on: bool) -> Iterator[None]:
        """Within it (when ``on``), the base model's decoder layers keep only their inputs for
        the backward pass and compute their activations again there (transformers' activation
        checkpointing, non-reentrant). Transformers checkpoints only layers in training mode:
        the layers' own flag is set, not their submodules', so nothing else changes (no dropout
        comes on)."""
        if not on:
            yield
            return
        model.activation_checkpointing_enable({"use_reentrant": False})
        model.disable_input_require_grads()  # type: ignore[no-untyped-call]
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        try:
            for layer in layers:
                layer.training = True
            yield
        finally:
            for layer in layers:
                layer.training = False
            model.activation_checkpointing_disable()  # type: ignore[no-untyped-call]

    # -- optimizer -----------------------------------------------------------------------------

    def optim_step(self, model_id: str, adam: bus.AdamParams) -> dict[str, float]:
        """One AdamW step on the run's own accumulated gradients, then zero them.

        Refused (``Unprocessable``), with the weights, the AdamW state and the gradients exactly
        as they were, when the gradients or their norm are not finite, or when the step would
        make a weight non-finite (a learning rate far too large, say); the same when the device
        runs out of memory (``Unavailable``)."""
        self._run(model_id)  # NotFound, as for any command on a run not held here
        (result,) = self._on_device("optim_step", self._optim_steps, [(model_id, adam)])
        if isinstance(result, Exception):
            raise result
        assert result is not None  # one run is never handed back
        return result

    def optim_step_together(
        self, asks: Sequence[tuple[str, bus.AdamParams]]
    ) -> list[dict[str, float] | Exception | None]:
        """Several runs' optim_steps as one: AdamW's arithmetic over every run's parameters at
        once (``_adamw_aside``), each parameter with its own run's state and step count, so each
        run's weights and AdamW state are what ``optim_step`` gives it alone. The checks before
        and after the step take one device sync for all the runs.

        For each request, in order: its metrics; the error that refuses it alone (its run is as
        it was); or None where it was not run and is to be run alone with ``optim_step``: its
        run is not loaded here or is named twice, the steps computed aside do not fit what is
        free of the budget together, or the device ran out of memory."""
        try:
            return self._on_device("optim_step", self._optim_steps, asks)
        except Unavailable:
            return [None] * len(asks)

    def _optim_steps(
        self, asks: Sequence[tuple[str, bus.AdamParams]]
    ) -> list[dict[str, float] | Exception | None]:
        results: list[dict[str, float] | Exception | None] = [None] * len(asks)
        taken: list[tuple[int, Run, bus.AdamParams]] = []
        free = self.free_bytes()
        for k, (model_id, adam) in enumerate(asks):
            run = self.runs.get(model_id)
            if run is None or any(run is other for _, other, _ in taken):
                continue
            copies = _OPTIM_COPIES * run.state_bytes // _RUN_COPIES
            if taken and copies > free:
                continue
            free -= copies
            taken.append((k, run, adam))
        steps: list[tuple[int, _Step]] = []
        for k, outcome in zip(
            [k for k, _, _ in taken], _begin_steps([(r, a) for _, r, a in taken]), strict=True
        ):
            if isinstance(outcome, Exception):
                results[k] = outcome
            else:
                steps.append((k, outcome))
        if not steps:
            return results
        asides: list[_Aside] = []
        moves: list[list[float]] = []
        try:
            for together in self._step_groups([step for _, step in steps]):
                computed = _adamw_aside(together)
                asides.extend(computed)
                moves.extend(_moves(together, computed))
        except RuntimeError as exc:  # torch refuses a step size beyond float32's range
            if "overflow" not in str(exc):
                raise
            if len(steps) > 1:  # which run's? Each is taken again alone.
                for k, _ in steps:
                    results[k] = None
            else:
                k, step = steps[0]
                results[k] = Unprocessable(f"this step would make the adapter {step.refusal()}")
            return results
        for (k, step), aside, moved in zip(steps, asides, moves, strict=True):
            broken = [
                n for n, size in zip(step.names, moved, strict=True) if not math.isfinite(size)
            ]
            if broken:
                results[k] = Unprocessable(
                    f"this step would make {len(broken)} of {len(step.names)} adapter tensors "
                    f"(first: {broken[0]}) {step.refusal()}"
                )
                continue
            aside.commit(step)
            step.run.optimizer.zero_grad(set_to_none=True)
            for group in step.run.optimizer.param_groups:
                group.update(step.hyperparameters())
            results[k] = {
                "grad_norm:mean": step.norm,
                "learning_rate:mean": step.adam.learning_rate,
                "update_norm:mean": math.hypot(*moved),
            }
        return results

    def _step_groups(self, steps: list[_Step]) -> list[list[_Step]]:
        """The steps in the groups whose AdamW arithmetic (and the measure of its changes) goes
        at once, in order: all of them on a GPU, runs of at most ``CPU_STEP_GROUP_BYTES`` of
        weights on a CPU."""
        if self.placement.device.type != "cpu":
            return [steps]
        groups: list[list[_Step]] = []
        size = 0
        for step in steps:
            weights = sum(p.numel() * p.element_size() for p in step.params)
            if not groups or size + weights > CPU_STEP_GROUP_BYTES:
                groups.append([])
                size = 0
            groups[-1].append(step)
            size += weights
        return groups

    # -- export --------------------------------------------------------------------------------

    def export(
        self, model_id: str, directory: Path, *, with_optimizer: bool, with_gradients: bool = False
    ) -> dict[str, Any]:
        """Write the run's adapter in PEFT's on-disk format into ``directory``, plus its optimizer
        state for a training checkpoint, and the gradients accumulated since the last optim_step
        for a snapshot (a run unloaded between forward_backward and optim_step must not lose
        them): ``capture``, then ``Capture.write``."""
        captured = self.capture(
            model_id, with_optimizer=with_optimizer, with_gradients=with_gradients
        )
        return captured.write(directory)

    def capture(
        self, model_id: str, *, with_optimizer: bool, with_gradients: bool = False
    ) -> Capture:
        """What ``export`` writes, as host copies of the run's tensors as they are now: the
        device's part of a save, on the compute thread; the writing (``Capture.write``) can go
        on another thread while the engine computes on."""
        run = self._run(model_id)
        config = LoraConfig(
            r=run.rank,
            lora_alpha=lora_layout.ALPHA,
            lora_dropout=lora_layout.DROPOUT,
            target_modules=run.targets,
            bias="none",
            base_model_name_or_path=run.base_model,
        )
        grads = (
            {n: _portable(p.grad) for n, p in run.params.items() if p.grad is not None}
            if with_gradients
            else {}
        )
        return Capture(
            weights={name: _portable(param) for name, param in run.params.items()},
            config=config,
            optimizer=_optimizer_tensors(run) if with_optimizer else None,
            gradients=grads,
            metadata={"model_id": model_id, "base_model": run.base_model, "lora_rank": run.rank},
        )


@dataclass(frozen=True)
class Capture:
    """A run's state for a checkpoint (``TrainerEngine.capture``): host copies of its adapter,
    and of its AdamW state and accumulated gradients where asked for, that nothing the engine
    does later changes; ``write`` puts them on disk, on any thread."""

    weights: dict[str, torch.Tensor]
    config: LoraConfig
    optimizer: dict[str, torch.Tensor] | None
    gradients: dict[str, torch.Tensor]  # empty: none to keep
    metadata: dict[str, Any]

    def write(self, directory: Path) -> dict[str, Any]:
        """PEFT's adapter files in ``directory``, the optimizer state and gradients beside them
        where captured, and the run's metadata; returns the metadata."""
        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.weights, str(directory / artifacts.ADAPTER_WEIGHTS))
        self.config.save_pretrained(str(directory))
        if self.optimizer is not None:
            save_file(self.optimizer, str(directory / artifacts.OPTIMIZER_STATE))
        if self.gradients:
            save_file(self.gradients, str(directory / artifacts.GRADIENTS))
        (directory / artifacts.METADATA).write_text(json.dumps(self.metadata))
        return self.metadata


@dataclass
class _Step:
    """A run's optim_step once its gradients passed the checks: the hyperparameters it is taken
    with, its gradients clipped to step with, and their norm before clipping."""

    run: Run
    adam: bus.AdamParams
    names: list[str]
    grads: list[torch.Tensor]
    norm: float

    @classmethod
    def begin(
        cls, run: Run, adam: bus.AdamParams, grads: dict[str, torch.Tensor], norm: torch.Tensor
    ) -> _Step:
        """Clip the run's gradients, on copies as ``clip_grad_norm_`` computes them, so that the
        accumulated ones stay as they are until the step is taken."""
        stepped = list(grads.values())
        max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf
        if math.isfinite(max_norm):
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            stepped = list(torch._foreach_mul(stepped, scale))
        return cls(run, adam, list(grads), stepped, float(norm))

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [self.run.params[name] for name in self.names]

    def hyperparameters(self) -> dict[str, Any]:
        """The step's AdamW parameter-group settings."""
        adam = self.adam
        return {
            "lr": adam.learning_rate,
            "betas": (adam.beta1, adam.beta2),
            "eps": adam.eps,
            "weight_decay": adam.weight_decay,
        }

    def refusal(self) -> str:
        lr = self.adam.learning_rate
        cause = "is not finite" if not math.isfinite(lr) else "is far too large for these gradients"
        return (
            f"non-finite: the learning rate {lr:g} {cause} (norm {self.norm:g}); the step was not "
            "taken"
        )


def _begin_steps(asks: Sequence[tuple[Run, bus.AdamParams]]) -> list[_Step | Exception]:
    """Each run's step begun (``_Step.begin``), or refused (``Unprocessable``) where the
    gradients it accumulated since its last optim_step, or their norm, are not finite. One device
    sync for all the runs when all is well."""
    named = [
        {name: p.grad for name, p in run.params.items() if p.grad is not None} for run, _ in asks
    ]
    norms = [torch.nn.utils.get_total_norm(list(g.values())) for g in named if g]
    measured = iter(zip(norms, torch.stack(norms).tolist() if norms else [], strict=True))
    outcomes: list[_Step | Exception] = []
    for (run, adam), grads in zip(asks, named, strict=True):
        if not grads:
            outcomes.append(_Step(run, adam, [], [], 0.0))
            continue
        norm, value = next(measured)
        if math.isfinite(value):
            outcomes.append(_Step.begin(run, adam, grads, norm))
            continue
        broken = _not_finite(grads)
        if broken:
            outcomes.append(
                Unprocessable(
                    f"the gradients accumulated since the last optim_step are not finite in "
                    f"{len(broken)} of {len(grads)} adapter tensors (first: {broken[0]}); the "
                    "step was not taken"
                )
            )
        else:
            outcomes.append(
                Unprocessable(
                    "the norm of the gradients accumulated since the last optim_step overflows "
                    "(they are astronomically large: a loss scaled far too high, or weights or "
                    "advantages of 1e19 and more?); the step was not taken"
                )
            )
    return outcomes


@dataclass
class _Aside:
    """A run's AdamW step computed beside the run: for each of its stepped parameters, the new
    weights, moments and step count. Nothing of the run changes until ``commit``."""

    weights: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    counts: list[float]

    def commit(self, step: _Step) -> None:
        """Make the step the run's: its weights (in place, as they alias the slot stacks) and
        its AdamW state, in torch.optim.AdamW's own layout."""
        if not self.weights:
            return
        targets: list[torch.Tensor] = [*step.params]
        with torch.no_grad():
            torch._foreach_copy_(targets, self.weights)
        state = step.run.optimizer.state
        for param, exp_avg, exp_avg_sq, count in zip(
            step.params, self.exp_avgs, self.exp_avg_sqs, self.counts, strict=True
        ):
            state[param] = {
                "step": torch.tensor(count, dtype=torch.float32),
                "exp_avg": exp_avg,
                "exp_avg_sq": exp_avg_sq,
            }


def _adamw_aside(steps: Sequence[_Step]) -> list[_Aside]:
    """Each run's AdamW step, computed aside (``_Aside``): torch.optim.AdamW's arithmetic, its
    operations in its order (those of its per-tensor implementation, which it runs on the CPU;
    on a GPU, of its multi-tensor one, which does the same per element), as multi-tensor
    operations over every run's parameters at once, one call per set of hyperparameters. Each
    parameter steps with its own run's moments and step count, so each run gets what it gets
    alone. Computing aside, not in place, is what lets a step that would make a weight
    non-finite be refused with nothing to undo."""
    by_step: list[list[_Member]] = []
    groups: dict[tuple[float, ...], list[_Member]] = {}
    for step in steps:
        settings = step.hyperparameters()
        key = (settings["lr"], *settings["betas"], settings["eps"], settings["weight_decay"])
        held = step.run.optimizer.state
        members = []
        for param, grad in zip(step.params, step.grads, strict=True):
            weight, state = param.detach(), held.get(param)
            if state:
                count = float(state["step"]) + 1
                member = _Member(weight, grad, state["exp_avg"], state["exp_avg_sq"], count)
            else:  # AdamW's first step: zero moments
                zeros = torch.zeros_like(weight)
                member = _Member(weight, grad, zeros, zeros, 1.0)
            members.append(member)
            groups.setdefault(key, []).append(member)
        by_step.append(members)
    for (lr, beta1, beta2, eps, weight_decay), members in groups.items():
        params = [m.param for m in members]
        grads = [m.grad for m in members]
        counts = [m.count for m in members]
        exp_avgs = torch._foreach_lerp([m.exp_avg for m in members], grads, 1 - beta1)
        exp_avg_sqs = torch._foreach_mul([m.exp_avg_sq for m in members], beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, [(1 - beta2**count) ** 0.5 for count in counts])
        torch._foreach_add_(denominators, eps)
        steps_by = [-(lr / (1 - beta1**count)) for count in counts]
        if weight_decay:  # decoupled, as AdamW's: the weights shrink first
            weights = torch._foreach_mul(params, 1 - lr * weight_decay)
            torch._foreach_addcdiv_(weights, exp_avgs, denominators, steps_by)
        else:
            weights = torch._foreach_addcdiv(params, exp_avgs, denominators, steps_by)
        del denominators
        for m, weight, exp_avg, exp_avg_sq in zip(
            members, weights, exp_avgs, exp_avg_sqs, strict=True
        ):
            m.param, m.exp_avg, m.exp_avg_sq = weight, exp_avg, exp_avg_sq
    return [
        _Aside(
            [m.param for m in members],
            [m.exp_avg for m in members],
            [m.exp_avg_sq for m in members],
            [m.count for m in members],
        )
        for members in by_step
    ]


@dataclass
class _Member:
    """A parameter in ``_adamw_aside``'s multi-tensor step: its weights, gradient, moments and
    step count after this step; the weights and moments are replaced by the step's new ones."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    count: float


def _moves(steps: Sequence[_Step], asides: Sequence[_Aside]) -> list[list[float]]:
    """For each step, the norm of its change to each of its run's weight tensors (one device sync
    for all). A move is not finite exactly when the step would make the tensor non-finite (or it
    was so already): its new values are the old finite ones plus finite changes (short of
    float32's largest, 3e38)."""
    stepped = [(step, aside) for step, aside in zip(steps, asides, strict=True) if step.names]
    if not stepped:
        return [[] for _ in steps]
    moved = torch._foreach_norm(
        torch._foreach_sub(
            [w for _, aside in stepped for w in aside.weights],
            [p.detach() for step, _ in stepped for p in step.params],
        )
    )
    norms = iter(torch.stack(moved).tolist())
    return [[next(norms) for _ in step.names] for step in steps]


def _optimizer_tensors(run: Run) -> dict[str, torch.Tensor]:
    """AdamW's per-parameter state, keyed by the adapter-neutral parameter names PEFT keys its
    weights by, so any run with the same LoRA layout can load it."""
    tensors: dict[str, torch.Tensor] = {}
    for name, param in run.params.items():
        state = run.optimizer.state.get(param, {})
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}.{key}"] = _portable(value)
    return tensors


def _portable(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as a checkpoint holds it: float32 (the adapter, its gradients and AdamW state
    are float32 anyway) on the CPU, so it loads on any device; always a copy, which the engine's
    later steps do not change (on the CPU the tensor itself would be the run's own)."""
    value = tensor.detach()
    dtype = torch.float32 if value.is_floating_point() else value.dtype
    return value.to("cpu", dtype, copy=True, memory_format=torch.contiguous_format)


def _state_on(param: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
    """A saved AdamW state tensor, where torch.optim keeps it for ``param``: the step count on
    the CPU (AdamW's default, neither fused nor capturable), the moments beside the parameter."""
    if key == "step":
        return value.to("cpu", torch.float32)
    return value.to(param.device, param.dtype, copy=True)


def _host_tensor(tensor: tp.Tensor, name: str) -> torch.Tensor:
    """A loss input off the wire, on the host: float32 or int64 (so every device takes it)."""
    value = torch.from_numpy(np.array(decode_tensor(tensor, name)))
    return value.float() if value.is_floating_point() else value.long()


def _head_logprobs(
    slots: Slots,
    head: torch.nn.Module,
    rows: torch.Tensor,
    row_slots: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    *,
    grad: bool,
) -> torch.Tensor:
    """log_softmax(head(rows)) at ``targets``, in float32, ``chunk`` positions at a time, each
    position through the LoRA of its slot (``row_slots``). With gradients and more than one
    chunk, each chunk is checkpointed (non-reentrant: the LoRA parameters inside ``head`` get
    their gradients in the recomputation, which routes the chunk again)."""
    n = rows.shape[0]
    if n <= chunk:
        whole: torch.Tensor = _chunk_logprobs(slots, head, rows, row_slots, targets)
        return whole
    parts = []
    for start in range(0, n, chunk):
        end = start + chunk
        h, s, t = rows[start:end], row_slots[start:end], targets[start:end]
        if grad:
            part: torch.Tensor = checkpoint(
                _chunk_logprobs, slots, head, h, s, t, use_reentrant=False
            )
            parts.append(part)
        else:
            parts.append(_chunk_logprobs(slots, head, h, s, t))
    return torch.cat(parts)


def _chunk_logprobs(
    slots: Slots,
    head: torch.nn.Module,
    rows: torch.Tensor,
    row_slots: torch.Tensor,
    targets: torch.Tensor,
) -> Any:
    with slots.routed(row_slots):
        return losses.pick(head(rows).float(), targets)


@dataclass(frozen=True)
class _Part:
    """Datums of one run's request in a forward pass, by their place in its batch."""

    run: Run
    batch: _Batch
    datums: list[int]


def _row_slots(parts: Iterable[_Part]) -> list[int]:
    """The slot of each row of a pass over ``parts``: each datum's run's."""
    return [part.run.slot for part in parts for _ in part.datums]


def _step_bytes(run: Run) -> int:
    """What a forward_backward of ``run`` holds beyond its activations (``_STEP_COPIES``)."""
    return _STEP_COPIES * run.state_bytes // _RUN_COPIES


def _set_aside(run: Run) -> dict[str, torch.Tensor | None]:
    """The run's accumulated gradients, taken off its parameters (a batch's own land there)."""
    accumulated = {name: param.grad for name, param in run.params.items()}
    for param in run.params.values():
        param.grad = None
    return accumulated


def _restore(run: Run, grads: Mapping[str, torch.Tensor | None]) -> None:
    """Put ``grads`` on the run's parameters (nothing, for an empty mapping)."""
    for name, grad in grads.items():
        run.params[name].grad = grad


def _output(result: losses.LossResult, datums: int) -> bytes:
    out = tp.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=datums)
    record.fields["logprobs"].CopyFrom(batched([lp.cpu().numpy() for lp in result.logprobs]))
    record.fields["elementwise_loss"].CopyFrom(
        batched([el.cpu().numpy() for el in result.elementwise])
    )
    for key, value in result.metrics.items():
        out.metrics[key] = value
    return out.SerializeToString()


def _initialise(params: dict[str, torch.nn.Parameter], seed: int) -> None:
    """PEFT's default LoRA initialisation (A: Kaiming-uniform with a = sqrt(5), B: zero), drawn
    in float32 on the CPU from ``seed``, in the order of the parameters' names (PEFT's: sorted
    the same with or without the adapter's name in them): the same adapter on every device and
    whatever the base weights' dtype (PEFT draws A in the base's dtype, so a bfloat16 base would
    round it)."""
    generator = torch.Generator().manual_seed(seed % 2**63)
    with torch.no_grad():
        for name in sorted(params):
            param = params[name]
            if ".lora_A." in name:
                value = torch.empty(param.shape, dtype=torch.float32)
                torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
                param.copy_(value)
            elif ".lora_B." in name:
                param.zero_()


def _accumulate(
    run: Run, accumulated: dict[str, torch.Tensor | None]
) -> dict[str, torch.Tensor | None]:
    """The run's gradients once this batch's (in ``param.grad`` now) are added to ``accumulated``;
    ``Unprocessable`` if this batch's, or the sums, are not finite. Changes nothing itself."""
    fresh = {name: param.grad for name, param in run.params.items()}
    broken = _not_finite(fresh)
    if broken:
        raise Unprocessable(
            f"the gradients of this batch are not finite in {len(broken)} of {len(fresh)} "
            f"adapter tensors (first: {broken[0]}), though its loss is: "
            "a loss term's gradient overflows (importance ratios or weights far too large?); "
            "nothing was accumulated"
        )
    summed: dict[str, torch.Tensor | None] = {}
    added: dict[str, torch.Tensor | None] = {}  # the sums of two finite tensors, which may overflow
    for name, new in fresh.items():
        old = accumulated[name]
        summed[name] = old if new is None else new if old is None else old + new
        if old is not None and new is not None:
            added[name] = summed[name]
    broken = _not_finite(added)
    if broken:
        raise Unprocessable(
            "adding the gradients of this batch to those accumulated since the last optim_step "
            f"overflows in {len(broken)} adapter tensors (first: "
            f"{broken[0]}); nothing was accumulated"
        )
    return summed


def _not_finite(tensors: Mapping[str, torch.Tensor | None]) -> list[str]:
    """The names of the tensors that hold a NaN or an infinity, with one multi-tensor reduction
    and one device sync for all when none does. A tensor's 2-norm is finite when all its
    elements are (a NaN or an infinity carries into the sum of squares), and torch computes it
    about nine times faster than the largest magnitude on the CPU (0.17 against 1.46 ms for a
    tinsmith/small run's 86 gradients). A 2-norm that is not finite has such an element, or
    squares that overflow (elements beyond about 1e19): those tensors alone are judged by their
    largest magnitude, finite exactly when all their elements are."""
    present = {n: t for n, t in tensors.items() if t is not None}
    if not present:
        return []
    norms = torch._foreach_norm(list(present.values()))
    suspects = [
        n
        for n, ok in zip(present, torch.isfinite(torch.stack(norms)).tolist(), strict=True)
        if not ok
    ]
    if not suspects:
        return []
    peaks = torch._foreach_norm([present[n] for n in suspects], math.inf)
    finite = torch.isfinite(torch.stack(peaks)).tolist()
    return [n for n, ok in zip(suspects, finite, strict=True) if not ok]


def _check_loss(
    loss_fn: str,
    result: losses.LossResult,
    inputs: Sequence[dict[str, torch.Tensor]],
    names: Sequence[int] | None = None,
) -> None:
    """``Unprocessable`` unless the batch's log-probabilities and loss terms are all finite,
    saying which datum (``names[i]``, by default ``i``) first has a non-finite one and the likely
    cause."""
    name = list(names) if names is not None else list(range(len(inputs)))
    everything = [*result.logprobs, *result.elementwise, result.total.detach().reshape(1)]
    if bool(torch.stack([torch.isfinite(t).all() for t in everything]).all()):
        return  # one check (one device sync) when all is well
    for i, (lp, terms) in enumerate(zip(result.logprobs, result.elementwise, strict=True)):
        if not bool(torch.isfinite(lp).all()):
            count = int((~torch.isfinite(lp)).sum())
            raise Unprocessable(
                f"datum {name[i]}: the model's log-probabilities are not finite at {count} of "
                f"{lp.numel()} target positions: the run's weights or its logits are not "
                "finite (an earlier step diverged?)"
            )
        if bool(torch.isfinite(terms).all()):
            continue
        count = int((~torch.isfinite(terms)).sum())
        where = (
            f"datum {name[i]}: the {loss_fn} loss is not finite at {count} of {terms.numel()} "
            "tokens"
        )
        for key, value in inputs[i].items():
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise Unprocessable(f"{where}: loss_fn_inputs[{key!r}] holds non-finite values")
        q = inputs[i].get("logprobs")
        if q is not None:
            q = q.to(lp.device, lp.dtype)
            gap = float((lp.reshape(-1) - q.reshape(-1)).abs().max())
            term = "penalty (p - q)^2" if loss_fn == "dro" else "importance ratio exp(p - q)"
            raise Unprocessable(
                f"{where}: the {term} overflows, with the model's log-probabilities p up to "
                f"{gap:g} away from the sampler's, loss_fn_inputs['logprobs'] q (a sampling "
                "logprob of -1e30, or logprobs of other tokens or of another model?)"
            )
        raise Unprocessable(f"{where}: a loss term overflows (weights or advantages too large?)")
    raise Unprocessable(
        f"the {loss_fn} loss of the batch overflows in its sum over tokens and datums "
        "(weights or advantages too large?)"
    )


def _put_back(run: Run, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in run.params.items():
            param.copy_(weights[name])
