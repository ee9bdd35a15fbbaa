"""What a sampling engine is, and the semantics every engine shares.

An engine is continuous-batching: requests are ``add``-ed at any time, each ``step`` advances
every running sequence by one token (admitting what was added since, with its prefill, into the
running batch), and returns the requests that finished. Two engines implement it: the torch
engine (``torch_engine.py``, everywhere, the default) and the vLLM engine (``vllm_engine.py``,
where vLLM is installed). One contract suite (tests/sampler/test_contract.py) runs against both.

All engine methods run on the process's one compute thread (tinsmith.compute), never
concurrently with each other.

Failures are per request: ``add`` refuses what no engine can run (``check_command``: an empty
prompt, a NaN temperature, ...), and a request that fails later fails alone (``step``).

Streaming: a request whose command sets ``stream_to`` reports its tokens as they are generated:
``progress`` returns what each such request's sequences gained since the previous call. An
engine tracks nothing of the kind for the other requests, so a batch without streamed requests
pays nothing for it.

Owns: the interface, and the pieces of the Tinker sampling semantics that do not depend on the
engine: stop rules, top-k packing, the prompt-logprob window. Does not own: fetching adapters or
work (handlers.py).
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from tinsmith import artifacts
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest, NotFound
from tinsmith.limits import MAX_TOPK_LOGPROBS
from tinsmith.tensors import sparse_cells

if TYPE_CHECKING:
    from services.device import Placement

    from .config import SamplerConfig

# What the SDK reads as "no entry" in a top-k matrix (tinker.types.topk_logprobs).
TOPK_EMPTY_TOKEN = 0
TOPK_EMPTY_LOGPROB = -99999.0


# The adapter cache's bound when TINSMITH_ADAPTER_CACHE_MB does not set one.
DEFAULT_ADAPTER_CACHE_BYTES = 1 << 30
# The rows (sequences) one request holds in the torch engine's running batch at a time, when
# TINSMITH_SAMPLER_ROWS_PER_REQUEST does not say: a quarter of its 256 rows, so that a request
# with many samples leaves room for three more like it and for short ones (which join at the
# next step), while each step still decodes 64 of its sequences. On CPU a step's cost grows with
# its rows, so a request alone loses little or nothing: bench/sample_fairness.py measured a
# 256 x 256 request on tinsmith/small at 0.88x its time without the share (4x the steps, each
# about a fifth as long).
DEFAULT_ROWS_PER_REQUEST = 64


@dataclass(frozen=True)
class Delta:
    """Tokens one sequence of a streamed request gained: ``offset`` is the position of the
    first of them in the sequence."""

    ticket: int
    index: int
    offset: int
    tokens: list[int]
    logprobs: list[float]


class AdapterMissing(NotFound):
    """``add`` was given a request whose adapter the engine does not hold: fetch it and pass its
    directory to ``add``."""


class Engine(Protocol):
    def init_compute_thread(self) -> None:
        """Run once on the compute thread before any other call."""

    def load_base(self, name: str) -> None:
        """Load base model ``name`` now (otherwise it loads on its first request)."""

    def has_adapter(self, base_model: str, key: str) -> bool:
        """Whether the adapter at object-store ``key`` is loaded for ``base_model``."""

    def loaded(self) -> dict[str, int]:
        """Each loaded base model, with how many adapters are loaded on it. Read from other
        threads (the metrics), so it only copies plain state."""

    def device(self) -> str:
        """Where the models compute (``cpu``, ``cuda:0``)."""

    def describe(self) -> str:
        """Where and how the models compute, in a line for logs and /readyz (the device, its
        memory and the weights' dtype)."""

    def add(self, ticket: int, command: bus.Sample, adapter_dir: Path | None = None) -> None:
        """Queue a request; it joins the running batch at the next ``step``. ``adapter_dir`` holds
        its adapter (PEFT format) when the engine does not have it yet: loading and queueing are
        one call, so the adapter cannot be evicted in between. Raises ``InvalidRequest`` for a
        request no engine could run, ``AdapterMissing`` when the adapter is needed."""

    def step(self) -> list[tuple[int, bytes | Exception]]:
        """Advance all work by one token; return the tickets that finished, each with its
        serialized ``SampleResponse`` or the exception that failed it alone. A request that
        fails leaves the engine, and the others go on as if it had never been there: a step
        raises only for what it cannot pin on its requests."""

    def progress(self) -> list[Delta]:
        """The tokens the streamed requests (``command.stream_to``) generated since the previous
        call, each finished request's last ones included; ``[]`` at once when none streams."""

    def has_work(self) -> bool:
        """Whether anything is queued or running."""

    def cancel(self, ticket: int) -> None:
        """Drop a queued or running request (its outcome is never returned); a ticket the
        engine does not hold is ignored."""


def make_engine(config: SamplerConfig, placement: Placement | None = None) -> Engine:
    """The engine ``config.engine`` names: ``torch`` or ``vllm``, on ``placement`` (the service
    passes ``device.placement_from_env()``; without one, the torch engine computes on the CPU in
    float32 and vLLM where it runs by default). ``rows_per_request`` is the torch engine's
    (vLLM's scheduler shares its batch by itself). vLLM runs where it runs in this process (the
    current CUDA device, or the CPU with its CPU build): a placement elsewhere is refused
    (``DeviceError``), never ignored; the placement's dtype and its budget's share of the GPU
    are vLLM's weights dtype and ``gpu_memory_utilization``."""
    adapter_cache_bytes = config.adapter_cache_mb << 20
    if config.engine == "torch":
        from .torch_engine import TorchEngine

        engine: Engine = TorchEngine(
            config.cache_dir,
            config.torch_threads,
            adapter_cache_bytes=adapter_cache_bytes,
            rows_per_request=config.rows_per_request,
            placement=placement,
            prefill_tokens=config.prefill_tokens,
        )
        return engine
    if config.engine == "vllm":
        from .vllm_engine import VllmEngine

        if placement is None:
            return VllmEngine(
                config.cache_dir, config.torch_threads, adapter_cache_bytes=adapter_cache_bytes
            )
        from services import device

        vllm = VllmEngine(
            config.cache_dir,
            config.torch_threads,
            adapter_cache_bytes=adapter_cache_bytes,
            dtype=str(placement.dtype).removeprefix("torch."),
            memory_fraction=_share(placement),
        )
        where = vllm.device()
        if str(placement.device) != where:
            raise device.DeviceError(
                f"{device.DEVICE_VARIABLE} asks for {placement.device}, but the vLLM engine "
                f"computes on {where} in this process: set {device.DEVICE_VARIABLE}={where} "
                "(CUDA_VISIBLE_DEVICES picks the GPU), or TINSMITH_SAMPLER_ENGINE=torch"
            )
        return vllm
    raise ValueError(
        f"TINSMITH_SAMPLER_ENGINE={config.engine!r}: the engines are 'torch' and 'vllm'"
    )


def _share(placement: Placement) -> float:
    """The placement's budget as a share of its GPU's memory (vLLM's
    ``gpu_memory_utilization``); 0 off a CUDA device."""
    from services import device

    if placement.device.type != "cuda":
        return 0.0
    return min(1.0, placement.memory_bytes / device.total_memory(placement.device))


def default_engine_kind() -> str:
    """``TINSMITH_SAMPLER_ENGINE`` when set; otherwise vLLM where it is installed and a GPU is
    present (and ``TINSMITH_DEVICE`` does not ask for another device), else torch."""
    kind = os.environ.get("TINSMITH_SAMPLER_ENGINE", "")
    if kind:
        return kind
    if importlib.util.find_spec("vllm") is None:
        return "torch"
    wanted = os.environ.get("TINSMITH_DEVICE", "").strip().lower() or "auto"
    if wanted != "auto" and not wanted.startswith("cuda"):
        return "torch"
    import torch

    return "vllm" if torch.cuda.is_available() else "torch"


def run_all(engine: Engine, commands: Sequence[bus.Sample]) -> list[bytes | Exception]:
    """Run requests to completion, all added before the first step; each one's outcome."""
    outcomes: dict[int, bytes | Exception] = {}
    for ticket, command in enumerate(commands):
        try:
            engine.add(ticket, command)
        except Exception as exc:
            outcomes[ticket] = exc
    while engine.has_work():
        outcomes.update(engine.step())
    return [outcomes[ticket] for ticket in range(len(commands))]


# --- semantics shared by the engines --------------------------------------------------------


def check_command(command: bus.Sample, vocab_size: int) -> None:
    """Refuse what no engine can run, before it joins a batch it could spoil."""
    if not command.prompt:
        raise InvalidRequest("the prompt is empty")
    if min(command.prompt) < 0 or max(command.prompt) >= vocab_size:
        raise InvalidRequest(f"a prompt token is outside the vocabulary [0, {vocab_size})")
    if command.num_samples < 0:
        raise InvalidRequest("num_samples must not be negative")
    temperature = command.params.temperature
    if not math.isfinite(temperature) or temperature < 0:
        # NaN slips past every comparison, and would make the probabilities NaN.
        raise InvalidRequest(
            f"temperature must be a finite number >= 0 (0: the most likely token), got "
            f"{temperature!r}"
        )
    for field in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if not 0 <= getattr(command, field) <= MAX_TOPK_LOGPROBS:
            raise InvalidRequest(f"{field} must be between 0 and {MAX_TOPK_LOGPROBS}")


def evictions(
    sizes: Mapping[str, int], bound: int, keep: Collection[str], loaded: str
) -> list[str]:
    """The adapters to drop now that ``loaded`` was loaded (``sizes`` is in use order, least
    recent first), never one in ``keep`` (queued or running requests use it):

    - first those ``loaded`` supersedes: the same run's earlier unnamed sampler weights. An RL
      loop saves one per step (``save_weights_and_get_sampling_client``) and samples only the
      newest, and every adapter held makes each step and each load slower, long before the byte
      bound is reached. A client that does sample an older one again gets it reloaded.
    - then the least recently used, until the rest fit in ``bound`` bytes (the cache may stay
      over its bound for a while, when what is over is in use)."""
    run = artifacts.ephemeral_run(loaded)
    evict = [
        key
        for key in sizes
        if run and key != loaded and key not in keep and artifacts.ephemeral_run(key) == run
    ]
    total = sum(size for key, size in sizes.items() if key not in evict)
    for key, size in sizes.items():
        if total <= bound:
            break
        if key not in keep and key not in evict:
            evict.append(key)
            total -= size
    return evict


def stop_rule(
    params: tp.SamplingParams, eos_ids: frozenset[int]
) -> tuple[frozenset[int], list[str]]:
    """The stop token ids and stop strings of a request. Stop token ids replace end-of-sequence
    (so ``[]`` runs to max_tokens); stop strings add to it; no stop at all means
    end-of-sequence."""
    kind = params.WhichOneof("stop")
    if kind == "stop_tokens":
        return frozenset(params.stop_tokens.values), []
    if kind == "stop_strs":
        # An empty list is "no stop at all", in whichever form it came.
        strs = list(params.stop_strs.values)
        return (eos_ids if strs else frozenset()), strs
    return eos_ids, []


def prompt_window(command: bus.Sample) -> int:
    """The first prompt position that gets a logprob (position 0 never has one)."""
    start = 1
    if command.HasField("prompt_logprobs_last_n"):
        start = max(start, len(command.prompt) - command.prompt_logprobs_last_n)
    return start


def topk_message(token_ids: np.ndarray, logprobs: np.ndarray) -> tp.TopkLogprobs:
    """A ``length x k`` top-k matrix; empty cells hold the SDK's sentinel."""
    length, k = token_ids.shape
    return tp.TopkLogprobs(
        token_ids=np.ascontiguousarray(token_ids, "<i4").tobytes(),
        logprobs=np.ascontiguousarray(logprobs, "<f4").tobytes(),
        k=k,
        length=length,
    )


def empty_topk(length: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A top-k matrix with every cell empty, to fill in."""
    return (
        np.full((length, k), TOPK_EMPTY_TOKEN, dtype="<i4"),
        np.full((length, k), TOPK_EMPTY_LOGPROB, dtype="<f4"),
    )


def target_cells(command: bus.Sample) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The cells of ``target_prompt_logprobs``: (row, column, token id), ``-1`` for none. Row i
    is scored at prompt position i + 1, from the distribution after ``prompt[: i + 1]``."""
    rows, cols, ids = sparse_cells(command.target_prompt_logprobs, "target_prompt_logprobs")
    if len(ids) and (ids.min() < -1 or rows.max() >= len(command.prompt) - 1):
        raise InvalidRequest("target_prompt_logprobs does not fit the prompt")
    return rows, cols, ids.astype(np.int64)


def target_message(command: bus.Sample, values: np.ndarray) -> tp.Tensor:
    """The answer to ``target_prompt_logprobs``: float32 in the request's shape and layout, one
    value per cell that ``target_cells`` listed (0.0 where the cell asked for nothing)."""
    request = command.target_prompt_logprobs
    values = np.ascontiguousarray(values, "<f4")
    if request.WhichOneof("encoding") == "sparse_csr":
        csr = tp.SparseCsr(
            values=values.tobytes(),
            crow_indices=request.sparse_csr.crow_indices,
            col_indices=request.sparse_csr.col_indices,
        )
        return tp.Tensor(sparse_csr=csr, dtype=tp.DTYPE_FLOAT32, shape=request.shape)
    return tp.Tensor(dense=values.tobytes(), dtype=tp.DTYPE_FLOAT32, shape=request.shape)


def alt_tokens_message(tokens: np.ndarray, logprobs: np.ndarray) -> tp.PromptAltTokens:
    """``[len(prompt) - 1, k]`` draws and their logprobs, as two dense tensors."""
    shape = list(tokens.shape)
    return tp.PromptAltTokens(
        tokens=tp.Tensor(
            dense=np.ascontiguousarray(tokens, "<i8").tobytes(), dtype=tp.DTYPE_INT64, shape=shape
        ),
        logprobs=tp.Tensor(
            dense=np.ascontiguousarray(logprobs, "<f4").tobytes(),
            dtype=tp.DTYPE_FLOAT32,
            shape=shape,
        ),
    )
