"""The gRPC face (proto/tinsmith/v1/service.proto), on grpc.aio, beside the HTTP API.

Owns: authenticating each call (its ``x-api-key`` metadata names its tenant; UNAUTHENTICATED
without a valid one), turning each gRPC request into the typed request of the operation the HTTP
route performs too, awaiting the future on the gateway's projection within the call's deadline
instead of long-polling, and mapping errors with the one error tree
(``TinsmithError.grpc_code``). Also enables server reflection and grpc.health.v1, which need no
key. Does not own: what the operations do (operations.py, and the catalog behind rest.py).

Message size: a request may be at most ``GatewayConfig.grpc_max_message_bytes`` (it becomes one
message on NATS, whose limit is 8 MiB); a larger one fails with RESOURCE_EXHAUSTED from gRPC
itself, saying both sizes. Split a large forward_backward batch into several calls, as the SDK
does.

Sampling streams and cancels. SampleStream watches the request's tokens on this replica before
accepting it with ``stream`` set, relays each step's new tokens (streams.py), and builds its last
message from the stored result, so what a client concatenates is exactly what Sample answers. A
Sample or SampleStream call that ends before its result (deadline, or the client cancelled)
cancels its request (``Gateway.cancel_sample``). Training calls only stop waiting: their
requests stay queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tinsmith import events, subjects, telemetry
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import service_pb2 as svc
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import TinsmithError, TooLarge, Unauthenticated
from tinsmith.limits import TTL_MAX_S
from tinsmith.tenants import Tenant

from . import operations as ops
from . import streams, wire
from .config import GatewayConfig
from .handlers import Gateway, JsonDict
from .rest import Rest

log = logging.getLogger(__name__)

PACKAGE = "tinsmith.v1"
SERVICES = ("Training", "Sampling", "Catalog")
Method = Callable[[Any, Any, Tenant], Awaitable[Message | None]]

# The longest error detail sent back: it travels in trailing metadata, which gRPC caps (16 KiB);
# a detail that quotes a long input must not turn an INVALID_ARGUMENT into RESOURCE_EXHAUSTED.
_MAX_DETAIL = 2000
# gRPC reads messages up to this size, so that a request over the bus's limit is refused by the
# gateway, which spends its seq_id; beyond it, gRPC refuses it by itself.
_RECEIVE_LIMIT = 64 * 1024 * 1024
# Why a sample request was cancelled, as its future's failure says.
_DEADLINE = "its gRPC call's deadline passed before it finished"
_CLIENT = "its gRPC client cancelled the call"
# How close to its deadline a call may end and still count as having reached it (``_expired``).
_DEADLINE_SLACK_S = 0.25


class _Undecodable:
    """What the deserializer hands a method whose request bytes are not its message: the method
    answers INVALID_ARGUMENT (gRPC itself would answer UNKNOWN or INTERNAL)."""

    def __init__(self, message: str, error: Exception) -> None:
        self.detail = f"the request is not a valid {message} message: {str(error)[:200]}"


class _Oversized:
    """What the deserializer hands a method whose request is larger than one request may be
    (it becomes one message on the bus): the method answers RESOURCE_EXHAUSTED, and a run's
    request spends its seq_id, as any refusal does. gRPC itself refuses messages beyond
    ``_RECEIVE_LIMIT`` before any of this, without spending anything."""

    def __init__(self, request: Message, size: int, limit: int) -> None:
        self.error = TooLarge(
            f"the request is {size} bytes; one request may be at most {limit} bytes (it travels "
            "as one message on the bus): send less in one call"
        )
        model_id, seq_id = getattr(request, "model_id", ""), getattr(request, "seq_id", 0)
        self.run = (model_id, seq_id) if isinstance(model_id, str) and model_id else None


class _DeadlinePassed(Exception):
    """A sample call's deadline passed: DEADLINE_EXCEEDED, saying what became of the request."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class GrpcFace:
    """Each RPC: its protobuf request translated into the operation's typed request (the
    nested parts through wire.py's field readers, so both faces refuse the same values with the
    same details), performed by the gateway as the calling tenant, and answered once its
    future has settled."""

    def __init__(self, gateway: Gateway, rest: Rest) -> None:
        self.gateway = gateway
        self.rest = rest

    # -- training ------------------------------------------------------------------------------

    async def CreateSession(
        self, request: svc.CreateSessionRequest, context: Any, tenant: Tenant
    ) -> Message:
        created = ops.CreateSession(
            tags=tuple(request.tags),
            user_metadata=dict(request.user_metadata),
            project_id=wire.text({"project_id": request.project_id}, "project_id"),
            display_name=request.display_name,
        )
        session_id = await self.gateway.perform(tenant, ops.create_session, created)
        return svc.CreateSessionResponse(session_id=session_id)

    async def CreateModel(
        self, request: svc.CreateModelRequest, context: Any, tenant: Tenant
    ) -> Message:
        lora: JsonDict = {
            name: getattr(request, name)
            for name in ("train_mlp", "train_attn", "train_unembed", "seed")
            if request.HasField(name)
        }
        if request.HasField("lora_rank"):
            lora["rank"] = request.lora_rank
        create = ops.CreateModel(
            session_id=request.session_id,
            model_seq_id=request.model_seq_id,
            base_model=wire.req_str({"base_model": request.base_model}, "base_model"),
            lora=wire.lora_config(lora),
            user_metadata=dict(request.user_metadata),
        )
        result = await self._json(
            tenant, await self._perform(tenant, ops.create_model, create), context
        )
        return svc.CreateModelResponse(model_id=result["model_id"])

    async def LoadState(
        self, request: svc.LoadStateRequest, context: Any, tenant: Tenant
    ) -> Message:
        load = ops.LoadState(
            session_id=request.session_id,
            model_seq_id=request.model_seq_id,
            path=wire.req_str({"path": request.path}, "path"),
            with_optimizer=request.with_optimizer,
        )
        result = await self._json(
            tenant, await self._perform(tenant, ops.load_state, load), context
        )
        return svc.CreateModelResponse(model_id=result["model_id"])

    async def Forward(
        self, request: tp.ForwardBackwardRequest, context: Any, tenant: Tenant
    ) -> Message:
        request.forward_only = True
        return await self._forward_backward(request, context, tenant)

    async def ForwardBackward(
        self, request: tp.ForwardBackwardRequest, context: Any, tenant: Tenant
    ) -> Message:
        request.forward_only = False
        return await self._forward_backward(request, context, tenant)

    async def _forward_backward(
        self, request: tp.ForwardBackwardRequest, context: Any, tenant: Tenant
    ) -> Message:
        future = await self._perform(tenant, ops.forward_backward, ops.ForwardBackward(request))
        return tp.ForwardBackwardOutput.FromString(await self._bytes(tenant, future, context))

    async def OptimStep(
        self, request: svc.OptimStepRequest, context: Any, tenant: Tenant
    ) -> Message:
        adam = {
            field.name: value for field, value in request.adam_params.ListFields()
        }  # only the fields set: the others take the Tinker defaults
        step = ops.OptimStep(
            model_id=request.model_id, seq_id=request.seq_id, adam=wire.adam_params(adam)
        )
        result = await self._json(
            tenant, await self._perform(tenant, ops.optim_step, step), context
        )
        return svc.OptimStepResponse(metrics=result["metrics"])

    async def SaveState(self, request: svc.SaveRequest, context: Any, tenant: Tenant) -> Message:
        return await self._save(request, context, tenant, bus.CHECKPOINT_KIND_TRAINING)

    async def SaveForSampler(
        self, request: svc.SaveRequest, context: Any, tenant: Tenant
    ) -> Message:
        return await self._save(request, context, tenant, bus.CHECKPOINT_KIND_SAMPLER)

    async def _save(
        self,
        request: svc.SaveRequest,
        context: Any,
        tenant: Tenant,
        kind: bus.CheckpointKind,
    ) -> Message:
        ttl = request.ttl_seconds if request.HasField("ttl_seconds") else None
        save = ops.SaveWeights(
            model_id=request.model_id,
            seq_id=request.seq_id,
            kind=kind,
            name=request.path,
            overwrite=request.overwrite,
            ttl_seconds=None
            if ttl is None
            else wire.req_int({"ttl_seconds": ttl}, "ttl_seconds", minimum=1, maximum=TTL_MAX_S),
            sampling_session_seq_id=request.sampling_session_seq_id
            if request.HasField("sampling_session_seq_id")
            else None,
            user_metadata=dict(request.user_metadata),
        )
        result = await self._json(
            tenant, await self._perform(tenant, ops.save_weights, save), context
        )
        return svc.SaveResponse(
            path=result.get("path", ""), sampling_session_id=result.get("sampling_session_id", "")
        )

    # -- sampling ------------------------------------------------------------------------------

    async def CreateSamplingSession(
        self, request: svc.CreateSamplingSessionRequest, context: Any, tenant: Tenant
    ) -> Message:
        create = ops.CreateSampler(
            session_id=request.session_id,
            sampling_session_seq_id=request.sampling_session_seq_id,
            base_model=request.base_model,
            model_path=request.model_path,
        )
        sampler_id = await self.gateway.perform(tenant, ops.create_sampler, create)
        return svc.CreateSamplingSessionResponse(sampling_session_id=sampler_id)

    async def Sample(self, request: svc.SampleRequest, context: Any, tenant: Tenant) -> Message:
        request_id = await self._accept_sample(request, context, tenant, stream=False)
        async with self._cancelling(tenant, request_id, context):
            body, _ = await self.gateway.result(tenant, request_id, context.time_remaining())
        return tp.SampleResponse.FromString(body)

    async def SampleStream(self, request: svc.SampleRequest, context: Any, tenant: Tenant) -> None:
        request_id = events.request_id(request.sampling_session_id, request.seq_id)
        messages = 0
        with self.gateway.watch(request_id) as progress:  # before the sampler can send any
            await self._accept_sample(request, context, tenant, stream=True)
            async with self._cancelling(tenant, request_id, context):
                chunks = streams.relayed(
                    self.gateway, tenant, request_id, progress, context.time_remaining()
                )
                async for chunk in chunks:
                    await context.write(chunk)
                    messages += 1
        telemetry.annotate({"tinsmith.stream.messages": messages})

    async def _accept_sample(
        self, request: svc.SampleRequest, context: Any, tenant: Tenant, stream: bool
    ) -> str:
        """Accept a sample request; return its request id. A call that ends meanwhile still
        gets its request accepted, and then cancelled."""
        body = {
            "sampling_session_id": request.sampling_session_id,
            "seq_id": request.seq_id,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(request.prompt)}]},
            "sampling_params": _sampling_params(request.sampling_params),
            "num_samples": request.num_samples if request.HasField("num_samples") else 1,
            "prompt_logprobs": request.prompt_logprobs,
            "topk_prompt_logprobs": request.topk_prompt_logprobs,
            "topk_sample_logprobs": request.topk_sample_logprobs,
        }
        sample = wire.sample(body, stream=stream)
        accepting = asyncio.ensure_future(self.gateway.perform(tenant, ops.sample, sample))
        try:
            future = await asyncio.shield(accepting)
        except asyncio.CancelledError:
            why = _DEADLINE if _expired(context) else _CLIENT

            def cancel(done: asyncio.Future[ops.Future]) -> None:
                if not done.cancelled() and done.exception() is None:
                    self._cancel(tenant, done.result().request_id, why)

            accepting.add_done_callback(cancel)
            raise
        return future.request_id

    @contextlib.asynccontextmanager
    async def _cancelling(
        self, tenant: Tenant, request_id: str, context: Any
    ) -> AsyncIterator[None]:
        """Cancel the sample request if the call ends before its result: its deadline passes
        (DEADLINE_EXCEEDED) or the client cancels it."""
        try:
            yield
        except TimeoutError as exc:
            raise _DeadlinePassed(self._cancel(tenant, request_id, _DEADLINE)) from exc
        except asyncio.CancelledError:
            self._cancel(tenant, request_id, _DEADLINE if _expired(context) else _CLIENT)
            raise

    def _cancel(self, tenant: Tenant, request_id: str, why: str) -> str:
        """Cancel in the background (the call is over, and its task may be cancelled too)."""
        detail = (
            f"sample request {request_id} was cancelled: {why}; send it again with a new seq_id"
        )
        self.gateway.log.bus.spawn(self.gateway.cancel_sample(tenant, request_id, detail))
        return detail

    # -- catalog -------------------------------------------------------------------------------

    async def ListTrainingRuns(
        self, request: svc.ListTrainingRunsRequest, context: Any, tenant: Tenant
    ) -> Message:
        limit = request.limit if request.HasField("limit") else 20
        document = await self.rest.ask(
            "training_runs",
            tenant,
            limit=limit,
            offset=request.offset,
            access_scope="owned",
            project_id="",
        )
        return svc.CatalogDocument(json=document.decode())

    async def ListCheckpoints(
        self, request: svc.ListCheckpointsRequest, context: Any, tenant: Tenant
    ) -> Message:
        run = subjects.check_id("training run id", request.training_run_id)
        document = await self.rest.ask(
            "checkpoints", tenant, training_run_id=run, access_scope="owned"
        )
        return svc.CatalogDocument(json=document.decode())

    async def GetSession(
        self, request: svc.GetSessionRequest, context: Any, tenant: Tenant
    ) -> Message:
        session = subjects.check_id("session id", request.session_id)
        document = await self.rest.ask("session", tenant, session_id=session)
        return svc.CatalogDocument(json=document.decode())

    # -- futures -------------------------------------------------------------------------------

    async def _perform(self, tenant: Tenant, op: Any, request: Any) -> ops.Future:
        future = await self.gateway.perform(tenant, op, request)
        assert isinstance(future, ops.Future)
        return future

    async def _bytes(self, tenant: Tenant, future: ops.Future, context: Any) -> bytes:
        """Wait for a future within the call's deadline (a cancelled call stops waiting)."""
        body, _ = await self.gateway.result(tenant, future.request_id, context.time_remaining())
        return body

    async def _json(self, tenant: Tenant, future: ops.Future, context: Any) -> JsonDict:
        result = json.loads(await self._bytes(tenant, future, context))
        assert isinstance(result, dict)
        return result


