"""The torch engine: a base model per name, any run's LoRA adapter on top, and continuous
batching with a KV cache.

One running batch per base model holds a row per sequence being sampled. Each ``step`` first
admits waiting sequences (below), then samples one token for every row and runs one forward of
all rows that go on. A request's prompt is prefilled once (the requests prefilled in one step are
left-padded together, each row with its own positions); its cache is copied to one row per
sequence, and the new rows are merged into the running batch (the shorter cache left-padded,
masked out). Rows may use different adapters: each adapter sits in a slot of its base model's
LoRA layer (services/lora_slots.py, installed when the base loads), and each forward routes every
row to its adapter's slot, or to none; a step costs the same however many adapters are held, and
loading one is a copy into a slot. Finished rows leave the batch, and cache columns that no row
attends to any more are cut off.

Fair sharing: one request holds at most ``rows_per_request`` rows at a time
(``TINSMITH_SAMPLER_ROWS_PER_REQUEST``, 64), the batch at most ``max_rows`` (256). A request whose
sequences do not all get rows is admitted in slices: its prompt's cache (one row) and its first
token's logits are kept, and its other sequences wait: at the back of the waiting line when the
batch was full; when it holds its share, out of the line until some of its rows finish, and then
at the back of it, behind the requests that came meanwhile. So a long request leaves room in the
batch, and a short one that arrives while it decodes joins at the next step. Prompt logprobs and
the other prompt scores are computed once, at the prefill. (Models whose cache has
sliding-window layers cannot join batches: their requests are admitted whole, into an empty
batch.)

A step prefills at most ``prefill_tokens`` prompt tokens (``TINSMITH_SAMPLER_PREFILL_TOKENS``), so
that new prompts do not stall the running rows for longer than that: a burst's prompts wait for
later steps, their places kept, and a prompt longer than the bound is prefilled in chunks, one a
step, its cache growing in one row until its last chunk, when its scores are computed and its
rows join the batch as a later slice's would. Such a request is admitted with its first chunk,
and the memory plan keeps what it was admitted with (its whole prefill and its rows) until its
last, so nothing admitted meanwhile takes it.

Each sequence has its own generator, seeded from (seed, index), so what a seeded request
samples does not depend on ``num_samples``, on the slices it was admitted in, or on what else is
in the batch.

Logprobs are the model's raw log-probabilities (before temperature, top-k or top-p), which is
what the trainer's forward computes, so RL importance ratios compare like with like. Sampling
divides the logits minus the row's largest by the temperature, so any temperature above 0 is
stable (a denormal one is the greedy limit); 0 is the most likely token.

Failures are the request's own: a request whose prompt scoring, sampling or bookkeeping raises,
or whose logits are not finite (NaN or infinite: its adapter's weights, most likely), fails
alone, ``Unprocessable`` for the non-finite numbers; its rows leave the batch and its cache
before the next forward, and its waiting sequences leave the line. A prefill forward of several
prompts that raises runs again for each alone, so only the culprit fails. A decoding forward that
raises, which no one request can be blamed for, fails the requests of its batch: the engine
itself goes on, and its next step starts clean.

Device and precision (``services/device.py``'s ``Placement``): the base weights live on
``placement.device`` in ``placement.dtype`` (bfloat16 by default on a GPU, float32 on the CPU),
and so does every tensor the engine makes: token ids, masks, positions, sampling tensors and
each sequence's generator. Adapters are loaded onto the device in float32, whatever the base's
dtype: the trainer keeps LoRA parameters in float32 beside a bfloat16 base, and both compute
the adapter's path in float32 (the input cast up, the output cast back to the base's dtype), so
the sampler's adapted forward is the trainer's; an adapter's weights are small beside the
base's. Logits are cast to float32 before anything reads them: temperature, top-k, top-p, the
log-softmax and every logprob returned. One code path serves CUDA, MPS and the CPU. A seeded
sequence is reproducible on one device and torch version; across devices its tokens can differ
(another generator, other kernels: bfloat16 moves logits by far more than float32 rounding).

Memory is a budget (``placement.memory_bytes``, ``TINSMITH_DEVICE_MEMORY_MB``; memory.py counts
it): the engine counts what it holds (base weights, adapters, prompts kept for later slices) and
reserves each running row's KV cache at its last token, with a step's working memory. Waiting
sequences get rows only while that fits: a request whose sequences do not all fit gets as many
rows as do (a slice, as above), and one that gets none holds the line (the requests behind it
wait too, so that smaller ones cannot starve it) until rows finish. Adapters no request uses are
evicted first when that makes room. A request that could not fit even alone is refused at
``add`` with what it needs and the budget. A step that runs out of device memory all the same
(another process took it, or an estimate fell short) fails the requests of that step
(``Unavailable``, to send again), drops their rows and cache, gives the allocator's free blocks
back, and the engine goes on with the others; a prefill of several prompts that runs out is
retried prompt by prompt.

Owns: every torch call of the sampler, the sampling rules, admission to the batch and the adapter
cache (LRU, bounded by the adapters' bytes; adapters that queued or running requests use are
never evicted).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer

from services import base_model, device, lora_slots
from services.device import DEVICE_VARIABLE, MEMORY_VARIABLE, Placement
from services.lora_slots import NO_ADAPTER
from tinsmith import lora, models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest, Unavailable, Unprocessable
from tinsmith.limits import Limits, mib

from .decoder import Decoder, why_not
from .engine import (
    DEFAULT_ADAPTER_CACHE_BYTES,
    DEFAULT_ROWS_PER_REQUEST,
    AdapterMissing,
    Delta,
    alt_tokens_message,
    check_command,
    empty_topk,
    evictions,
    prompt_window,
    stop_rule,
    target_cells,
    target_message,
    topk_message,
)
from .memory import Ask, Costs, Plan, Rows

log = logging.getLogger(__name__)

# Sequences decoded together at most; requests beyond it wait for rows to finish.
DEFAULT_MAX_ROWS = 256


def default_prefill_tokens(device: torch.device) -> int:
    """The most prompt tokens a step prefills: the prompts of a larger burst of requests are
    prefilled over several steps, and a longer prompt in chunks over several steps, each
    followed by a decoding step of the rows already running, so that neither stalls the others'
    decoding for the whole of its prefill. 2048 on the CPU, 16384 on an accelerator, the
    trainer's slice (services/trainer/engine.py ``default_slice_tokens``).
    ``TINSMITH_SAMPLER_PREFILL_TOKENS`` overrides it (0: no bound)."""
    return 2048 if device.type == "cpu" else 16384


# The generator stream of a request's prompt_alt_tokens draws (sequence i uses stream i).
_ALT_STREAM = 2**32
# Temperatures below it sample as if they were it (``_tempered``).
_SMALLEST_NORMAL = float(torch.finfo(torch.float32).tiny)

Finished = list[tuple[int, bytes | Exception]]


@dataclass
class _Adapter:
    slot: int  # in its base's ``slots``
    nbytes: int  # what it takes in the slots' stacks


@dataclass
class _Base:
    name: str
    model: PreTrainedModel
    # Its LoRA slots (services/lora_slots.py); None for an architecture no run can train.
    slots: lora_slots.Slots | None
    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    vocab_size: int
    # Whether its cache layers are plain (no sliding window): only those can be left-padded and
    # joined, so only those take requests while a batch runs, and in slices.
    plain: bool
    costs: Costs  # what its rows take on the device
    weight_bytes: int  # its weights and buffers on the device
    # Its lean forward (decoder.py), or None where it runs through transformers' forward.
    decoder: Decoder | None
    adapters: OrderedDict[str, _Adapter] = field(default_factory=OrderedDict)  # LRU first


@dataclass
class _Prompt:
    """A prefilled prompt, kept while some of its request's sequences wait for rows: its cache
    as one row without padding, and the logits of the first token to sample."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]  # keys, values: [1, heads, length, size]
    logits: torch.Tensor  # [vocab]
    length: int


