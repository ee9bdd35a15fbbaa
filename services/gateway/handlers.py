"""The Tinker operations, as the gateway performs them: validate, append to the log, answer.

Owns: what each Tinker call means in terms of events and commands, the validation that lets a
bad request fail at once with a clear 400/404 instead of inside a future, and the futures
(``retrieve_future`` long-polls the projection of the log). Does not own: HTTP (http.py), the
JSON/proto shapes of requests (wire.py) or any compute.

The gateway holds no state that the log cannot rebuild, so any number of replicas can run. The
one exception is in flight only: the tokens of a streamed sample request come from the sampler
to the gateway replica that accepted it (``stream_id``), for the call that waits there.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from tinsmith import artifacts, events, jobs, limits, losses, models, subjects, telemetry
from tinsmith import lora as lora_layout
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.bus import MAX_BODY_BYTES
from tinsmith.eventlog import EventLog, FollowedProjection
from tinsmith.failures import (
    InternalError,
    InvalidRequest,
    NotFound,
    Overloaded,
    TinsmithError,
    TooLarge,
    from_kind,
    future_failure,
)
from tinsmith.limits import INT32_MAX, MAX_NUM_SAMPLES, MAX_TOPK_LOGPROBS, TTL_MAX_S, mib
from tinsmith.tensors import decode_tensor, model_input_tokens

from . import wire
from .config import GatewayConfig

log = logging.getLogger(__name__)

JsonDict = dict[str, Any]
Command = Callable[[], dict[str, Any] | Awaitable[dict[str, Any]]]


class Gateway:
    def __init__(self, config: GatewayConfig, eventlog: EventLog) -> None:
        self.config = config
        self.log = eventlog
        self.projection = FollowedProjection(eventlog)
        # This replica, as streamed sample requests name it (bus.Sample.stream_to), and the
        # calls waiting for each such request's tokens.
        self.stream_id = uuid.uuid4().hex
        self._watchers: dict[str, list[asyncio.Queue[bus.SampleProgress]]] = {}

    @property
    def state(self) -> jobs.Projection:
        return self.projection.state

    async def start(self) -> None:
        await self.projection.start()
        await self.log.bus.listen(subjects.sample_stream_subject(self.stream_id), self._progress)
        telemetry.observe(
            "tinsmith.queue.depth",
            lambda: {
                (("tinsmith.queue", "sampler"),): float(self.state.pending_samples),
                (("tinsmith.queue", "trainer"),): float(self.state.pending_training),
            },
            unit="{request}",
            description="Requests accepted into the log and not yet settled, by the queue that "
            "holds them (as the gateway's view of the log has it)",
        )

    # -- bootstrap and sessions ----------------------------------------------------------------

    def client_config(self) -> JsonDict:
        return {
            "pjwt_auth_enabled": False,
            "parallel_fwdbwd_chunks": True,
            "proto_compress_fwdbwd": False,
            # Chunks must fit a NATS message with its envelope (8 MB max payload).
            "fwdbwd_max_chunk_bytes_count": self.config.max_chunk_bytes,
            "fwdbwd_max_chunk_len": 1024,
            "custom_loss_server_side": False,
            "sample_use_retrieve_futures": False,
            "sample_join_sampling_session": False,
        }

    def server_capabilities(self) -> JsonDict:
        return {
            "supported_models": [
                {
                    "model_name": spec.name,
                    "max_context_length": spec.max_context_length,
                    "trainable": True,
                    "sampleable": True,
                }
                for spec in models.registry().values()
            ]
        }

    async def create_session(self, body: JsonDict, owner: str = "") -> JsonDict:
        session_id = str(uuid.uuid4())
        created = bus.SessionCreated(
            session_id=session_id,
            owner=owner,
            tags=wire.str_list(body, "tags"),
            user_metadata=wire.str_map(body, "user_metadata"),
            project_id=wire.text(body, "project_id"),
            display_name=wire.opt_str(body, "display_name") or "",
            sdk_version=wire.opt_str(body, "sdk_version") or "",
        )
        wire.check_metadata(
            self.config.limits.max_metadata_bytes,
            created.tags,
            dict(created.user_metadata),
            created.project_id,
            created.display_name,
            created.sdk_version,
        )
        await self._append(events.make(session_created=created), aggregate="session")
        return {"type": "create_session", "session_id": session_id}

    async def heartbeat(self, body: JsonDict) -> JsonDict:
        session = self._session(wire.req_str(body, "session_id"))
        await self.log.bus.notify(subjects.SESSION_HEARTBEATS, session.session_id.encode())
        return {"type": "session_heartbeat"}

    async def finish_session(self, session_id: str, body: JsonDict) -> JsonDict:
        session = self._session(session_id)
        reason = body.get("reason") or {}
        if not isinstance(reason, dict) or not isinstance(reason.get("type", ""), str):
            raise InvalidRequest("field 'reason' must be an object like {'type': 'success'}")
        finished = bus.SessionFinished(
            session_id=session.session_id,
            reason=reason.get("type", ""),
            detail=wire.opt_str(body, "detail") or "",
        )
        wire.check_metadata(self.config.limits.max_metadata_bytes, finished.reason, finished.detail)
        await self._append(events.make(session_finished=finished), aggregate="session")
        return {}

    # -- training ------------------------------------------------------------------------------

    async def create_model(self, body: JsonDict) -> JsonDict:
        session, model_id, future = self._new_run(body)
        if future:
            return future
        spec = models.get(wire.req_str(body, "base_model"))
        lora = wire.lora_config(body.get("lora_config"), self.config.limits.max_lora_rank)
        lora_layout.target_modules(
            spec.arch, attn=lora.train_attn, mlp=lora.train_mlp, unembed=lora.train_unembed
        )
        optimizer = body.get("optimizer_config") or {"type": "adamw"}
        family = optimizer.get("type", "adamw") if isinstance(optimizer, dict) else None
        if family != "adamw":
            raise InvalidRequest(
                f"optimizer_config type {family!r} is not supported; accepted: 'adamw'"
            )
        command = bus.CreateModel(
            session_id=session.session_id,
            base_model=spec.name,
            lora=lora,
            optimizer="adamw",
            user_metadata=self._user_metadata(body),
        )
        return await self._accept_new_run(model_id, command)

    async def load_weights(self, body: JsonDict) -> JsonDict:
        """Two forms: create a run from a checkpoint (``session_id`` + ``model_seq_id``, sent by
        ``create_training_client_from_state*``), or load one into a run (``model_id`` +
        ``seq_id``, sent by the deprecated ``TrainingClient.load_state*``)."""
        path = wire.req_str(body, "path")
        with_optimizer = bool(body.get("optimizer", False))
        if body.get("model_id"):
            run = self._run(wire.req_str(body, "model_id"))
            seq_id = wire.req_int(body, "seq_id", minimum=1, maximum=INT32_MAX)

            async def load() -> dict[str, Any]:
                checkpoint = await self._loadable(path, with_optimizer, run.base_model)
                if checkpoint.lora_rank != run.lora_rank:
                    raise InvalidRequest(
                        f"{path} has LoRA rank {checkpoint.lora_rank}, the run has rank "
                        f"{run.lora_rank}; create a new client from it instead"
                    )
                command = bus.LoadWeights(
                    path=path, blob_key=checkpoint.blob_key, optimizer=with_optimizer
                )
                return {"load_weights": command}

            return await self._submit(run, seq_id, load)
        session, model_id, future = self._new_run(body)
        if future:
            return future
        base_model = wire.opt_str(body, "base_model")
        checkpoint = await self._loadable(path, with_optimizer, base_model)
        lora = bus.LoraConfig()
        if checkpoint.HasField("lora"):
            lora.CopyFrom(checkpoint.lora)
        else:
            lora.MergeFrom(bus.LoraConfig(train_mlp=True, train_attn=True, train_unembed=True))
        lora.rank = checkpoint.lora_rank
        command = bus.CreateModel(
            session_id=session.session_id,
            base_model=checkpoint.base_model,
            lora=lora,
            optimizer="adamw",
            user_metadata=self._user_metadata(body) or dict(checkpoint.user_metadata),
            load_key=checkpoint.blob_key,
            load_optimizer=with_optimizer,
            load_path=path,
        )
        return await self._accept_new_run(model_id, command)

    async def _loadable(
        self, path: str, with_optimizer: bool, base_model: str | None
    ) -> bus.WeightsSaved:
        checkpoint = await self._resolve(path)
        if with_optimizer and checkpoint.kind != bus.CHECKPOINT_KIND_TRAINING:
            raise InvalidRequest(
                f"{path} holds sampler weights only; loading with the optimizer needs a "
                "training checkpoint (tinker://<run>/weights/<name>, from save_state)"
            )
        if base_model and models.get(base_model).name != checkpoint.base_model:
            raise InvalidRequest(f"{path} was trained on {checkpoint.base_model}, not {base_model}")
        return checkpoint

    def get_info(self, body: JsonDict) -> JsonDict:
        run = self._run(wire.req_str(body, "model_id"))
        spec = models.get(run.base_model)
        return {
            "type": "get_info",
            "model_id": run.model_id,
            "model_data": {
                "arch": spec.arch,
                "model_name": run.base_model,
                "tokenizer_id": run.tokenizer_id or run.base_model,
            },
            "is_lora": True,
            "lora_rank": run.lora_rank,
            "model_name": run.base_model,
            "optimizer_config": {"type": "adamw"},
        }

    async def forward_backward(self, payload: bytes) -> JsonDict:
        request = tp.ForwardBackwardRequest()
        try:
            request.ParseFromString(payload)
        except Exception as exc:
            raise InvalidRequest(
                "the body is not a valid tinker ForwardBackwardRequest protobuf message"
            ) from exc
        run = self._run(request.model_id)
        if request.seq_id < 1:
            raise InvalidRequest(f"seq_id must be >= 1 for forward_backward, got {request.seq_id}")
        request.model_id = run.model_id

        def command() -> dict[str, Any]:
            self._check_forward_backward(run, request)
            return {"forward_backward": request}

        return await self._submit(run, request.seq_id, command)

    def _check_forward_backward(
        self, run: jobs.RunState, request: tp.ForwardBackwardRequest
    ) -> None:
        losses.resolve_config(request.loss_fn, losses.config_of(request))
        if not request.data:
            raise InvalidRequest("forward_backward needs at least one datum")
        spec = models.get(run.base_model)
        lengths = []
        for i, datum in enumerate(request.data):
            tokens = model_input_tokens(datum.model_input)
            n = len(tokens)
            lengths.append(n)
            if n == 0:
                raise InvalidRequest(f"datum {i} has an empty model_input")
            if n > spec.max_context_length:
                raise InvalidRequest(
                    f"datum {i} has {n} tokens; {run.base_model} accepts at most "
                    f"{spec.max_context_length}"
                )
            wire.check_vocab(tokens, spec.vocab_size, f"datum {i} model_input")
            inputs = {
                name: decode_tensor(tensor, f"datum {i} loss_fn_inputs[{name!r}]")
                for name, tensor in datum.loss_fn_inputs.items()
            }
            losses.check_inputs(request.loss_fn, inputs, n, i)
            wire.check_vocab(inputs["target_tokens"], spec.vocab_size, f"datum {i} target_tokens")
        self._check_train_memory(spec, lengths, backward=not request.forward_only)

    def _check_train_memory(
        self, spec: models.ModelSpec, lengths: list[int], *, backward: bool
    ) -> None:
        """Refuse a request whose activations would not fit the trainer's memory budget."""
        budget = self.config.limits.train_memory_mb << 20
        need = limits.train_bytes(spec.shape, spec.vocab_size, lengths, backward=backward)
        if need <= budget:
            return
        per_token = limits.train_bytes(spec.shape, spec.vocab_size, [1], backward=backward)
        op = "forward_backward" if backward else "forward"
        raise InvalidRequest(
            f"this {op} needs about {mib(need)} of activation memory ({sum(lengths)} tokens in "
            f"{len(lengths)} datums of {spec.name}); the trainer's budget for one request is "
            f"{mib(budget)} (TINSMITH_TRAIN_MEMORY_MB), about {budget // per_token} tokens of "
            "this model: send fewer or shorter datums per call"
        )

    async def optim_step(self, body: JsonDict) -> JsonDict:
        run = self._run(wire.req_str(body, "model_id"))
        seq_id = wire.req_int(body, "seq_id", minimum=1, maximum=INT32_MAX)
        return await self._submit(
            run,
            seq_id,
            lambda: {"optim_step": bus.OptimStep(adam=wire.adam_params(body.get("adam_params")))},
        )

    async def save_weights(
        self, body: JsonDict, *, for_sampler: bool = False, external: bool = False
    ) -> JsonDict:
        run = self._run(wire.req_str(body, "model_id"))
        seq_id = wire.req_int(body, "seq_id", minimum=1, maximum=INT32_MAX)
        if external:
            kind = bus.CHECKPOINT_KIND_EXTERNAL
        else:
            kind = bus.CHECKPOINT_KIND_SAMPLER if for_sampler else bus.CHECKPOINT_KIND_TRAINING
        return await self._submit(
            run, seq_id, lambda: {"save_weights": self._save_command(run, body, kind, seq_id)}
        )

    def _save_command(
        self, run: jobs.RunState, body: JsonDict, kind: bus.CheckpointKind, seq_id: int
    ) -> bus.SaveWeights:
        name = wire.opt_str(body, "path")
        for_sampler = kind == bus.CHECKPOINT_KIND_SAMPLER
        if kind == bus.CHECKPOINT_KIND_EXTERNAL and body.get("age_encryption_recipients"):
            raise InvalidRequest(
                "age_encryption_recipients is not supported: external weights are stored "
                "unencrypted; leave it out"
            )
        command = bus.SaveWeights(kind=kind, user_metadata=self._user_metadata(body))
        ttl = body.get("ttl_seconds")
        if ttl is not None:
            command.ttl_seconds = wire.req_int(body, "ttl_seconds", minimum=1, maximum=TTL_MAX_S)
        if name:
            command.name = artifacts.check_name(name)
            path = artifacts.TinkerPath(run.model_id, command.kind, command.name)
            if str(path) in self.state.checkpoints:
                if not body.get("overwrite", False):
                    raise InvalidRequest(f"checkpoint {path} already exists; pass overwrite=True")
                command.blob_key = path.overwrite_key(seq_id)  # never rewritten in place
        elif for_sampler:
            counter = wire.req_int(body, "sampling_session_seq_id", minimum=0, maximum=INT32_MAX)
            command.sampler_id = subjects.check_id(
                "sampler id", f"{run.session_id}:sample:{counter}"
            )
        else:
            raise InvalidRequest("save_weights needs a checkpoint name in 'path'")
        return command

    # -- sampling ------------------------------------------------------------------------------

    async def create_sampling_session(self, body: JsonDict) -> JsonDict:
        session = self._session(wire.req_str(body, "session_id"))
        counter = wire.req_int(body, "sampling_session_seq_id", minimum=0, maximum=INT32_MAX)
        sampler_id = subjects.check_id("sampler id", f"{session.session_id}:sample:{counter}")
        if sampler_id in self.state.samplers:
            return {"type": "create_sampling_session", "sampling_session_id": sampler_id}
        model_path = wire.opt_str(body, "model_path")
        base_model = wire.opt_str(body, "base_model")
        created = bus.SamplerCreated(sampler_id=sampler_id, session_id=session.session_id)
        if model_path:
            checkpoint = await self._resolve(model_path)
            if base_model and models.get(base_model).name != checkpoint.base_model:
                raise InvalidRequest(
                    f"{model_path} was trained on {checkpoint.base_model}, not {base_model}"
                )
            created.base_model = checkpoint.base_model
            created.model_path = model_path
            created.adapter_key = checkpoint.blob_key
        elif base_model:
            created.base_model = models.get(base_model).name
        else:
            raise InvalidRequest("create_sampling_session needs base_model or model_path")
        await self._append(events.make(sampler_created=created), aggregate="sampler")
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def get_sampler(self, sampler_id: str) -> JsonDict:
        sampler = self._sampler(sampler_id)
        return {
            "sampler_id": sampler.sampler_id,
            "base_model": sampler.base_model,
            "model_path": sampler.model_path or None,
        }

    async def asample(self, body: JsonDict, *, stream: bool = False) -> JsonDict:
        """Accept a sample request. With ``stream``, the sampler sends its tokens to this replica
        as they are generated (for ``watch``); a repeat of a request accepted before keeps how
        that one was accepted."""
        sampler = self._sampler(wire.req_str(body, "sampling_session_id"))
        seq_id = wire.req_int(body, "seq_id", minimum=0, maximum=limits.INT64_MAX)
        request_id = events.request_id(sampler.sampler_id, seq_id)
        command = self._sample_command(sampler, body)
        if stream:
            command.stream_to = self.stream_id
        sequence_ids = [f"{request_id}:{i}" for i in range(command.num_samples)]
        if request_id not in self.state.requests:
            queued = self.state.pending_samples
            if queued >= self.config.sampler_queue_limit:
                raise Overloaded(
                    f"the sampling queue is full ({queued} requests waiting, the bound is "
                    f"{self.config.sampler_queue_limit}); send it again later"
                )
            accepted = bus.RequestAccepted(
                request_id=request_id,
                aggregate_id=sampler.sampler_id,
                seq_id=seq_id,
                sample=command,
            )
            await self._accept(accepted, aggregate="sampler")
        return {"request_id": request_id, "sample_sequence_ids": sequence_ids}

    def _sample_command(self, sampler: jobs.SamplerState, body: JsonDict) -> bus.Sample:
        spec = models.get(sampler.base_model)
        prompt = wire.model_input(body.get("prompt"))
        if not prompt:
            raise InvalidRequest("prompt must contain at least one token")
        wire.check_vocab(prompt, spec.vocab_size, "prompt")
        params = wire.sampling_params(body.get("sampling_params"), spec.vocab_size)
        num_samples = wire.req_int(
            body, "num_samples", minimum=1, default=1, maximum=MAX_NUM_SAMPLES
        )
        if len(prompt) + params.max_tokens > spec.max_context_length:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"context length of {spec.name} ({spec.max_context_length})"
            )
        command = bus.Sample(
            base_model=sampler.base_model,
            adapter_key=sampler.adapter_key,
            prompt=[int(t) for t in prompt],
            params=params,
            num_samples=num_samples,
            prompt_logprobs=bool(body.get("prompt_logprobs", False)),
            topk_prompt_logprobs=wire.req_int(
                body, "topk_prompt_logprobs", minimum=0, maximum=MAX_TOPK_LOGPROBS, default=0
            ),
            topk_sample_logprobs=wire.req_int(
                body, "topk_sample_logprobs", minimum=0, maximum=MAX_TOPK_LOGPROBS, default=0
            ),
            prompt_alt_tokens_k=wire.req_int(
                body, "prompt_alt_tokens_k", minimum=0, maximum=MAX_TOPK_LOGPROBS, default=0
            ),
        )
        targets = body.get("target_prompt_logprobs")
        if targets is not None:
            command.target_prompt_logprobs.CopyFrom(
                wire.target_prompt_logprobs(targets, len(prompt), spec.vocab_size)
            )
        last_n = body.get("prompt_logprobs_last_n")
        if last_n is not None:
            command.prompt_logprobs_last_n = wire.req_int(
                body, "prompt_logprobs_last_n", minimum=0, maximum=INT32_MAX
            )
        self._check_sample_cost(spec, command)
        return command

    def _check_sample_cost(self, spec: models.ModelSpec, command: bus.Sample) -> None:
        """Refuse a sample request that would take more of the sampler than one request may,
        or whose result could not be stored, before it is accepted."""
        bounds = self.config.limits
        prompt, max_tokens = len(command.prompt), command.params.max_tokens
        n = command.num_samples
        tokens = n * (prompt + max_tokens)
        if tokens > bounds.sample_max_tokens:
            raise InvalidRequest(
                f"num_samples x (prompt + max_tokens) is {n} x ({prompt} + {max_tokens}) = "
                f"{tokens} tokens; one sample request may ask for at most "
                f"{bounds.sample_max_tokens} (TINSMITH_SAMPLE_MAX_TOKENS): ask for fewer samples "
                "or tokens, or send several requests"
            )
        wants_prompt = (
            command.prompt_logprobs
            or command.topk_prompt_logprobs > 0
            or command.prompt_alt_tokens_k > 0
            or command.HasField("target_prompt_logprobs")
        )
        memory = limits.sample_bytes(
            spec.shape,
            spec.vocab_size,
            prompt=prompt,
            max_tokens=max_tokens,
            num_samples=n,
            prompt_scores=wants_prompt,
        )
        budget = bounds.sample_memory_mb << 20
        if memory > budget:
            raise InvalidRequest(
                f"this sample request needs about {mib(memory)} of the sampler's memory (its KV "
                f"cache for {n} x ({prompt} + {max_tokens}) tokens of {spec.name}, and its "
                f"logits); one request may take {mib(budget)} (TINSMITH_SAMPLE_MEMORY_MB): ask "
                "for fewer samples or tokens"
            )
        cells = 0  # of target_prompt_logprobs: its stored ids (int64 column indices, if CSR)
        if command.HasField("target_prompt_logprobs"):
            targets = command.target_prompt_logprobs
            if targets.WhichOneof("encoding") == "sparse_csr":
                cells = len(targets.sparse_csr.col_indices) // 8
            else:
                cells = int(targets.shape[0]) * int(targets.shape[1])
        result = limits.sample_result_bytes(
            prompt=prompt,
            max_tokens=max_tokens,
            num_samples=n,
            topk_sample=command.topk_sample_logprobs,
            topk_prompt=command.topk_prompt_logprobs,
            prompt_logprobs=command.prompt_logprobs,
            target_cells=cells,
            alt_tokens_k=command.prompt_alt_tokens_k,
        )
        if result > MAX_BODY_BYTES:
            raise InvalidRequest(
                f"the result of this sample request could take {mib(result)} ({n} samples x "
                f"{max_tokens} tokens, top-{command.topk_sample_logprobs} logprobs each); a "
                f"result is stored as one message of at most {mib(MAX_BODY_BYTES)}: ask for "
                "fewer samples, tokens or top-k logprobs, or send several requests"
            )

    @contextlib.contextmanager
    def watch(self, request_id: str) -> Iterator[asyncio.Queue[bus.SampleProgress]]:
        """The tokens of a streamed request as they reach this replica, in order. Watch before
        accepting it (``asample(..., stream=True)``), so none is missed; none comes for a request
        accepted without ``stream`` or by another replica."""
        queue: asyncio.Queue[bus.SampleProgress] = asyncio.Queue()
        self._watchers.setdefault(request_id, []).append(queue)
        try:
            yield queue
        finally:
            watchers = self._watchers[request_id]
            watchers.remove(queue)
            if not watchers:
                del self._watchers[request_id]

    async def _progress(self, data: bytes) -> None:
        progress = bus.SampleProgress.FromString(data)
        for queue in self._watchers.get(progress.request_id, ()):
            queue.put_nowait(progress)

    async def cancel_sample(self, request_id: str, detail: str) -> None:
        """Cancel a pending sample request whose caller went away: its future fails as
        cancelled, and the samplers drop its work (or skip it when they fetch it). Training
        requests are not cancelled: a run's requests execute in seq_id order."""
        request = self.state.requests.get(request_id)
        if request is None:
            await self.projection.catch_up()  # accepted a moment ago, maybe by another replica
            request = self.state.requests.get(request_id)
        if request is None or request.command != "sample":
            return
        if request.status is jobs.Status.PENDING:
            await self.log.cancel(
                request_id, request.aggregate_id, detail, request_aggregate="sampler"
            )

    # -- futures -------------------------------------------------------------------------------

    async def retrieve_future(self, body: JsonDict) -> tuple[bytes | JsonDict, str]:
        """Long-poll one future: its result as ``(body, media type)``, a failure, or try_again."""
        request_id = wire.req_str(body, "request_id")
        telemetry.annotate({"tinsmith.request_id": request_id})
        request = await self._settled(request_id, self.config.long_poll_s)
        if request.status is jobs.Status.PENDING:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}, ""
        if request.status is jobs.Status.FAILED:
            return future_failure(request.error_kind, request.error_detail), ""
        result, media_type = await self.log.get_result(request.result_seq)
        return result, media_type

    async def result(self, request_id: str, timeout_s: float | None) -> tuple[bytes, str]:
        """Wait for one future (the gRPC face): its result as ``(body, media type)``; a failed
        request raises its error, and one still pending after ``timeout_s`` raises
        ``TimeoutError`` (it stays queued: asking again later gets its result)."""
        telemetry.annotate({"tinsmith.request_id": request_id})
        request = await self._settled(request_id, timeout_s)
        if request.status is jobs.Status.PENDING:
            raise TimeoutError(f"request {request_id} is still pending")
        if request.status is jobs.Status.FAILED:
            raise from_kind(request.error_kind, request.error_detail)
        return await self.log.get_result(request.result_seq)

    async def _settled(self, request_id: str, timeout_s: float | None) -> jobs.RequestState:
        """The request once it has settled, or as it stands after ``timeout_s``."""
        if request_id not in self.state.requests:
            # It may have been accepted by another replica a moment ago.
            await self.projection.catch_up()
            if request_id not in self.state.requests:
                raise NotFound(f"no future with request_id {request_id!r:.200}")

        def settled() -> bool:
            return self.state.requests[request_id].status is not jobs.Status.PENDING

        if not settled():
            await self.projection.wait_until(settled, timeout_s)
        return self.state.requests[request_id]

    async def refuse_oversized(self, error: TooLarge, prefix: bytes, *, protobuf: bool) -> None:
        """A run's request whose body was too large to read: spend its seq_id with ``error``
        when its first bytes name a known run and a seq_id not yet spent, so that the run's
        later requests do not wait for it. (A body whose first bytes do not name them is
        refused without spending anything: the client sees the 413 either way.)"""
        found = wire.protobuf_ids(prefix) if protobuf else wire.json_ids(prefix)
        if found is not None:
            await self.spend_refused(error, *found)

    async def spend_refused(self, error: TinsmithError, model_id: str, seq_id: int) -> None:
        """Spend ``seq_id`` of run ``model_id`` with ``error``, for a request refused before it
        could be read (too large): a run that does not exist, a seq_id spent already or one
        too far ahead is left alone."""
        run = self.state.runs.get(model_id)
        if run is None or seq_id < 1 or seq_id >= run.next_seq_id + self.config.limits.seq_window:
            return
        with contextlib.suppress(TinsmithError):
            if self._existing(model_id, seq_id) is None:
                await self._reject(model_id, seq_id, error)

    # -- helpers -------------------------------------------------------------------------------

    def _user_metadata(self, body: JsonDict) -> dict[str, str]:
        metadata = wire.str_map(body, "user_metadata")
        wire.check_metadata(self.config.limits.max_metadata_bytes, metadata)
        return metadata

    def _session(self, session_id: str) -> jobs.SessionState:
        session = self.state.sessions.get(session_id)
        if session is None:
            raise NotFound(f"no session {session_id!r:.200}; create one with create_session")
        return session

    def _run(self, model_id: str) -> jobs.RunState:
        run = self.state.runs.get(model_id)
        if run is None:
            raise NotFound(f"no training run with model_id {model_id!r:.200}")
        return run

    def _sampler(self, sampler_id: str) -> jobs.SamplerState:
        sampler = self.state.samplers.get(sampler_id)
        if sampler is None:
            raise NotFound(
                f"no sampler {sampler_id!r:.200}; create one with create_sampling_session"
            )
        return sampler

    async def _accept_new_run(self, model_id: str, command: bus.CreateModel) -> JsonDict:
        """A run's creation is its request 0."""
        accepted = bus.RequestAccepted(
            request_id=events.request_id(model_id, 0),
            aggregate_id=model_id,
            seq_id=0,
            create_model=command,
        )
        return await self._accept(accepted)

    def _new_run(self, body: JsonDict) -> tuple[jobs.SessionState, str, JsonDict | None]:
        """The session and model_id of a run being created (the SDK derives the id as
        ``<session_id>:train:<model_seq_id>`` too), and the first future if this is a repeat."""
        session = self._session(wire.req_str(body, "session_id"))
        model_seq_id = wire.req_int(body, "model_seq_id", minimum=0, maximum=INT32_MAX)
        model_id = subjects.check_id("model_id", f"{session.session_id}:train:{model_seq_id}")
        return session, model_id, self._existing(model_id, 0)

    def _existing(self, aggregate_id: str, seq_id: int) -> JsonDict | None:
        """The first future of a repeated (aggregate, seq_id): the SDK retries submissions. A
        repeat of a refused request is refused again, as it was the first time."""
        request_id = events.request_id(aggregate_id, seq_id)
        if request_id in self.state.requests:
            return {"request_id": request_id, "model_id": aggregate_id}
        rejected = self.state.rejections.get(request_id)
        if rejected is not None:
            raise from_kind(rejected.kind, rejected.detail)
        return None

    async def _submit(self, run: jobs.RunState, seq_id: int, command: Command) -> JsonDict:
        """Accept one of a run's requests. A repeated seq_id gets the first future (or the first
        refusal); one too far ahead of the run is refused with 429 and may come again later;
        otherwise ``command()`` validates and builds the command, and a refusal, whatever
        raised it, spends the seq_id: the run's later requests never wait for it."""
        future = self._existing(run.model_id, seq_id)
        if future:
            return future
        window = self.config.limits.seq_window
        if seq_id >= run.next_seq_id + window:
            raise Overloaded(
                f"seq_id {seq_id} is {seq_id - run.next_seq_id} ahead of run {run.model_id}'s "
                f"next request ({run.next_seq_id}); at most {window - 1} ahead are accepted "
                "(TINSMITH_SEQ_WINDOW): send the earlier ones first"
            )
        try:
            built = command()
            fields = await built if inspect.isawaitable(built) else built
        except TinsmithError as error:
            await self._reject(run.model_id, seq_id, error)
            raise
        except Exception as exc:
            log.exception("validating request %s of %s failed", seq_id, run.model_id)
            failure = InternalError(f"validating the request failed inside the gateway: {exc!r}")
            await self._reject(run.model_id, seq_id, failure)
            raise failure from exc
        return await self._accept(
            bus.RequestAccepted(
                request_id=events.request_id(run.model_id, seq_id),
                aggregate_id=run.model_id,
                seq_id=seq_id,
                **fields,
            )
        )

    async def _append(self, event: bus.Event, *, aggregate: str) -> None:
        seq, _ = await self.log.append(event, request_aggregate=aggregate)
        await self.projection.wait_for(seq)

    async def _accept(self, accepted: bus.RequestAccepted, aggregate: str = "run") -> JsonDict:
        """Answer with a future only once the request is durable in the log."""
        telemetry.annotate(
            {
                "tinsmith.op": events.command_of(accepted),
                "tinsmith.aggregate_id": accepted.aggregate_id,
            }
        )
        with telemetry.request_scope(accepted.request_id):
            seq, duplicate = await self.log.append(
                events.make(request_accepted=accepted),
                msg_id=accepted.request_id,
                request_aggregate=aggregate,
            )
        if not duplicate:
            await self.projection.wait_for(seq)
        else:
            await self.projection.catch_up()
        return {"request_id": accepted.request_id, "model_id": accepted.aggregate_id}

    async def _reject(self, model_id: str, seq_id: int, error: TinsmithError) -> None:
        """Record that this seq_id will never run, so the run's later requests do not wait."""
        rejected = bus.RequestRejected(
            aggregate_id=model_id, seq_id=seq_id, kind=error.kind, detail=error.detail
        )
        await self.log.append(
            events.make(request_rejected=rejected), msg_id=events.request_id(model_id, seq_id)
        )

    async def _resolve(self, tinker_path: str) -> bus.WeightsSaved:
        """Ask the checkpoint service what a tinker:// path refers to."""
        artifacts.parse(tinker_path)
        reply = bus.ResolvedCheckpoint()
        reply.ParseFromString(
            await self.log.bus.request(
                subjects.RESOLVE_CHECKPOINT,
                bus.ResolveCheckpoint(tinker_path=tinker_path).SerializeToString(),
            )
        )
        if reply.error_kind:
            raise from_kind(reply.error_kind, reply.error_detail)
        return reply.checkpoint