def _expired(context: Any) -> bool:
    """Whether the call ended at its deadline. A client whose deadline passes cancels the call
    itself, and under load its cancellation can reach the server before the server's copy of the
    deadline (counted from when the call arrived) runs out: a call that ends within
    ``_DEADLINE_SLACK_S`` of its deadline is taken to have reached it."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= _DEADLINE_SLACK_S


def _key(context: Any) -> str | None:
    """The API key a call carries in its ``x-api-key`` metadata."""
    for name, value in context.invocation_metadata() or ():
        if name == "x-api-key" and isinstance(value, str):
            return value
    return None


def _sampling_params(params: tp.SamplingParams) -> JsonDict:
    body: JsonDict = {
        name: getattr(params, name)
        for name in ("max_tokens", "seed", "temperature", "top_k", "top_p")
        if params.HasField(name)
    }
    stop = params.WhichOneof("stop")
    if stop == "stop_strs":
        body["stop"] = list(params.stop_strs.values)
    elif stop == "stop_tokens":
        body["stop"] = list(params.stop_tokens.values)  # [] means no stop at all
    return body


def _method(
    fn: Method, name: str, gateway: Gateway
) -> Callable[[Any, Any], Awaitable[Message | None]]:
    """One RPC (``name``: ``/package.Service/Method``) as a server span under the trace context
    the client sent in its metadata, with the error tree mapped to status codes, as http.py maps
    it to statuses. A server-streaming RPC writes its messages itself (``context.write``) and
    returns None: its span covers the whole stream."""

    async def call(request: Any, context: Any) -> Message | None:
        metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        attributes = {"rpc.system": "grpc", "rpc.method": name}
        with telemetry.serve_call("grpc", name, metadata, attributes) as traced:
            try:
                tenant: Tenant | None = None
                try:
                    tenant = await gateway.authenticate(_key(context))
                except Unauthenticated as refused:
                    response, code, detail = None, grpc.StatusCode.UNAUTHENTICATED, refused.detail
                if tenant is None:
                    pass
                elif isinstance(request, _Undecodable):
                    response, code, detail = None, grpc.StatusCode.INVALID_ARGUMENT, request.detail
                elif isinstance(request, _Oversized):
                    if request.run is not None:
                        await gateway.spend_refused(tenant, request.error, *request.run)
                    response, code, detail = (
                        None,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        request.error.detail,
                    )
                else:
                    response, code, detail = await _answer(fn, request, context, tenant)
            except asyncio.CancelledError:  # the call ended under it: the client went away
                expired = _expired(context)
                code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
                _status(traced, code, "the call ended before its answer")
                raise
            detail = detail if len(detail) <= _MAX_DETAIL else detail[:_MAX_DETAIL] + "..."
            _status(traced, code, detail)
            if code is not grpc.StatusCode.OK:
                await context.abort(code, detail)
                raise AssertionError("unreachable: context.abort raises")
            return response

    return call


def _status(traced: telemetry.Call, code: grpc.StatusCode, detail: str) -> None:
    traced.status = code.name
    traced.span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        telemetry.record_error(traced.span, code.name.lower(), detail)


async def _answer(
    fn: Method, request: Any, context: Any, tenant: Tenant
) -> tuple[Message | None, grpc.StatusCode, str]:
    """Run ``fn``: its response (None when it failed, or streamed), the status code and its
    detail."""
    try:
        return await fn(request, context, tenant), grpc.StatusCode.OK, ""
    except _DeadlinePassed as passed:
        return None, grpc.StatusCode.DEADLINE_EXCEEDED, passed.detail
    except TinsmithError as error:
        if error.http_status >= 500:
            log.error("gRPC %s failed: %s", fn.__name__, error.detail)
        return None, grpc.StatusCode[error.grpc_code], error.detail
    except TimeoutError:
        return (
            None,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "the deadline passed before the result was ready; the request stays queued, "
            "and the same call with the same seq_id gets its result",
        )
    except Exception:
        log.exception("gRPC %s failed", fn.__name__)
        return None, grpc.StatusCode.INTERNAL, "internal error; see the gateway log"


def _handlers(face: GrpcFace, service: str, limit: int) -> Any:
    descriptor = svc.DESCRIPTOR.services_by_name[service]
    handlers = {}
    for method in descriptor.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        kind = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = kind(
            _method(
                getattr(face, method.name), f"/{descriptor.full_name}/{method.name}", face.gateway
            ),
            request_deserializer=_deserializer(request_class, limit),
            response_serializer=_serialize,
        )
    return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)


def _deserializer(
    message: type[Message], limit: int
) -> Callable[[bytes], Message | _Undecodable | _Oversized]:
    def parse(data: bytes) -> Message | _Undecodable | _Oversized:
        try:
            request = message.FromString(data)
        except Exception as exc:  # DecodeError, and RecursionError for deep nesting
            return _Undecodable(message.DESCRIPTOR.full_name, exc)
        return _Oversized(request, len(data), limit) if len(data) > limit else request

    return parse


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


async def serve(
    gateway: Gateway, rest: Rest, config: GatewayConfig
) -> Callable[[], Awaitable[None]]:
    """Start the gRPC server on ``config.grpc_port``; return its stop function."""
    limit = config.grpc_max_message_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", _RECEIVE_LIMIT),
            ("grpc.max_send_message_length", limit),
        ]
    )
    face = GrpcFace(gateway, rest)
    server.add_generic_rpc_handlers([_handlers(face, name, limit) for name in SERVICES])
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    names = [f"{PACKAGE}.{name}" for name in SERVICES]
    for name in ("", *names):
        await checks.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    await server.start()

    async def stop() -> None:
        await checks.enter_graceful_shutdown()
        await server.stop(grace=5.0)

    return stop
