"""The sampler's torch engine: a base model per name, any run's LoRA adapter on top, and
KV-cached decoding that samples many requests as one batch.

A batch mixes prompt lengths (left-padded, with an attention mask and each row's own positions),
adapters (PEFT's mixed-adapter forward: one adapter name per row, ``__base__`` for none) and
sampling parameters. The prompts are prefilled once, each request's prompt cache is copied to its
``num_samples`` rows, and all rows decode together; a finished row leaves the batch. Each
sequence has its own generator, so what a seeded request samples does not depend on what else is
in the batch.

Owns: every torch call of the sampler (on the process's one compute thread), the sampling rules
(temperature, top-k, top-p, seed, stop strings, stop token ids, end-of-sequence) and prompt
logprobs. Does not own: fetching adapters from the object store or the bus (handlers.py).

Logprobs are the model's raw log-probabilities (before temperature, top-k or top-p), which is
what the trainer's forward computes, so RL importance ratios compare like with like.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import PeftModel
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, PreTrainedModel

from tinsmith import models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest, NotFound

log = logging.getLogger(__name__)

MAX_ADAPTERS = 32
# PEFT's name for "no adapter" in a mixed-adapter batch.
BASE_ADAPTER = "__base__"


@dataclass
class _Base:
    model: PreTrainedModel | PeftModel
    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    adapters: OrderedDict[str, str]  # adapter key -> PEFT adapter name, least recent first


class SamplerEngine:
    def __init__(self, cache_dir: Path, threads: int = 1) -> None:
        self.cache_dir = cache_dir
        self.threads = threads
        self.bases: dict[str, _Base] = {}

    def init_compute_thread(self) -> None:
        """Run on the compute thread before any work: torch's thread count is per thread."""
        torch.set_num_threads(self.threads)

    def _base(self, name: str) -> _Base:
        base = self.bases.get(name)
        if base is None:
            directory = models.materialize(name, self.cache_dir)
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
            model.requires_grad_(False)
            model.eval()  # type: ignore[no-untyped-call]
            config = json.loads((directory / "config.json").read_text())
            eos = config.get("eos_token_id")
            eos_ids = frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else [])
            tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
            base = self.bases[name] = _Base(model, tokenizer, eos_ids, OrderedDict())
        return base

    def has_adapter(self, base_model: str, key: str) -> bool:
        return key in self._base(base_model).adapters

    def load_adapter(self, base_model: str, key: str, directory: Path) -> None:
        """Make the PEFT adapter in ``directory`` available under its object-store ``key``."""
        base = self._base(base_model)
        if key in base.adapters:
            base.adapters.move_to_end(key)
            return
        name = f"a{len(base.adapters)}_{abs(hash(key)) % 10**12}"
        if isinstance(base.model, PeftModel):
            base.model.load_adapter(str(directory), adapter_name=name)
        else:
            base.model = PeftModel.from_pretrained(base.model, str(directory), adapter_name=name)
        base.model.eval()
        base.adapters[key] = name
        while len(base.adapters) > MAX_ADAPTERS:
            _, evicted = base.adapters.popitem(last=False)
            assert isinstance(base.model, PeftModel)
            base.model.delete_adapter(evicted)

    def _adapter_name(self, base: _Base, command: bus.Sample) -> str:
        if not command.adapter_key:
            return BASE_ADAPTER
        name = base.adapters.get(command.adapter_key)
        if name is None:
            raise NotFound(f"the adapter {command.adapter_key!r} is not loaded in the sampler")
        return name

    def _check(self, base: _Base, command: bus.Sample) -> None:
        """Refuse a request this batch cannot run, before it can spoil the others."""
        self._adapter_name(base, command)
        if not command.prompt:
            raise InvalidRequest("the prompt is empty")
        embeddings = base.model.get_input_embeddings()
        assert isinstance(embeddings, torch.nn.Embedding)
        vocab = embeddings.num_embeddings
        if min(command.prompt) < 0 or max(command.prompt) >= vocab:
            raise InvalidRequest(f"a prompt token is outside the vocabulary [0, {vocab})")
        if command.num_samples < 0:
            raise InvalidRequest("num_samples must not be negative")

    def _forward(self, base: _Base, adapter_names: list[str], **inputs: object) -> Any:
        """One forward of rows that may each use a different adapter (PEFT mixed batches)."""
        model = base.model
        if isinstance(model, PeftModel):
            return model(**inputs, adapter_names=adapter_names)
        assert all(name == BASE_ADAPTER for name in adapter_names)
        return model(**inputs)

    def sample(self, command: bus.Sample) -> bytes:
        """Run one request; return a serialized ``SampleResponse``."""
        outcome = self.sample_batch([command])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def sample_batch(self, commands: Sequence[bus.Sample]) -> list[bytes | Exception]:
        """Run requests together, one batch per base model; return each one's serialized
        ``SampleResponse``, or the exception that failed it (one request never fails another)."""
        outcomes: list[bytes | Exception | None] = [None] * len(commands)
        by_base: dict[str, list[int]] = {}
        for i, command in enumerate(commands):
            by_base.setdefault(command.base_model, []).append(i)
        for name, indices in by_base.items():
            try:
                base = self._base(name)
            except Exception as exc:
                for i in indices:
                    outcomes[i] = exc
                continue
            runnable = []
            for i in indices:
                try:
                    self._check(base, commands[i])
                except Exception as exc:
                    outcomes[i] = exc
                else:
                    runnable.append(i)
            if not runnable:
                continue
            try:
                results = self._run(base, [commands[i] for i in runnable])
            except Exception as exc:
                if len(runnable) == 1:
                    outcomes[runnable[0]] = exc
                    continue
                # Something in the batch broke it: run each alone, so only the culprit fails.
                log.exception(
                    "a batch of %d requests failed; running them one by one", len(runnable)
                )
                for i in runnable:
                    try:
                        outcomes[i] = self._run(base, [commands[i]])[0]
                    except Exception as single:
                        outcomes[i] = single
            else:
                for i, result in zip(runnable, results, strict=True):
                    outcomes[i] = result
        assert all(outcome is not None for outcome in outcomes)
        return [outcome for outcome in outcomes if outcome is not None]

    @torch.inference_mode()
    def _run(self, base: _Base, commands: list[bus.Sample]) -> list[bytes]:
        """Sample every sequence of every request as one batch: the prompts left-padded and
        prefilled once, each request's prompt cache copied to its ``num_samples`` rows, then
        KV-cached decoding of all rows together; finished rows leave the batch."""
        names = [self._adapter_name(base, command) for command in commands]
        lengths = [len(command.prompt) for command in commands]
        width = max(lengths)
        count = len(commands)
        input_ids = torch.zeros((count, width), dtype=torch.long)
        mask = torch.zeros((count, width), dtype=torch.long)
        positions = torch.zeros((count, width), dtype=torch.long)
        for r, command in enumerate(commands):
            pad = width - lengths[r]
            input_ids[r, pad:] = torch.tensor(list(command.prompt), dtype=torch.long)
            mask[r, pad:] = 1
            positions[r, pad:] = torch.arange(lengths[r])
        want_prompt = any(command.prompt_logprobs for command in commands)
        out = self._forward(
            base,
            names,
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=0 if want_prompt else 1,
        )
        responses = [tp.SampleResponse() for _ in commands]
        for r, command in enumerate(commands):
            if command.prompt_logprobs:
                row = out.logits[r, width - lengths[r] :]
                responses[r].prompt_logprobs = _prompt_logprobs(row, command).tobytes()

        # One row per sequence. One generator per sequence, seeded from (seed, index), so
        # sequence i of a seeded request is the same whatever num_samples is and whatever else
        # is in the batch.
        owner: list[int] = []
        generators: list[torch.Generator] = []
        for r, command in enumerate(commands):
            params = command.params
            seed = params.seed if params.HasField("seed") else random.getrandbits(63)
            for i in range(command.num_samples):
                owner.append(r)
                generators.append(torch.Generator().manual_seed(_stream_seed(seed, i)))
        stops = [_stops(command.params, base.eos_ids) for command in commands]
        tokens: list[list[int]] = [[] for _ in owner]
        logprobs: list[list[float]] = [[] for _ in owner]
        stopped = [False] * len(owner)
        # The rows still decoding; the tensors below are aligned with it.
        active = [j for j, r in enumerate(owner) if commands[r].params.max_tokens > 0]
        if active:
            rows = torch.tensor([owner[j] for j in active], dtype=torch.long)
            cache = out.past_key_values
            cache.reorder_cache(rows)
            logits = out.logits[:, -1, :].float()[rows]
            mask = mask[rows]
            next_position = torch.tensor([lengths[owner[j]] for j in active], dtype=torch.long)
        while active:
            raw = torch.log_softmax(logits, dim=-1)
            chosen = torch.empty(len(active), dtype=torch.long)
            by_request: dict[int, list[int]] = {}
            for p, j in enumerate(active):
                by_request.setdefault(owner[j], []).append(p)
            for r, places in by_request.items():
                index = torch.tensor(places, dtype=torch.long)
                chosen[index] = _choose(
                    logits[index], commands[r].params, [generators[active[p]] for p in places]
                )
            chosen_lp = raw.gather(-1, chosen[:, None])[:, 0]
            keep: list[int] = []
            for p, j in enumerate(active):
                token = int(chosen[p])
                tokens[j].append(token)
                logprobs[j].append(float(chosen_lp[p]))
                stop_ids, stop_strs = stops[owner[j]]
                if token in stop_ids or (
                    stop_strs and _ends_with_stop(base.tokenizer, tokens[j], stop_strs)
                ):
                    stopped[j] = True
                elif len(tokens[j]) < commands[owner[j]].params.max_tokens:
                    keep.append(p)
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep, dtype=torch.long)
                cache.reorder_cache(index)
                mask, chosen, next_position = mask[index], chosen[index], next_position[index]
                active = [active[p] for p in keep]
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=torch.long)], dim=1)
            out = self._forward(
                base,
                [names[owner[j]] for j in active],
                input_ids=chosen[:, None],
                attention_mask=mask,
                position_ids=next_position[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
            next_position = next_position + 1
        for j, r in enumerate(owner):
            responses[r].sequences.add(
                stop_reason=tp.STOP_REASON_STOP if stopped[j] else tp.STOP_REASON_LENGTH,
                tokens=np.asarray(tokens[j], "<i4").tobytes(),
                logprobs=np.asarray(logprobs[j], "<f4").tobytes(),
            )
        return [response.SerializeToString() for response in responses]


def _prompt_logprobs(logits: torch.Tensor, command: bus.Sample) -> np.ndarray:
    """logprob of prompt[i] given prompt[:i]; NaN at position 0 and before the last-n window."""
    prompt = torch.tensor(list(command.prompt), dtype=torch.long)
    raw = torch.log_softmax(logits.float(), dim=-1)
    values = np.full(len(prompt), np.nan, dtype="<f4")
    if len(prompt) > 1:
        values[1:] = raw[:-1].gather(-1, prompt[1:, None])[:, 0].numpy()
    if command.HasField("prompt_logprobs_last_n"):
        values[: max(0, len(prompt) - command.prompt_logprobs_last_n)] = np.nan
    return values


def _stops(params: tp.SamplingParams, eos_ids: frozenset[int]) -> tuple[frozenset[int], list[str]]:
    """Stop token ids replace end-of-sequence (so ``[]`` runs to max_tokens); stop strings add
    to it; no stop at all means end-of-sequence."""
    kind = params.WhichOneof("stop")
    if kind == "stop_tokens":
        return frozenset(params.stop_tokens.values), []
    if kind == "stop_strs":
        return eos_ids, list(params.stop_strs.values)
    return eos_ids, []


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