@dataclass
class _Chunked:
    """A prompt longer than a step's prefill bound, prefilled a chunk a step: its cache so far
    (one row, with room for the whole prompt), where its request scores its prompt the logits
    of every position (filled in chunk by chunk, so that its scores are computed from one
    tensor, as a prefill's), and the rows its request was given when its first chunk was
    admitted, which the memory plan keeps for it until its last chunk (``TorchEngine._plan``)."""

    rows: int
    cache: DynamicCache | None = None
    length: int = 0  # prompt tokens prefilled
    logits: torch.Tensor | None = None  # [vocab]: the last prefilled position's
    scores: torch.Tensor | None = None  # [prompt, vocab], in the model's dtype


@dataclass(eq=False)  # compared and hashed by identity
class _Request:
    ticket: int
    command: bus.Sample
    base: _Base
    adapter: int  # its slot in the base's slots, or NO_ADAPTER
    stop_ids: frozenset[int]
    stop_strs: list[str]
    seed: int = 0
    response: tp.SampleResponse = field(default_factory=tp.SampleResponse)
    sequences: list[_Sequence] = field(default_factory=list)  # those given rows, by index
    unfinished: int = 0  # sequences not finished yet, with rows or waiting for them
    running: int = 0  # its rows in the running batch
    prefilled: bool = False
    prompt: _Prompt | None = None  # while sequences wait for rows (after the first slice)
    chunked: _Chunked | None = None  # while its prompt is prefilled in chunks
    cancelled: bool = False
    failed: bool = False
    done: bool = False

    @property
    def gone(self) -> bool:
        """Cancelled or failed: its rows leave the batch at the next chance."""
        return self.cancelled or self.failed

    @property
    def left(self) -> int:
        """Its sequences that have no row yet."""
        if self.command.params.max_tokens <= 0:
            return 0
        return self.command.num_samples - len(self.sequences)

    @property
    def unprefilled(self) -> int:
        """Its prompt tokens not prefilled yet."""
        if self.prefilled:
            return 0
        done = self.chunked.length if self.chunked is not None else 0
        return len(self.command.prompt) - done


@dataclass
class _Sequence:
    request: _Request
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[np.ndarray] = field(default_factory=list)
    topk_logprobs: list[np.ndarray] = field(default_factory=list)
    stopped: bool = False
    streamed: int = 0  # tokens ``progress`` reported so far (streamed requests only)


@dataclass
class _Batch:
    """The rows decoding together, with tensors aligned to ``rows``."""

    rows: list[_Sequence]
    cache: DynamicCache
    mask: torch.Tensor  # [rows, cached columns]
    logits: torch.Tensor  # [rows, vocab]: the next token's, not yet sampled
    positions: torch.Tensor  # [rows]: the next token's position


