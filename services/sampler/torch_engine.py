"""The torch engine: a base model per name, any run's LoRA adapter on top, and continuous
batching with a KV cache.

One running batch per base model holds a row per sequence being sampled. Each ``step`` first
prefills the requests added since the last one (left-padded together, each row with its own
positions), copies each request's prompt cache to its ``num_samples`` rows and merges them into
the running batch (the shorter cache left-padded, masked out); then it samples one token for
every row and runs one forward of all rows that go on. Rows may use different adapters: PEFT's
mixed-adapter forward takes one adapter name per row (``__base__`` for none). Finished rows leave
the batch, and cache columns that no row attends to any more are cut off.

Each sequence has its own generator, seeded from (seed, index), so what a seeded request
samples does not depend on ``num_samples`` or on what else is in the batch.

Logprobs are the model's raw log-probabilities (before temperature, top-k or top-p), which is
what the trainer's forward computes, so RL importance ratios compare like with like.

Owns: every torch call of the sampler, the sampling rules and the adapter cache (LRU, bounded by
the adapters' bytes; adapters that queued or running requests use are never evicted).
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from peft import PeftModel
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer

from tinsmith import models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp

from .engine import (
    DEFAULT_ADAPTER_CACHE_BYTES,
    AdapterMissing,
    Delta,
    alt_tokens_message,
    check_command,
    empty_topk,
    eos_ids_of,
    evictions,
    prompt_window,
    stop_rule,
    target_cells,
    target_message,
    topk_message,
)

log = logging.getLogger(__name__)

# PEFT's name for "no adapter" in a mixed-adapter batch.
BASE_ADAPTER = "__base__"
# Sequences decoded together at most; requests beyond it wait for rows to finish.
DEFAULT_MAX_ROWS = 256
# The generator stream of a request's prompt_alt_tokens draws (sequence i uses stream i).
_ALT_STREAM = 2**32


@dataclass
class _Adapter:
    name: str  # PEFT adapter name
    nbytes: int


@dataclass
class _Base:
    name: str
    model: PreTrainedModel | PeftModel
    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    vocab_size: int
    adapters: OrderedDict[str, _Adapter] = field(default_factory=OrderedDict)  # LRU first
    loaded: int = 0  # adapters ever loaded, for unique PEFT names


@dataclass
class _Request:
    ticket: int
    command: bus.Sample
    base: _Base
    adapter: str
    stop_ids: frozenset[int]
    stop_strs: list[str]
    seed: int = 0
    response: tp.SampleResponse = field(default_factory=tp.SampleResponse)
    sequences: list[_Sequence] = field(default_factory=list)
    unfinished: int = 0
    cancelled: bool = False


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
    ) -> None:
        self.cache_dir = cache_dir
        self.threads = threads
        self.adapter_cache_bytes = adapter_cache_bytes
        self.max_rows = max_rows
        self.bases: dict[str, _Base] = {}
        self._waiting: list[_Request] = []
        self._batches: dict[str, _Batch] = {}
        self._requests: dict[int, _Request] = {}
        self._streamed: dict[int, _Request] = {}  # the requests that report their progress

    def init_compute_thread(self) -> None:
        torch.set_num_threads(self.threads)

    # -- models and adapters ------------------------------------------------------------------

    def load_base(self, name: str) -> None:
        self._base(name)

    def _base(self, name: str) -> _Base:
        base = self.bases.get(name)
        if base is None:
            directory = models.materialize(name, self.cache_dir)
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
            model.requires_grad_(False)
            model.eval()  # type: ignore[no-untyped-call]
            config = json.loads((directory / "config.json").read_text())
            eos_ids = eos_ids_of(config)
            tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
            embeddings = model.get_input_embeddings()
            assert isinstance(embeddings, torch.nn.Embedding)
            base = _Base(name, model, tokenizer, eos_ids, embeddings.num_embeddings)
            self.bases[name] = base
        return base

    def has_adapter(self, base_model: str, key: str) -> bool:
        base = self.bases.get(base_model)
        return base is not None and key in base.adapters

    def loaded(self) -> dict[str, int]:
        return {name: len(base.adapters) for name, base in list(self.bases.items())}

    def device(self) -> str:
        for base in list(self.bases.values()):
            return str(next(base.model.parameters()).device)
        return "cpu"

    def adapter_bytes(self, base_model: str) -> int:
        base = self.bases.get(base_model)
        return sum(a.nbytes for a in base.adapters.values()) if base else 0

    def load_adapter(self, base_model: str, key: str, directory: Path) -> None:
        """Load the PEFT adapter in ``directory`` under its object-store ``key``."""
        base = self._base(base_model)
        if key not in base.adapters:
            self._load_adapter(base, key, directory)

    def _load_adapter(self, base: _Base, key: str, directory: Path) -> None:
        name = f"a{base.loaded}"
        base.loaded += 1
        if isinstance(base.model, PeftModel):
            base.model.load_adapter(str(directory), adapter_name=name)
        else:
            base.model = PeftModel.from_pretrained(base.model, str(directory), adapter_name=name)
        base.model.eval()
        marker = f".{name}."
        nbytes = sum(
            p.numel() * p.element_size() for n, p in base.model.named_parameters() if marker in n
        )
        base.adapters[key] = _Adapter(name, nbytes)
        self._evict(base, keep=key)

    def _evict(self, base: _Base, keep: str) -> None:
        """Drop what ``keep`` (just loaded) supersedes, and keep the cache within its bound
        (``evictions``)."""
        names = {r.adapter for r in self._requests.values() if r.base is base}
        in_use = {key for key, a in base.adapters.items() if a.name in names} | {keep}
        sizes = {key: a.nbytes for key, a in base.adapters.items()}
        for key in evictions(sizes, self.adapter_cache_bytes, in_use, keep):
            adapter = base.adapters.pop(key)
            assert isinstance(base.model, PeftModel)
            base.model.delete_adapter(adapter.name)
            log.info("evicted adapter %s (%d bytes) from %s", key, adapter.nbytes, base.name)

    # -- requests ------------------------------------------------------------------------------

    def add(self, ticket: int, command: bus.Sample, adapter_dir: Path | None = None) -> None:
        base = self._base(command.base_model)
        check_command(command, base.vocab_size)
        adapter = BASE_ADAPTER
        if command.adapter_key:
            key = command.adapter_key
            if key not in base.adapters:
                if adapter_dir is None:
                    raise AdapterMissing(f"the adapter {key!r} is not loaded in the sampler")
                self._load_adapter(base, key, adapter_dir)
            base.adapters.move_to_end(key)
            adapter = base.adapters[key].name
        stop_ids, stop_strs = stop_rule(command.params, base.eos_ids)
        params = command.params
        seed = params.seed if params.HasField("seed") else random.getrandbits(63)
        request = _Request(ticket, command, base, adapter, stop_ids, stop_strs, seed)
        self._requests[ticket] = request
        self._waiting.append(request)
        if command.stream_to:
            self._streamed[ticket] = request

    def has_work(self) -> bool:
        return bool(self._requests)

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
        if request in self._waiting:
            self._waiting.remove(request)
            del self._requests[ticket]
        # Otherwise its rows leave the batch at the next step, and it is forgotten then.

    def step(self) -> list[tuple[int, bytes | Exception]]:
        finished: list[tuple[int, bytes | Exception]] = []
        self._admit(finished)
        for name, batch in list(self._batches.items()):
            if not self._decode(batch, finished):
                del self._batches[name]
        for ticket, _ in finished:
            self._requests.pop(ticket, None)
        return finished

    def _admit(self, finished: list[tuple[int, bytes | Exception]]) -> None:
        """Prefill the waiting requests that fit, and merge them into their base's batch."""
        waiting, self._waiting = self._waiting, []
        rows = {name: len(batch.rows) for name, batch in self._batches.items()}
        admitted: dict[str, list[_Request]] = {}
        for request in waiting:
            name = request.base.name
            running = self._batches.get(name)
            want = request.command.num_samples
            fits = rows.get(name, 0) + want <= self.max_rows or rows.get(name, 0) == 0
            if (running is not None and not _mergeable(running.cache)) or not fits:
                self._waiting.append(request)
                continue
            rows[name] = rows.get(name, 0) + want
            admitted.setdefault(name, []).append(request)
        for name, requests in admitted.items():
            for batch in self._prefill_isolating(requests, finished):
                running = self._batches.get(name)
                self._batches[name] = batch if running is None else _merge(running, batch)

    def _prefill_isolating(
        self, requests: list[_Request], finished: list[tuple[int, bytes | Exception]]
    ) -> list[_Batch]:
        try:
            batch, done = self._prefill(requests)
        except Exception as exc:
            if len(requests) == 1:
                finished.append((requests[0].ticket, exc))
                return []
        else:
            finished.extend(done)
            return [batch] if batch else []
        # Something in the batch broke it: prefill each alone, so only the culprit fails.
        log.exception("a prefill of %d requests failed; running them one by one", len(requests))
        batches = []
        for request in requests:
            batches.extend(self._prefill_isolating([request], finished))
        return batches

    def _forward(self, base: _Base, adapters: list[str], **inputs: object) -> Any:
        """One forward of rows that may each use a different adapter (PEFT mixed batches)."""
        if isinstance(base.model, PeftModel):
            return base.model(**inputs, adapter_names=adapters)
        assert all(name == BASE_ADAPTER for name in adapters)
        return base.model(**inputs)

    @torch.inference_mode()
    def _prefill(
        self, requests: list[_Request]
    ) -> tuple[_Batch | None, list[tuple[int, bytes | Exception]]]:
        """Run the prompts once and fill in prompt logprobs. Returns a row per sequence (None when
        no request samples anything) and the requests already finished (nothing to sample)."""
        finished: list[tuple[int, bytes | Exception]] = []
        for request in requests:  # from scratch, should an earlier try have failed midway
            request.response = tp.SampleResponse()
            request.sequences = []
        base = requests[0].base
        lengths = [len(r.command.prompt) for r in requests]
        width = max(lengths)
        input_ids = torch.zeros((len(requests), width), dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        positions = torch.zeros((len(requests), width), dtype=torch.long)
        for i, request in enumerate(requests):
            pad = width - lengths[i]
            input_ids[i, pad:] = torch.tensor(list(request.command.prompt), dtype=torch.long)
            mask[i, pad:] = 1
            positions[i, pad:] = torch.arange(lengths[i])
        want_prompt = any(_wants_prompt_scores(r.command) for r in requests)
        out = self._forward(
            base,
            [r.adapter for r in requests],
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=0 if want_prompt else 1,
        )
        owners: list[int] = []
        for i, request in enumerate(requests):
            command = request.command
            if _wants_prompt_scores(command):
                _score_prompt(request, out.logits[i, width - lengths[i] :])
            if command.params.max_tokens <= 0 or command.num_samples == 0:
                finished.append((request.ticket, _response(request)))
                continue
            for n in range(command.num_samples):
                generator = torch.Generator().manual_seed(_stream_seed(request.seed, n))
                request.sequences.append(_Sequence(request, generator))
                owners.append(i)
            request.unfinished = command.num_samples
        if not owners:
            return None, finished
        index = torch.tensor(owners, dtype=torch.long)
        cache = out.past_key_values
        cache.reorder_cache(index)
        batch = _Batch(
            rows=[s for r in requests for s in r.sequences],
            cache=cache,
            mask=mask[index],
            logits=out.logits[:, -1, :].float()[index],
            positions=torch.tensor([lengths[i] for i in owners], dtype=torch.long),
        )
        return batch, finished

    @torch.inference_mode()
    def _decode(self, batch: _Batch, finished: list[tuple[int, bytes | Exception]]) -> bool:
        """Sample one token for every row, then run the rows that go on one token further.
        Returns whether any row goes on."""
        raw = torch.log_softmax(batch.logits, dim=-1)
        chosen = torch.empty(len(batch.rows), dtype=torch.long)
        by_request: dict[int, list[int]] = {}
        for p, row in enumerate(batch.rows):
            by_request.setdefault(id(row.request), []).append(p)
        for places in by_request.values():
            request = batch.rows[places[0]].request
            index = torch.tensor(places, dtype=torch.long)
            generators = [batch.rows[p].generator for p in places]
            chosen[index] = _choose(batch.logits[index], request.command.params, generators)
        chosen_lp = raw.gather(-1, chosen[:, None])[:, 0].tolist()
        widest = max(row.request.command.topk_sample_logprobs for row in batch.rows)
        top = raw.topk(widest, dim=-1) if widest else None

        keep: list[int] = []
        for p, row in enumerate(batch.rows):
            request = row.request
            if request.cancelled:
                request.unfinished -= 1
                if request.unfinished == 0:
                    self._requests.pop(request.ticket, None)
                continue
            token = int(chosen[p])
            row.tokens.append(token)
            row.logprobs.append(chosen_lp[p])
            k = request.command.topk_sample_logprobs
            if k and top is not None:
                row.topk_ids.append(top.indices[p, :k].numpy())
                row.topk_logprobs.append(top.values[p, :k].numpy())
            if token in request.stop_ids or (
                request.stop_strs
                and _ends_with_stop(request.base.tokenizer, row.tokens, request.stop_strs)
            ):
                row.stopped = True
            elif len(row.tokens) < request.command.params.max_tokens:
                keep.append(p)
                continue
            request.unfinished -= 1
            if request.unfinished == 0:
                finished.append((request.ticket, _response(request)))
        if not keep:
            return False
        if len(keep) < len(batch.rows):
            index = torch.tensor(keep, dtype=torch.long)
            batch.cache.reorder_cache(index)  # type: ignore[arg-type]
            batch.rows = [batch.rows[p] for p in keep]
            batch.mask, batch.positions = batch.mask[index], batch.positions[index]
            chosen = chosen[index]
            _trim(batch)
        batch.mask = torch.cat([batch.mask, torch.ones((len(keep), 1), dtype=torch.long)], dim=1)
        out = self._forward(
            batch.rows[0].request.base,
            [row.request.adapter for row in batch.rows],
            input_ids=chosen[:, None],
            attention_mask=batch.mask,
            position_ids=batch.positions[:, None],
            past_key_values=batch.cache,
            use_cache=True,
        )
        batch.cache = out.past_key_values
        batch.logits = out.logits[:, -1, :].float()
        batch.positions = batch.positions + 1
        return True


# --- batches -----------------------------------------------------------------------------------


def _mergeable(cache: DynamicCache) -> bool:
    """Only plain (not sliding-window) layers can be left-padded and joined."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _merge(a: _Batch, b: _Batch) -> _Batch:
    """One batch of both: the shorter cache is left-padded with masked-out columns."""
    width = max(a.mask.shape[1], b.mask.shape[1])

    def pad(x: torch.Tensor, columns: int, dim: int) -> torch.Tensor:
        missing = width - columns
        if missing == 0:
            return x
        spec = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [missing, 0]
        return F.pad(x, spec)

    ca, cb = a.mask.shape[1], b.mask.shape[1]
    layers = []
    for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
        (ka, va), (kb, vb) = _kv(la), _kv(lb)
        layers.append(
            (
                torch.cat([pad(ka, ca, -2), pad(kb, cb, -2)]),
                torch.cat([pad(va, ca, -2), pad(vb, cb, -2)]),
            )
        )
    return _Batch(
        rows=a.rows + b.rows,
        cache=DynamicCache(ddp_cache_data=layers),
        mask=torch.cat([pad(a.mask, ca, -1), pad(b.mask, cb, -1)]),
        logits=torch.cat([a.logits, b.logits]),
        positions=torch.cat([a.positions, b.positions]),
    )


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
    prompt = torch.tensor(list(command.prompt), dtype=torch.long)
    raw = torch.log_softmax(logits.float(), dim=-1)
    start = prompt_window(command)
    length = len(prompt)
    if command.prompt_logprobs:
        values = np.full(length, np.nan, dtype="<f4")
        if start < length:
            values[start:] = raw[start - 1 : -1].gather(-1, prompt[start:, None])[:, 0].numpy()
        request.response.prompt_logprobs = values.tobytes()
    k = command.topk_prompt_logprobs
    if k:
        ids, lps = empty_topk(length, k)
        if start < length:
            top = raw[start - 1 : -1].topk(k, dim=-1)
            ids[start:], lps[start:] = top.indices.numpy(), top.values.numpy()
        request.response.topk_prompt_logprobs.CopyFrom(topk_message(ids, lps))
    if command.HasField("target_prompt_logprobs"):
        rows, _, targets = target_cells(command)
        values = np.zeros(len(targets), dtype="<f4")
        asked = targets >= 0
        index = torch.from_numpy(rows[asked]), torch.from_numpy(targets[asked])
        values[asked] = raw[index].numpy()
        request.response.target_prompt_logprobs.CopyFrom(target_message(command, values))
    k = command.prompt_alt_tokens_k
    if k:
        # Draws with replacement at the request's temperature (0: the most likely token), from
        # a generator of their own, seeded from the request's seed.
        table = raw[:-1]
        if command.params.temperature == 0:
            drawn = table.argmax(-1, keepdim=True).expand(-1, k)
        else:
            probs = torch.softmax(logits[:-1].float() / command.params.temperature, dim=-1)
            generator = torch.Generator().manual_seed(_stream_seed(request.seed, _ALT_STREAM))
            drawn = (
                torch.multinomial(probs, k, replacement=True, generator=generator)
                if len(probs)
                else torch.zeros((0, k), dtype=torch.long)
            )
        chosen = table.gather(-1, drawn)
        request.response.prompt_alt_tokens.CopyFrom(
            alt_tokens_message(drawn.numpy(), chosen.numpy())
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


def _choose(
    logits: torch.Tensor, params: tp.SamplingParams, generators: list[torch.Generator]
) -> torch.Tensor:
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    scaled = logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    if params.top_p < 1.0:
        ordered, order = torch.sort(scaled, descending=True, dim=-1)
        probs = torch.softmax(ordered, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        ordered = ordered.masked_fill(drop, -math.inf)
        scaled = torch.full_like(scaled, -math.inf).scatter(-1, order, ordered)
    probs = torch.softmax(scaled, dim=-1)
    picks = [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)]
    return torch.cat(picks)
