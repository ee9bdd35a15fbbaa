"""The sampler's torch engine: a base model per name, any run's LoRA adapter on top, and
KV-cached decoding that samples all of a request's sequences as one batch.

Owns: every torch call of the sampler (on the process's one compute thread), the sampling rules
(temperature, top-k, top-p, seed, stop strings, stop token ids, end-of-sequence) and prompt
logprobs. Does not own: fetching adapters from the object store or the bus (handlers.py).

Logprobs are the model's raw log-probabilities (before temperature, top-k or top-p), which is
what the trainer's forward computes, so RL importance ratios compare like with like.
"""

from __future__ import annotations

import json
import math
import random
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from peft import PeftModel
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, PreTrainedModel

from tinsmith import models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp

MAX_ADAPTERS = 32


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

    def _forward(self, base: _Base, adapter_key: str, **inputs: object) -> object:
        model = base.model
        if not adapter_key:
            if isinstance(model, PeftModel):
                with model.disable_adapter():
                    return model(**inputs)
            return model(**inputs)
        assert isinstance(model, PeftModel)
        model.set_adapter(base.adapters[adapter_key])
        return model(**inputs)

    @torch.inference_mode()
    def sample(self, command: bus.Sample) -> bytes:
        """Run one request; return a serialized ``SampleResponse``."""
        base = self._base(command.base_model)
        params = command.params
        prompt = torch.tensor([list(command.prompt)], dtype=torch.long)
        n = command.num_samples
        out = self._forward(base, command.adapter_key, input_ids=prompt, use_cache=True)
        response = tp.SampleResponse()
        if command.prompt_logprobs:
            response.prompt_logprobs = _prompt_logprobs(out.logits[0], command).tobytes()  # type: ignore[attr-defined]

        seed = params.seed if params.HasField("seed") else random.getrandbits(63)
        # One generator per sequence, so sequence i of a seeded request is the same whatever
        # num_samples is.
        generators = [torch.Generator().manual_seed(_stream_seed(seed, i)) for i in range(n)]
        cache = out.past_key_values  # type: ignore[attr-defined]
        cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1, :].float().expand(n, -1)  # type: ignore[attr-defined]
        stop_ids, stop_strs = _stops(params, base.eos_ids)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        stopped = [False] * n
        position = prompt.shape[1]
        for step in range(params.max_tokens):
            raw = torch.log_softmax(logits, dim=-1)
            chosen = _choose(logits, params, generators)
            chosen_lp = raw.gather(-1, chosen[:, None])[:, 0]
            for i in range(n):
                if stopped[i]:
                    continue
                token = int(chosen[i])
                tokens[i].append(token)
                logprobs[i].append(float(chosen_lp[i]))
                if token in stop_ids or (
                    stop_strs and _ends_with_stop(base.tokenizer, tokens[i], stop_strs)
                ):
                    stopped[i] = True
            if all(stopped) or step == params.max_tokens - 1:
                break
            out = self._forward(
                base,
                command.adapter_key,
                input_ids=chosen[:, None],
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.full((n, 1), position, dtype=torch.long),
            )
            cache = out.past_key_values  # type: ignore[attr-defined]
            logits = out.logits[:, -1, :].float()  # type: ignore[attr-defined]
            position += 1
        for i in range(n):
            response.sequences.add(
                stop_reason=tp.STOP_REASON_STOP if stopped[i] else tp.STOP_REASON_LENGTH,
                tokens=np.asarray(tokens[i], "<i4").tobytes(),
                logprobs=np.asarray(logprobs[i], "<f4").tobytes(),
            )
        return response.SerializeToString()


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