class TorchEngine:
    def __init__(
        self,
        cache_dir: Path,
        threads: int = 1,
        *,
        adapter_cache_bytes: int = DEFAULT_ADAPTER_CACHE_BYTES,
        max_rows: int = DEFAULT_MAX_ROWS,
        rows_per_request: int = DEFAULT_ROWS_PER_REQUEST,
        placement: Placement | None = None,
        prefill_tokens: int | None = None,
    ) -> None:
        """``placement``: where to compute, in what dtype, within what memory (the service
        passes ``device.placement_from_env()``); by default the CPU in float32, with the
        machine's memory, as the tests and tools use it. ``prefill_tokens``: the most prompt
        tokens a step prefills; by default ``default_prefill_tokens`` of the device, 0 for no
        bound."""
        if max_rows < 1 or rows_per_request < 1:
            raise ValueError("max_rows and rows_per_request must be at least 1")
        self.cache_dir = cache_dir
        self.threads = threads
        cpu = torch.device("cpu")
        self.placement = placement or Placement(cpu, torch.float32, device.total_memory(cpu))
        self.adapter_cache_bytes = adapter_cache_bytes
        self.max_rows = max_rows
        self.rows_per_request = min(rows_per_request, max_rows)
        self.prefill_tokens = (
            default_prefill_tokens(self.placement.device)
            if prefill_tokens is None
            else prefill_tokens
        )
        self.bases: dict[str, _Base] = {}
        self._waiting: list[_Request] = []  # the waiting line: requests with sequences to admit
        # Requests with sequences left that hold their share of rows: each goes to the back of
        # the line once some of its rows finish.
        self._parked: list[_Request] = []
        self._batches: dict[str, _Batch] = {}
        self._requests: dict[int, _Request] = {}
        self._streamed: dict[int, _Request] = {}  # the requests that report their progress
        self._out_of_memory = False  # a step ran out: give the allocator's blocks back after it

    def init_compute_thread(self) -> None:
        torch.set_num_threads(self.threads)
        if self.placement.device.type == "cuda":  # the current device of this thread's streams
            torch.cuda.set_device(self.placement.device)

    def describe(self) -> str:
        """Where it computes, for logs and /readyz."""
        return f"{self.placement.describe()} (torch engine)"

    # -- models and adapters ------------------------------------------------------------------

    def load_base(self, name: str) -> None:
        self._base(name)

    def _base(self, name: str) -> _Base:
        base = self.bases.get(name)
        if base is None:
            directory = models.materialize(name, self.cache_dir)
            placement = self.placement
            try:
                model = base_model.load(directory, placement, few_rows=True)
            except Exception as exc:
                if not device.is_out_of_memory(exc):
                    raise
                weights = base_model.weights_bytes(directory, placement.dtype)
                raise Unavailable(
                    f"the base model {name!r} does not fit on {placement.device} "
                    f"({weights / 2**30:.1f} GiB of weights in {placement.dtype}): "
                    f"{str(exc).splitlines()[0]}"
                ) from None
            config = json.loads((directory / "config.json").read_text())
            eos_ids = models.eos_ids_of(config)
            tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
            embeddings = model.get_input_embeddings()
            assert isinstance(embeddings, torch.nn.Embedding)
            vocab = embeddings.num_embeddings
            plain = _mergeable(DynamicCache(config=model.config))
            dtype_bytes = torch.empty((), dtype=placement.dtype).element_size()
            costs = Costs.of(config, dtype_bytes, vocab)
            layout = lora.LAYOUTS.get(models.get(name).arch)
            slots = (
                lora_slots.install(
                    model,
                    {module for group in layout.values() for module in group},
                    max_rank=Limits.from_env().max_lora_rank,
                )
                if layout is not None
                else None
            )
            decoder = Decoder.of(model)
            base = _Base(
                name,
                model,
                slots,
                tokenizer,
                eos_ids,
                vocab,
                plain,
                costs,
                _weight_bytes(model),
                decoder,
            )
            self.bases[name] = base
            log.info(
                "loaded %s on %s in %s: %s of weights, %s of KV cache per token of a sequence; %s",
                name,
                placement.device,
                str(placement.dtype).removeprefix("torch."),
                mib(base.weight_bytes),
                f"{costs.column / 1024:.1f} KiB",
                "its lean forward"
                if decoder is not None
                else f"transformers' forward, as {why_not(model)}",
            )
        return base

    def has_adapter(self, base_model: str, key: str) -> bool:
        base = self.bases.get(base_model)
        return base is not None and key in base.adapters

    def loaded(self) -> dict[str, int]:
        return {name: len(base.adapters) for name, base in list(self.bases.items())}

    def device(self) -> str:
        return str(self.placement.device)

    def adapter_bytes(self, base_model: str) -> int:
        base = self.bases.get(base_model)
        return sum(a.nbytes for a in base.adapters.values()) if base else 0

    def load_adapter(self, base_model: str, key: str, directory: Path) -> None:
        """Load the adapter saved in ``directory`` (PEFT's format) under its object-store
        ``key``."""
        base = self._base(base_model)
        if key not in base.adapters:
            self._load_adapter(base, key, directory)

    def _load_adapter(self, base: _Base, key: str, directory: Path) -> None:
        """Copy an adapter into a slot of its base (services/lora_slots.py), in float32 whatever
        the base's dtype. One that fails to load leaves nothing behind."""
        if base.slots is None:
            raise InvalidRequest(
                f"the base model {base.name!r} takes no LoRA adapters here: its architecture "
                f"has no LoRA layout (supported: {', '.join(sorted(lora.LAYOUTS))})"
            )
        try:
            adapter = lora_slots.read_adapter(directory, self.placement.device)
            nbytes = base.slots.bytes_of(adapter.weights, adapter.rank)
            slot = base.slots.load(adapter.weights, adapter.rank, adapter.scale)
        except ValueError as exc:
            raise Unprocessable(f"the adapter {key!r} cannot be loaded: {exc}") from None
        except Exception as exc:
            if not device.is_out_of_memory(exc):
                raise
            error = Unavailable(
                f"the adapter {key!r} does not fit on {self.placement.device} now: "
                f"{str(exc).splitlines()[0]}"
            )
        else:
            base.adapters[key] = _Adapter(slot, nbytes)
            self._evict(base, keep=key)
            return
        device.release(self.placement.device)
        raise error

    def _evict(self, base: _Base, keep: str) -> None:
        """Drop what ``keep`` (just loaded) supersedes, and keep the cache within its bound
        (``evictions``)."""
        used = {r.adapter for r in self._requests.values() if r.base is base}
        in_use = {key for key, a in base.adapters.items() if a.slot in used} | {keep}
        sizes = {key: a.nbytes for key, a in base.adapters.items()}
        for key in evictions(sizes, self.adapter_cache_bytes, in_use, keep):
            adapter = base.adapters.pop(key)
            _drop_adapter(base, adapter.slot)
            log.info("evicted adapter %s (%d bytes) from %s", key, adapter.nbytes, base.name)
        if base.slots is not None:
            # Stacks twice as long as their adapters need give their free places back; not
            # at every eviction, or each load would grow them again.
            base.slots.shrink(slack=2.0)

    # -- requests ------------------------------------------------------------------------------

    def add(self, ticket: int, command: bus.Sample, adapter_dir: Path | None = None) -> None:
        base = self._base(command.base_model)
        check_command(command, base.vocab_size)
        adapter = NO_ADAPTER
        if command.adapter_key:
            key = command.adapter_key
            if key not in base.adapters:
                if adapter_dir is None:
                    raise AdapterMissing(f"the adapter {key!r} is not loaded in the sampler")
                self._load_adapter(base, key, adapter_dir)
            base.adapters.move_to_end(key)
            adapter = base.adapters[key].slot
        stop_ids, stop_strs = stop_rule(command.params, base.eos_ids)
        params = command.params
        seed = params.seed if params.HasField("seed") else random.getrandbits(63)
        request = _Request(ticket, command, base, adapter, stop_ids, stop_strs, seed)
        refusal = self._never_fits(request)
        if refusal is not None:
            raise refusal
        request.unfinished = request.left
        self._requests[ticket] = request
        self._waiting.append(request)
        if command.stream_to:
            self._streamed[ticket] = request

    def has_work(self) -> bool:
        return bool(self._requests)

    def batch_rows(self, base_model: str) -> dict[int, int]:
        """How many rows each request (by ticket) holds in ``base_model``'s running batch, whose
        KV cache has exactly one row for each."""
        batch = self._batches.get(base_model)
        if batch is None:
            return {}
        cached = {
            keys.shape[0]
            for layer in batch.cache.layers
            if isinstance(keys := getattr(layer, "keys", None), torch.Tensor)
        }
        assert cached <= {len(batch.rows)}, (cached, len(batch.rows))
        return dict(Counter(row.request.ticket for row in batch.rows))

    def progress(self) -> list[Delta]:
        if not self._streamed:
            return []
        deltas = []
        for ticket, request in list(self._streamed.items()):
            for index, row in enumerate(request.sequences):
                if len(row.tokens) > row.streamed:
                    start, row.streamed = row.streamed, len(row.tokens)
                    deltas.append(
                        Delta(ticket, index, start, row.tokens[start:], row.logprobs[start:])
                    )
            if ticket not in self._requests:  # finished: these were its last tokens
                del self._streamed[ticket]
        return deltas

    def cancel(self, ticket: int) -> None:
        self._streamed.pop(ticket, None)
        request = self._requests.get(ticket)
        if request is None:
            return
        request.cancelled = True
        self._unqueue(request)
        if request.running == 0:
            del self._requests[ticket]
        # Otherwise its rows leave the batch at the next step, and it is forgotten then.

    def step(self) -> Finished:
        finished: Finished = []
        self._admit(finished)
        self._decode_all(finished)
        if self._out_of_memory:
            # The failed steps' tensors are gone with their frames: give the allocator's free
            # blocks back, so that what the engine plans against is what is really held.
            self._out_of_memory = False
            device.release(self.placement.device)
        for ticket, _ in finished:
            self._requests.pop(ticket, None)
        return finished

    def _decode_all(self, finished: Finished) -> None:
        for name in list(self._batches):
            batch = self._batches[name]
            try:
                going = self._decode(batch, finished)
            except Exception as exc:
                # Its forward, which no one request can be blamed for: the requests in it fail,
                # and the engine goes on without the batch.
                error = self._failure(exc, f"decoding {len(batch.rows)} sequences of {name}")
                if error is exc:
                    log.exception("a decoding step of %d rows failed", len(batch.rows))
                self._fail_all(batch.rows, error, finished)
                going = False
            if not going:
                del self._batches[name]

    def _failure(self, exc: Exception, what: str) -> Exception:
        """What to fail requests with for ``exc``, raised while doing ``what``: itself, or, when
        the device ran out of memory, an ``Unavailable`` that says so (and no reference to the
        frames that hold the step's tensors: ``step`` gives the allocator's blocks back once
        they are gone)."""
        if not device.is_out_of_memory(exc):
            return exc
        self._out_of_memory = True
        where = self.placement.device
        held = self._plan().total()
        log.warning(
            "%s ran out of memory while %s (the plan held %s of a budget of %s): %s",
            where,
            what,
            mib(held),
            mib(self.placement.memory_bytes),
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return Unavailable(
            f"the sampler's device {where} ran out of memory while {what}: this request's "
            "sequences were dropped, and it can be sent again. The sampler plans within "
            f"{mib(self.placement.memory_bytes)} ({MEMORY_VARIABLE}) and held {mib(held)} by its "
            f"own count; if other processes use {where}, lower {MEMORY_VARIABLE}"
        )

    def _fail(self, request: _Request, error: Exception, finished: Finished) -> None:
        """Fail one request alone: its outcome is ``error``, and its rows leave the batch at the
        next chance (``_decode`` skips them)."""
        if request.gone or request.done:
            return
        request.failed = True
        finished.append((request.ticket, error))
        self._unqueue(request)

    def _fail_all(self, rows: list[_Sequence], error: Exception, finished: Finished) -> None:
        """Fail every request with a row in ``rows``, rows that are dropped."""
        for row in rows:
            row.request.running -= 1
        for request in _requests_of(rows):
            self._fail(request, error, finished)
        self._forget_cancelled()

    def _unqueue(self, request: _Request) -> None:
        request.prompt = None
        request.chunked = None
        for queue in (self._waiting, self._parked):
            if request in queue:
                queue.remove(request)

    # -- memory ---------------------------------------------------------------------------------

    def memory(self) -> dict[str, int]:
        """What the engine holds on its device by its own count, in bytes: ``weights``,
        ``adapters``, ``prompts`` (kept for later slices, and those being prefilled in chunks, as
        far as they are), ``kv`` (the running batches' caches, masks, positions and logits as
        they are now), ``planned`` (what admission plans against: all of it, each running row's
        cache at its last token, a step's working memory, and what each prompt being prefilled
        in chunks was admitted with) and the ``budget``."""
        weights, adapters, prompts = self._held()
        return {
            "weights": weights,
            "adapters": adapters,
            "prompts": prompts + sum(_chunk_bytes(r) for r in self._chunked()),
            "kv": self._row_bytes(),
            "planned": self._plan().total(),
            "budget": self.placement.memory_bytes,
        }

    def _row_bytes(self) -> int:
        """The running batches' caches, masks, positions and logits as they are now: each cache
        tensor's whole buffer (it may have columns to spare, or columns trimmed off)."""
        total = 0
        for batch in list(self._batches.values()):
            total += _cache_bytes(batch.cache)
            total += batch.mask.nbytes + batch.positions.nbytes + batch.logits.nbytes
        return total

    def _held(self) -> tuple[int, int, int]:
        """The bytes of the base weights, the adapters and the kept prompts."""
        weights = sum(base.weight_bytes for base in self.bases.values())
        adapters = self._slot_bytes()
        prompts = 0
        for request in self._requests.values():
            if request.prompt is not None:
                prompts += request.prompt.logits.nbytes
                prompts += sum(k.nbytes + v.nbytes for k, v in request.prompt.layers)
        return weights, adapters, prompts

    def _plan(self) -> Plan:
        """The memory as it is, with the running rows reserved to their last tokens, and each
        prompt being prefilled in chunks with what its request was admitted with (its whole
        prompt's prefill and its rows), so that no later admission takes what it will need. What
        is neither is the engine's count, or, where torch counts the device's tensors (CUDA,
        MPS) and they take more (what the engine does not see: the allocator's rounding, a
        library's own buffers), that measure less the rows' and the chunked prompts' tensors."""
        held = sum(self._held())
        chunked = self._chunked()
        measured = device.allocated(self.placement.device)
        if measured:
            inside = self._row_bytes() + sum(_chunk_bytes(r) for r in chunked)
            held = max(held, measured - inside)
        plan = Plan(self.placement.memory_bytes, held, self.rows_per_request, {})
        for name, batch in self._batches.items():
            remaining = sum(
                max(row.request.command.params.max_tokens - len(row.tokens), 0)
                for row in batch.rows
            )
            plan.bases[name] = Rows(
                self.bases[name].costs,
                rows=len(batch.rows),
                width=int(batch.mask.shape[1]),
                remaining=remaining,
            )
        for request in chunked:  # what each was admitted with, its prefill and rows
            assert request.chunked is not None
            plan.take(request.base.name, request.base.costs, _ask(request), request.chunked.rows)
        return plan

    def _chunked(self) -> list[_Request]:
        """The requests whose prompts are being prefilled in chunks."""
        return [r for r in self._requests.values() if r.chunked is not None and not r.gone]

    def _never_fits(self, request: _Request) -> InvalidRequest | None:
        """The refusal of a request that could not fit the budget even alone: its first slice
        (one sequence; every sequence for a model that admits requests whole) with its prefill,
        beside every base model's weights and its own adapter."""
        base = request.base
        adapter = (
            base.adapters[request.command.adapter_key] if request.command.adapter_key else None
        )
        weights = sum(b.weight_bytes for b in self.bases.values())
        fixed = weights + (adapter.nbytes if adapter else 0)
        budget = self.placement.memory_bytes
        plan = Plan(budget, fixed, self.rows_per_request, {})
        ask = _ask(request)
        rows = min(1, ask.left) if base.plain else ask.left
        need = plan.need(base.name, base.costs, ask, rows)
        if need <= budget:
            return None
        plan.take(base.name, base.costs, ask, rows)
        parts = plan.bases[base.name].parts(self.rows_per_request)
        command = request.command
        scored = (
            f", keeping the logits of all {ask.prompt} prompt positions for its prompt scores"
            if ask.scores
            else ""
        )
        sequences = f"{rows} sequence" + ("s" if rows != 1 else "")
        whole = "" if base.plain else " (this model's cache admits a request's sequences at once)"
        return InvalidRequest(
            f"this sample request needs {mib(need)} of the sampler's memory on "
            f"{self.placement.device} even alone, more than its budget of {mib(budget)} "
            f"({MEMORY_VARIABLE}): {mib(parts['kv'])} of KV cache for {sequences} of "
            f"{ask.prompt} prompt + {command.params.max_tokens} sampled tokens{whole}, "
            f"{mib(parts['prefill'] + parts['step'])} of working memory to prefill and sample"
            f"{scored}, beside {mib(fixed)} of model weights"
            + (" and adapter" if adapter else "")
            + f". Ask for fewer tokens, or give the sampler more memory ({MEMORY_VARIABLE}, "
            f"{DEVICE_VARIABLE})"
        )

    def _evict_idle(self, excess: int) -> int:
        """Drop adapters that no queued or running request uses, least recently used first,
        until ``excess`` bytes are freed or none is left, and give their places in the slots'
        stacks back; the bytes freed."""
        in_use = {(r.base.name, r.adapter) for r in self._requests.values()}
        before = self._slot_bytes()
        dropped = 0
        for base in self.bases.values():
            for key, adapter in list(base.adapters.items()):
                if dropped >= excess:
                    break
                if (base.name, adapter.slot) in in_use:
                    continue
                del base.adapters[key]
                _drop_adapter(base, adapter.slot)
                dropped += adapter.nbytes
                log.info(
                    "evicted adapter %s (%d bytes) from %s to make room in the memory budget",
                    key,
                    adapter.nbytes,
                    base.name,
                )
        for base in self.bases.values():
            if base.slots is not None:
                base.slots.shrink()
        return before - self._slot_bytes()

    def _slot_bytes(self) -> int:
        """What the adapters' slots take on the device: their stacks, free places included."""
        return sum(base.slots.nbytes() for base in self.bases.values() if base.slots is not None)

    # -- admission ------------------------------------------------------------------------------

    def _admit(self, finished: Finished) -> None:
        """Give waiting sequences rows, in the order of the waiting line: each request at most
        ``rows_per_request`` at a time, the batch at most ``max_rows``, and all of it within the
        memory budget. A request that got rows for some of its sequences only goes to the back of
        the line, or, when it holds its share, leaves the line until some of its rows finish and
        then goes to the back: behind the requests that came meanwhile. One that got none for
        want of rows keeps its place; one that got none for want of memory keeps its place and
        holds the line (unless nothing runs, when only what other waiting requests keep could be
        in its way; one that could not fit even then is failed).

        New prompts are prefilled, at most ``prefill_tokens`` of them a step. A prompt that does
        not fit what is left of the step waits, with every new prompt behind it, keeping their
        places for the next step; except a prompt longer than the bound (on a model whose cache
        can be joined), which is prefilled in chunks: each step, what is left of the bound,
        until its last chunk. It is admitted with its first chunk, and the memory plan keeps
        what it was admitted with until its last, when its rows join the batch; meanwhile it
        keeps its place in line. Later slices reuse their request's prefilled prompt."""
        parked = self._parked
        self._parked = [r for r in parked if r.running >= self.rows_per_request]
        self._waiting.extend(r for r in parked if r.running < self.rows_per_request)
        line, self._waiting = self._waiting, []
        if not line:  # most steps: nothing to admit, and no memory plan to make
            return
        chunking = self._chunked()
        used = {name: len(batch.rows) for name, batch in self._batches.items()}
        for request in chunking:  # the rows they were admitted with
            assert request.chunked is not None
            used[request.base.name] = used.get(request.base.name, 0) + request.chunked.rows
        plan = self._plan()
        fresh: dict[str, list[tuple[_Request, int]]] = {}  # to prefill, with rows to give
        more: dict[str, list[tuple[_Request, int]]] = {}  # prefilled already
        # The next chunk of each prompt prefilled in chunks: its tokens, and its request's rows.
        chunks: list[tuple[_Request, int, int]] = []
        behind: list[_Request] = []
        blocked = False
        prefilling = 0  # prompt tokens this step prefills
        prefill_full = False
        bound = self.prefill_tokens
        for request in line:
            todo = request.unprefilled
            chunk = 0  # the tokens of this step's chunk, if it is not the prompt's last
            if todo and 0 < bound < prefilling + todo:
                in_chunks = request.base.plain and (request.chunked is not None or todo > bound)
                if in_chunks and prefilling < bound:
                    chunk = bound - prefilling
                elif prefilling:
                    prefill_full = True
                # else a longer prompt of a model whose cache cannot be joined: alone, whole
            # A request waiting for memory holds the line for new admissions; a prompt being
            # prefilled in chunks was admitted already, and what it needs is planned.
            if (blocked and request.chunked is None) or (prefill_full and todo):
                self._waiting.append(request)
                continue
            name = request.base.name
            left = request.left
            if request.chunked is not None:
                take = request.chunked.rows  # planned since its first chunk
            else:
                take = self._rows_for(request, used.get(name, 0))
                if take <= 0 and left > 0:
                    self._waiting.append(request)
                    continue
                fit = self._fit(plan, request, take)
                if fit is None:
                    idle = not self._batches and not fresh and not more and not chunking
                    if not idle:
                        blocked = True
                    elif (refusal := self._never_fits(request)) is not None:
                        self._fail(request, refusal, finished)
                        continue
                    self._waiting.append(request)
                    continue
                take = fit
                plan.take(name, request.base.costs, _ask(request), take)
                used[name] = used.get(name, 0) + take
            if chunk:  # not its last: it keeps its place, and its rows wait for its last
                prefilling = bound
                request.chunked = request.chunked or _Chunked(take)
                chunks.append((request, chunk, take))
                self._waiting.append(request)
                continue
            prefilling += todo
            if request.chunked is not None:  # its last chunk: its rows are given after it
                chunks.append((request, todo, take))
            else:
                (more if request.prefilled else fresh).setdefault(name, []).append((request, take))
            if take < left and request.running + take >= self.rows_per_request:
                self._parked.append(request)
            elif take < left:
                behind.append(request)
        self._waiting.extend(behind)
        for request, tokens, take in chunks:
            if self._prefill_chunk(request, tokens, finished) and take:
                more.setdefault(request.base.name, []).append((request, take))
        for name in {**fresh, **more}:
            parts = self._prefill_isolating(fresh.get(name, []), finished)
            if name in more:
                try:
                    parts.append(self._from_prompts(more[name]))
                except Exception as exc:  # copying prompts, which is no one request's doing
                    error = self._failure(exc, f"giving rows to {len(more[name])} requests")
                    if error is exc:
                        log.exception("could not give rows to %d requests", len(more[name]))
                    for request, _ in more[name]:
                        self._fail(request, error, finished)
            for part in parts:
                running = self._batches.get(name)
                try:
                    if running is None:
                        self._batches[name] = part
                    else:
                        _merge_into(running, part)
                except Exception as exc:  # joining them, which is no one request's doing
                    error = self._failure(exc, f"merging {len(part.rows)} new sequences")
                    if error is exc:
                        log.exception("could not merge %d new rows into the batch", len(part.rows))
                    self._fail_all(part.rows, error, finished)

    def _rows_for(self, request: _Request, used: int) -> int:
        """The rows ``request`` may have beside the ``used`` ones of its base's batch, by the row
        limits alone (0 for one that only scores its prompt)."""
        left, name = request.left, request.base.name
        if not request.prefilled and left == 0:  # only its prompt to score
            return 0
        if request.base.plain:
            return min(left, self.rows_per_request - request.running, self.max_rows - used)
        # Sliding-window caches cannot be joined: a batch forms once, of requests admitted whole,
        # and takes no more until it is done.
        alone = name not in self._batches and used == 0
        fits = name not in self._batches and used + left <= self.max_rows
        return left if alone or fits else 0

    def _fit(self, plan: Plan, request: _Request, want: int) -> int | None:
        """How many of ``want`` rows ``request`` gets within the budget (all of them, for a
        model that admits requests whole; 0 for one that only scores its prompt), evicting
        adapters no request uses when that makes room for more; None when it gets none."""
        base = request.base
        ask = _ask(request)
        least = (1 if base.plain else want) if want else 0
        fit = plan.fitting(base.name, base.costs, ask, want)
        if fit < want:  # rows before idle adapters
            freed = self._evict_idle(plan.need(base.name, base.costs, ask, want) - plan.budget)
            if freed:
                plan.held -= freed
                fit = plan.fitting(base.name, base.costs, ask, want)
        if fit < least:
            return None
        return fit if base.plain else want

    def _prefill_isolating(
        self, slices: list[tuple[_Request, int]], finished: Finished
    ) -> list[_Batch]:
        """Prefill the requests of ``slices`` together; if that forward fails, each alone, so
        that only the culprit fails (after an out-of-memory error, with the allocator's free
        blocks given back first)."""
        if not slices:
            return []
        try:
            forward = self._prefill(slices)
        except Exception as exc:
            error = self._failure(exc, f"prefilling {len(slices)} prompts")
            if len(slices) == 1:
                self._fail(slices[0][0], error, finished)
                return []
            if error is exc:
                log.exception(
                    "a prefill of %d requests failed; running them one by one", len(slices)
                )
        else:
            return self._prefilled(slices, forward, finished)
        if self._out_of_memory:  # the failed forward's tensors are gone with its frames
            device.release(self.placement.device)
        return [b for one in slices for b in self._prefill_isolating([one], finished)]

    @torch.inference_mode()
    def _prefill_chunk(self, request: _Request, tokens: int, finished: Finished) -> bool:
        """Prefill the next ``tokens`` of a prompt prefilled in chunks, appending to its cache.
        After its last chunk the prompt is kept whole for its rows (``request.prompt``), and
        scored where its request asks; a request that only scores its prompt is finished. Returns
        whether its prompt is now prefilled whole; a request that fails here fails alone."""
        chunked = request.chunked
        assert chunked is not None
        command = request.command
        start, end = chunked.length, chunked.length + tokens
        scored = _wants_prompt_scores(command)
        where = self.placement.device
        cache, chunked.cache = chunked.cache, None  # its only holder while the forward grows it
        try:
            out = self._forward(
                request.base,
                [request.adapter],
                room=len(command.prompt) - end,  # the whole prompt's columns, allocated once
                input_ids=torch.tensor([list(command.prompt[start:end])], device=where),
                attention_mask=torch.ones((1, end), dtype=torch.long, device=where),
                position_ids=torch.arange(start, end, device=where)[None],
                past_key_values=cache,
                logits_to_keep=0 if scored else 1,
            )
            del cache
            chunked.cache, chunked.length = out.past_key_values, end
            # A copy: a view would keep the chunk's every position alive with the prompt.
            chunked.logits = out.logits[0, -1].float().clone()
            if scored:
                if chunked.scores is None:
                    shape = (len(command.prompt), out.logits.shape[-1])
                    chunked.scores = out.logits.new_empty(shape)
                chunked.scores[start:end] = out.logits[0]
            if end < len(command.prompt):
                return False
            if chunked.scores is not None:
                _score_prompt(request, chunked.scores)
        except Exception as exc:
            what = f"prefilling {tokens} tokens of a {len(command.prompt)}-token prompt"
            self._fail(request, self._failure(exc, what), finished)
            return False
        layers = [_kv(layer) for layer in out.past_key_values.layers]
        request.prompt = _Prompt(layers, chunked.logits, end)
        request.chunked = None
        request.prefilled = True
        if request.left == 0:
            request.done = True
            request.prompt = None
            finished.append((request.ticket, _response(request)))
        return True

    def _forward(self, base: _Base, adapters: list[int], room: int = 0, **inputs: Any) -> Any:
        """One forward of rows that may each use a different adapter (their slots, or
        ``NO_ADAPTER``): through the base's lean forward where it has one (decoder.py; a cache
        layer that grows takes ``room`` columns to spare), else through transformers'."""
        if base.decoder is not None:
            forward: Callable[..., Any] = functools.partial(base.decoder, room=room)
        else:
            forward = functools.partial(base.model, use_cache=True)
        if base.slots is None:
            assert all(slot == NO_ADAPTER for slot in adapters)
            return forward(**inputs)
        with base.slots.routed(adapters):
            return forward(**inputs)

    @torch.inference_mode()
    def _prefill(self, slices: list[tuple[_Request, int]]) -> _Prefill:
        """One forward of the prompts, left-padded together."""
        requests = [request for request, _ in slices]
        lengths = [len(r.command.prompt) for r in requests]
        width = max(lengths)
        # Built on the CPU, moved to the device at once.
        input_ids = torch.zeros((len(requests), width), dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        positions = torch.zeros((len(requests), width), dtype=torch.long)
        for i, request in enumerate(requests):
            pad = width - lengths[i]
            input_ids[i, pad:] = torch.tensor(list(request.command.prompt), dtype=torch.long)
            mask[i, pad:] = 1
            positions[i, pad:] = torch.arange(lengths[i])
        where = self.placement.device
        mask = mask.to(where)
        want_prompt = any(_wants_prompt_scores(r.command) for r in requests)
        out = self._forward(
            requests[0].base,
            [r.adapter for r in requests],
            input_ids=input_ids.to(where),
            attention_mask=mask,
            position_ids=positions.to(where),
            logits_to_keep=0 if want_prompt else 1,
        )
        return _Prefill(out.past_key_values, out.logits, mask, lengths)

    @torch.inference_mode()
    def _prefilled(
        self, slices: list[tuple[_Request, int]], prefill: _Prefill, finished: Finished
    ) -> list[_Batch]:
        """Each request's share of a prefill: its prompt scores, its first rows (and its prompt
        kept for the rows to come). A request that fails here fails alone. Returns the new rows
        as one batch (none when no request samples anything)."""
        width = max(prefill.lengths)
        owners: list[int] = []
        rows: list[_Sequence] = []
        for i, (request, take) in enumerate(slices):
            length = prefill.lengths[i]
            try:
                if _wants_prompt_scores(request.command):
                    _score_prompt(request, prefill.logits[i, width - length :])
                request.prefilled = True
                if request.left == 0:
                    request.done = True
                    finished.append((request.ticket, _response(request)))
                    continue
                if take < request.left:
                    request.prompt = _keep_prompt(prefill, i)
                rows.extend(self._start(request, take))
                owners.extend([i] * take)
            except Exception as exc:
                self._fail(request, self._failure(exc, "scoring a prompt"), finished)
        if not owners:
            return []
        try:
            index = torch.tensor(owners, dtype=torch.long, device=self.placement.device)
            cache = prefill.cache
            cache.reorder_cache(index)  # type: ignore[arg-type]
            batch = _Batch(
                rows=rows,
                cache=cache,
                mask=prefill.mask[index],
                logits=prefill.logits[:, -1, :].float()[index],
                positions=torch.tensor(
                    [prefill.lengths[i] for i in owners],
                    dtype=torch.long,
                    device=self.placement.device,
                ),
            )
        except Exception as exc:  # copying the cache to rows, which is no one request's doing
            error = self._failure(exc, f"copying {len(rows)} new sequences' cache")
            if error is exc:
                log.exception("could not give rows to %d requests", len(slices))
            self._fail_all(rows, error, finished)
            return []
        return [batch]

    def _start(self, request: _Request, take: int) -> list[_Sequence]:
        """Rows for the next ``take`` sequences of ``request``, each with its own generator."""
        first = len(request.sequences)
        rows = [
            _Sequence(request, self._generator(_stream_seed(request.seed, n)))
            for n in range(first, first + take)
        ]
        request.sequences.extend(rows)
        request.running += take
        if request.left == 0:
            request.prompt = None
        return rows

    def _generator(self, seed: int) -> torch.Generator:
        """A generator on the device (sampling draws where the probabilities are)."""
        return torch.Generator(device=self.placement.device).manual_seed(seed)

    @torch.inference_mode()
    def _from_prompts(self, slices: list[tuple[_Request, int]]) -> _Batch:
        """The rows of later slices, from their requests' kept prompts (no forward)."""
        prompts = [(request.prompt, take) for request, take in slices]
        assert all(prompt is not None for prompt, _ in prompts)
        width = max(prompt.length for prompt, _ in prompts if prompt is not None)
        where = self.placement.device

        def rows_of(x: torch.Tensor, length: int, take: int) -> torch.Tensor:
            padded = F.pad(x, [0, 0, width - length, 0])  # on the left of the columns
            return padded.expand(take, -1, -1, -1)

        layers = []
        for layer in range(len(prompts[0][0].layers)):  # type: ignore[union-attr]
            keys, values = [], []
            for prompt, take in prompts:
                assert prompt is not None
                k, v = prompt.layers[layer]
                keys.append(rows_of(k, prompt.length, take))
                values.append(rows_of(v, prompt.length, take))
            layers.append((torch.cat(keys), torch.cat(values)))
        masks, logits, positions = [], [], []
        for prompt, take in prompts:
            assert prompt is not None
            mask = torch.zeros((take, width), dtype=torch.long, device=where)
            mask[:, width - prompt.length :] = 1
            masks.append(mask)
            logits.append(prompt.logits.expand(take, -1))
            positions.append(torch.full((take,), prompt.length, dtype=torch.long, device=where))
        cache = DynamicCache(ddp_cache_data=layers)
        mask, logit, position = torch.cat(masks), torch.cat(logits), torch.cat(positions)
        rows = [row for request, take in slices for row in self._start(request, take)]
        return _Batch(rows=rows, cache=cache, mask=mask, logits=logit, positions=position)

    @torch.inference_mode()
    def _decode(self, batch: _Batch, finished: Finished) -> bool:
        """Sample one token for every row, then run the rows that go on one token further.
        Returns whether any row goes on."""
        _select(batch, [p for p, row in enumerate(batch.rows) if not row.request.gone])
        self._forget_cancelled()
        if not batch.rows:
            return False
        where = self.placement.device
        places = _places(batch.rows)
        peak = batch.logits.amax(dim=-1)  # NaN where a logit is NaN
        finite = torch.isfinite(peak)
        if not bool(finite.all()):
            flags = finite.tolist()
            for request, where_rows in places.items():
                broken = [p for p in where_rows if not flags[p]]
                if broken:
                    generated = len(batch.rows[broken[0]].tokens)
                    at = (
                        f"in {len(broken)} of this request's {len(where_rows)} running sequences "
                        f"(after {generated} sampled tokens)"
                    )
                    self._fail(request, _nonfinite(request, batch.logits[broken], at), finished)
        raw = torch.log_softmax(batch.logits, dim=-1)
        chosen = torch.zeros(len(batch.rows), dtype=torch.long, device=where)
        # The rows of requests with the same sampling parameters are chosen in one call (each
        # row still draws from its own generator): per-call work, not rows, is most of it. If
        # that call raises, each request of it is chosen alone from where its generators were,
        # so that only the one that raises fails, with the others' draws as they would be.
        alike: dict[tuple[float, int, float], list[_Request]] = {}
        for request in places:
            if not request.gone:
                params = request.command.params
                alike.setdefault((params.temperature, params.top_k, params.top_p), []).append(
                    request
                )
        for requests in alike.values():
            rows = [p for request in requests for p in places[request]]
            generators = [batch.rows[p].generator for p in rows]
            states = [g.get_state() for g in generators] if len(requests) > 1 else []
            try:
                index = torch.tensor(rows, dtype=torch.long, device=where)
                params = requests[0].command.params
                chosen[index] = _choose(batch.logits[index], peak[index], params, generators)
                continue
            except Exception as exc:
                if len(requests) == 1:
                    self._fail(requests[0], self._failure(exc, "sampling"), finished)
                    continue
            for generator, state in zip(generators, states, strict=True):
                generator.set_state(state)
            for request in requests:
                own = places[request]
                index = torch.tensor(own, dtype=torch.long, device=where)
                try:
                    chosen[index] = _choose(
                        batch.logits[index],
                        peak[index],
                        request.command.params,
                        [batch.rows[p].generator for p in own],
                    )
                except Exception as exc:
                    self._fail(request, self._failure(exc, "sampling"), finished)
        chosen_lp = raw.gather(-1, chosen[:, None])[:, 0].tolist()
        widest = max(row.request.command.topk_sample_logprobs for row in batch.rows)
        top = None
        if widest:
            values, indices = raw.topk(widest, dim=-1)
            top = indices.cpu().numpy(), values.cpu().numpy()
        del raw  # before the forward: the step's working memory (memory.py) counts it so
        tokens = chosen.tolist()

        for p, row in enumerate(batch.rows):
            request = row.request
            if request.gone:
                continue
            try:
                self._advance(row, tokens[p], chosen_lp[p], top, p, finished)
            except Exception as exc:
                self._fail(request, exc, finished)
        keep = [p for p, row in enumerate(batch.rows) if _goes_on(row)]
        if not keep:
            _select(batch, keep)
            self._forget_cancelled()
            return False
        chosen = chosen[torch.tensor(keep, dtype=torch.long, device=where)]
        _select(batch, keep)
        batch.mask = torch.cat(
            [batch.mask, torch.ones((len(keep), 1), dtype=torch.long, device=where)], dim=1
        )
        # A cache layer that grows takes this many columns to spare (decoder.py's ``_append``):
        # what the memory plan reserves for the rows' tokens still to sample, shared by the rows.
        remaining = sum(
            max(row.request.command.params.max_tokens - len(row.tokens), 0) for row in batch.rows
        )
        out = self._forward(
            batch.rows[0].request.base,
            [row.request.adapter for row in batch.rows],
            room=remaining // len(batch.rows),
            input_ids=chosen[:, None],
            attention_mask=batch.mask,
            position_ids=batch.positions[:, None],
            past_key_values=batch.cache,
        )
        batch.cache = out.past_key_values
        batch.logits = out.logits[:, -1, :].float()
        batch.positions = batch.positions + 1
        return True

    def _advance(
        self,
        row: _Sequence,
        token: int,
        logprob: float,
        top: tuple[np.ndarray, np.ndarray] | None,
        p: int,
        finished: Finished,
    ) -> None:
        """Append a row's new token; finish its request when this was its last."""
        request = row.request
        row.tokens.append(token)
        row.logprobs.append(logprob)
        k = request.command.topk_sample_logprobs
        if k and top is not None:
            row.topk_ids.append(top[0][p, :k].copy())
            row.topk_logprobs.append(top[1][p, :k].copy())
        if token in request.stop_ids or (
            request.stop_strs
            and _ends_with_stop(request.base.tokenizer, row.tokens, request.stop_strs)
        ):
            row.stopped = True
        elif len(row.tokens) < request.command.params.max_tokens:
            return
        request.unfinished -= 1
        if request.unfinished == 0:
            body = _response(request)
            request.done = True
            finished.append((request.ticket, body))

    def _forget_cancelled(self) -> None:
        for ticket, request in list(self._requests.items()):
            if request.cancelled and request.running == 0:
                del self._requests[ticket]


def _ask(request: _Request) -> Ask:
    """A request's next slice, as the memory plan sees it."""
    command = request.command
    return Ask(
        prompt=len(command.prompt),
        max_tokens=command.params.max_tokens,
        fresh=not request.prefilled,
        scores=_wants_prompt_scores(command),
        left=request.left,
    )


def _drop_adapter(base: _Base, slot: int) -> None:
    """Free an adapter's slot."""
    assert base.slots is not None
    base.slots.unload(slot)


def _weight_bytes(model: torch.nn.Module) -> int:
    """A model's parameters and buffers (shared ones once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass
class _Prefill:
    """One forward of prompts: its cache, logits (all positions, or the last one), the prompts'
    attention mask and lengths (left-padded to the longest)."""

    cache: DynamicCache
    logits: torch.Tensor
    mask: torch.Tensor
    lengths: list[int]


def _chunk_bytes(request: _Request) -> int:
    """What a prompt prefilled in chunks holds so far: its cache's buffers and its logits."""
    chunked = request.chunked
    if chunked is None:
        return 0
    total = sum(t.nbytes for t in (chunked.scores, chunked.logits) if t is not None)
    return total + (_cache_bytes(chunked.cache) if chunked.cache is not None else 0)


def _cache_bytes(cache: DynamicCache) -> int:
    """A cache's keys and values, each tensor's whole buffer once (it may have columns to spare,
    or columns trimmed off): sliding-window layers too."""
    buffers = {}
    for layer in cache.layers:
        for part in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(part, torch.Tensor):
                storage = part.untyped_storage()
                buffers[storage.data_ptr()] = storage.nbytes()
    return sum(buffers.values())


def _keep_prompt(prefill: _Prefill, i: int) -> _Prompt:
    """Prompt ``i`` of a prefill, as one row of its own (plain cache layers only)."""
    length = prefill.lengths[i]
    start = max(prefill.lengths) - length
    layers = []
    for layer in prefill.cache.layers:
        keys, values = _kv(layer)
        layers.append((keys[i : i + 1, :, start:].clone(), values[i : i + 1, :, start:].clone()))
    return _Prompt(layers, prefill.logits[i, -1].float().clone(), length)


def _places(rows: list[_Sequence]) -> dict[_Request, list[int]]:
    """Each request's rows, by position in the batch."""
    places: dict[_Request, list[int]] = {}
    for p, row in enumerate(rows):
        places.setdefault(row.request, []).append(p)
    return places


def _requests_of(rows: list[_Sequence]) -> list[_Request]:
    return list(_places(rows))


def _goes_on(row: _Sequence) -> bool:
    request = row.request
    return (
        not request.gone and not row.stopped and len(row.tokens) < request.command.params.max_tokens
    )


def _nonfinite(request: _Request, logits: torch.Tensor, where: str) -> Unprocessable:
    """The failure of a request whose logits are not finite (``where``: which of them)."""
    if bool(torch.isnan(logits).any()):
        what = "NaN"
    elif bool(torch.isposinf(logits).any()):
        what = "infinite"
    else:
        what = "-inf everywhere"
    return Unprocessable(
        f"the model's logits are {what} {where}, so nothing can be sampled or scored: "
        + _likely_cause(request)
    )


def _likely_cause(request: _Request) -> str:
    key = request.command.adapter_key
    if key:
        return (
            f"the likely cause is the adapter's weights ({key!r}): NaN or infinite values, or "
            "so large that the forward overflows (a training run that diverged; sample from an "
            "earlier checkpoint, or train with a lower learning rate)"
        )
    return (
        f"the base model {request.base.name!r} itself overflowed on this input (its weights "
        "hold NaN or infinite values, or are too large for float32)"
    )


# --- batches -----------------------------------------------------------------------------------


def _mergeable(cache: DynamicCache) -> bool:
    """Only plain (not sliding-window) layers can be left-padded and joined."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _merge_into(a: _Batch, b: _Batch) -> None:
    """Join ``b``'s rows to ``a``, the shorter cache left-padded with masked-out columns. In
    place, one cache tensor at a time, so that the merge holds one layer twice at most, not the
    whole cache (memory.py counts it so); ``b`` is used up. If it fails part-way, ``a`` is left
    as it was (its merged tensors cut back to views of its own rows) and the error raised."""
    width = max(a.mask.shape[1], b.mask.shape[1])
    ca, cb, ra = a.mask.shape[1], b.mask.shape[1], len(a.rows)

    def pad(x: torch.Tensor, columns: int, dim: int) -> torch.Tensor:
        missing = width - columns
        if missing == 0:
            return x
        spec = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [missing, 0]
        return F.pad(x, spec)

    merged: list[tuple[Any, str]] = []  # (layer, "keys" or "values") of a, done
    try:
        for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
            assert type(la) is DynamicLayer and type(lb) is DynamicLayer
            for part in ("keys", "values"):
                joined = torch.cat([pad(getattr(la, part), ca, -2), pad(getattr(lb, part), cb, -2)])
                setattr(lb, part, None)
                setattr(la, part, joined)
                merged.append((la, part))
        mask = torch.cat([pad(a.mask, ca, -1), pad(b.mask, cb, -1)])
        logits = torch.cat([a.logits, b.logits])
        positions = torch.cat([a.positions, b.positions])
    except BaseException:
        for layer, part in merged:
            setattr(layer, part, getattr(layer, part)[:ra, :, width - ca :])
        raise
    a.rows = a.rows + b.rows
    a.mask, a.logits, a.positions = mask, logits, positions


def _select(batch: _Batch, keep: list[int]) -> None:
    """Keep only the rows at positions ``keep`` (in that order), in the cache too; the others
    leave their request's count of running rows."""
    if len(keep) == len(batch.rows):
        return
    kept = set(keep)
    for p, row in enumerate(batch.rows):
        if p not in kept:
            row.request.running -= 1
    batch.rows = [batch.rows[p] for p in keep]
    if not keep:
        return
    index = torch.tensor(keep, dtype=torch.long, device=batch.mask.device)
    batch.cache.reorder_cache(index)  # type: ignore[arg-type]
    batch.mask, batch.positions = batch.mask[index], batch.positions[index]
    batch.logits = batch.logits[index]
    _trim(batch)


def _trim(batch: _Batch) -> None:
    """Cut the leading cache columns that no row attends to (they were padding for rows that
    have left)."""
    first = int(batch.mask.any(dim=0).to(torch.int8).argmax())
    if first == 0:
        return
    batch.mask = batch.mask[:, first:]
    for layer in batch.cache.layers:
        keys, values = _kv(layer)
        layer.keys, layer.values = keys[..., first:, :], values[..., first:, :]  # type: ignore[union-attr]


def _kv(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain cache layer's keys and values, ``[rows, heads, columns, head size]``."""
    assert type(layer) is DynamicLayer and layer.keys is not None and layer.values is not None
    return layer.keys, layer.values


# --- the semantics of one request ----------------------------------------------------------


def _wants_prompt_scores(command: bus.Sample) -> bool:
    return (
        command.prompt_logprobs
        or command.topk_prompt_logprobs > 0
        or command.prompt_alt_tokens_k > 0
        or command.HasField("target_prompt_logprobs")
    )


def _score_prompt(request: _Request, logits: torch.Tensor) -> None:
    """Everything a request asks of its prompt, from the prefill's logits (row i is the
    distribution of prompt token i + 1): logprobs and top-k, with no value before the window
    (position 0 at least); the logprobs of named target ids; draws of alternative tokens."""
    command = request.command
    where = logits.device
    prompt = torch.tensor(list(command.prompt), dtype=torch.long, device=where)
    logits = logits.float()
    peak = logits.amax(dim=-1)
    if not bool(torch.isfinite(peak).all()):
        raise _nonfinite(request, logits, "over this request's prompt")
    raw = torch.log_softmax(logits, dim=-1)
    start = prompt_window(command)
    length = len(prompt)
    if command.prompt_logprobs:
        values = np.full(length, np.nan, dtype="<f4")
        if start < length:
            values[start:] = (
                raw[start - 1 : -1].gather(-1, prompt[start:, None])[:, 0].cpu().numpy()
            )
        request.response.prompt_logprobs = values.tobytes()
    k = command.topk_prompt_logprobs
    if k:
        ids, lps = empty_topk(length, k)
        if start < length:
            top = raw[start - 1 : -1].topk(k, dim=-1)
            ids[start:], lps[start:] = top.indices.cpu().numpy(), top.values.cpu().numpy()
        request.response.topk_prompt_logprobs.CopyFrom(topk_message(ids, lps))
    if command.HasField("target_prompt_logprobs"):
        rows, _, targets = target_cells(command)
        values = np.zeros(len(targets), dtype="<f4")
        asked = targets >= 0
        index = (
            torch.from_numpy(rows[asked]).to(where),
            torch.from_numpy(targets[asked]).to(where),
        )
        values[asked] = raw[index].cpu().numpy()
        request.response.target_prompt_logprobs.CopyFrom(target_message(command, values))
    k = command.prompt_alt_tokens_k
    if k:
        # Draws with replacement at the request's temperature (0: the most likely token), from
        # a generator of their own, seeded from the request's seed.
        table = raw[:-1]
        if command.params.temperature == 0:
            drawn = table.argmax(-1, keepdim=True).expand(-1, k)
        else:
            probs = torch.softmax(_tempered(logits[:-1], peak[:-1], command.params), dim=-1)
            generator = torch.Generator(device=where)
            generator.manual_seed(_stream_seed(request.seed, _ALT_STREAM))
            drawn = (
                torch.multinomial(probs, k, replacement=True, generator=generator)
                if len(probs)
                else torch.zeros((0, k), dtype=torch.long, device=where)
            )
        chosen = table.gather(-1, drawn)
        request.response.prompt_alt_tokens.CopyFrom(
            alt_tokens_message(drawn.cpu().numpy(), chosen.cpu().numpy())
        )


def _response(request: _Request) -> bytes:
    response = request.response
    for row in request.sequences:
        sequence = response.sequences.add(
            stop_reason=tp.STOP_REASON_STOP if row.stopped else tp.STOP_REASON_LENGTH,
            tokens=np.asarray(row.tokens, "<i4").tobytes(),
            logprobs=np.asarray(row.logprobs, "<f4").tobytes(),
        )
        if request.command.topk_sample_logprobs:
            sequence.topk_sampled_logprobs.CopyFrom(
                topk_message(np.stack(row.topk_ids), np.stack(row.topk_logprobs))
            )
    return response.SerializeToString()


def _ends_with_stop(tokenizer: Tokenizer, tokens: list[int], stops: list[str]) -> bool:
    """Whether the newest token completed a stop string (earlier tokens were already checked)."""
    longest = max(len(s) for s in stops)
    tail = tokenizer.decode(tokens[-(longest + 8) :], skip_special_tokens=False)
    before = tokenizer.decode(tokens[-(longest + 8) : -1], skip_special_tokens=False)
    return any(s in tail and s not in before for s in stops)


def _stream_seed(seed: int, index: int) -> int:
    return (seed + index * 0x9E3779B97F4A7C15) % 2**63


def _tempered(logits: torch.Tensor, peak: torch.Tensor, params: tp.SamplingParams) -> torch.Tensor:
    """Logits at a temperature above 0, for a softmax: minus each row's largest (``peak``) first,
    so none overflows however small the temperature. One below float32's smallest normal number
    is raised to it: arithmetic on denormals may flush them to 0 (x / 0), and the result is the
    same, the greedy limit (ties aside: the largest logits share the draw)."""
    temperature = max(params.temperature, _SMALLEST_NORMAL)
    return (logits - peak[:, None]) / temperature


def _choose(
    logits: torch.Tensor,
    peak: torch.Tensor,
    params: tp.SamplingParams,
    generators: list[torch.Generator],
) -> torch.Tensor:
    """The next token of each row of one request, from finite logits (``peak``: each row's
    largest)."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    scaled = _tempered(logits, peak, params)
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    if params.top_p < 1.0:
        ordered, order = torch.sort(scaled, descending=True, dim=-1)
        probs = torch.softmax(ordered, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p, and the most likely token always.
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        drop[:, 0] = False
        ordered = ordered.masked_fill(drop, -math.inf)
        scaled = torch.full_like(scaled, -math.inf).scatter(-1, order, ordered)
    probs = torch.softmax(scaled, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise Unprocessable(
            f"the sampling probabilities at temperature {params.temperature!r} (top_k "
            f"{params.top_k}, top_p {params.top_p!r}) are not finite, so nothing can be sampled: "
            "the likely cause is the temperature, which must be a finite number above 0 (or 0 "
            "for the most likely token)"
        )
    return _draw(probs, generators)


def _draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token from each row of ``probs`` (finite, not negative, each row's sum above 0),
    by the inverse of its cumulative distribution at a uniform number drawn from the row's own
    generator: one small draw per row, and the rest for all rows at once (a ``multinomial``
    per row costs more than the decoding step's forward of a small model, over a 49k-token
    vocabulary)."""
    uniform = torch.cat([torch.rand(1, generator=g, device=probs.device) for g in generators])
    return _inverse_cdf(probs, uniform)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's token at its ``uniform`` in [0, 1): the first index whose cumulative sum
    exceeds the uniform times the row's total, which has a mass of its own (a token of
    probability 0 is never drawn). Should the product round up to the total, past every index,
    the token at which the cumulative sum first reaches the total (one with a mass) is drawn:
    one binary search per row, where finding the last token with a mass took three passes over
    the vocabulary at every step."""
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1:].contiguous()
    picks = torch.searchsorted(cumulative, uniform[:, None] * total, right=True)
    return torch.minimum(picks, torch.searchsorted(cumulative, total))[:, 0]
