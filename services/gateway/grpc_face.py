"""The gRPC face (proto/tinsmith/v1/service.proto), on grpc.aio, beside the HTTP API.

Owns: turning each gRPC request into the body the HTTP route would carry, calling the same
``Gateway`` (and ``Rest``) method the HTTP route calls, awaiting the future on the gateway's
projection within the call's deadline instead of long-polling, and mapping errors with the one
error tree (``TinsmithError.grpc_code``). Also enables server reflection and grpc.health.v1.
Does not own: what the operations do (handlers.py, rest.py).

Message size: a request may be at most ``GatewayConfig.grpc_max_message_bytes`` (it becomes one
message on NATS, whose limit is 8 MiB); a larger one fails with RESOURCE_EXHAUSTED from gRPC
itself, saying both sizes. Split a large forward_backward batch into several calls, as the SDK
does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tinsmith import subjects
from tinsmith._proto import service_pb2 as svc
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import TinsmithError

from .config import GatewayConfig
from .handlers import Gateway, JsonDict
from .rest import Rest, owner_of_key

log = logging.getLogger(__name__)

PACKAGE = "tinsmith.v1"
SERVICES = ("Training", "Sampling", "Catalog")
Method = Callable[[Any, Any], Awaitable[Message]]


class GrpcFace:
    def __init__(self, gateway: Gateway, rest: Rest) -> None:
        self.gateway = gateway
        self.rest = rest

    # -- training ------------------------------------------------------------------------------

    async def CreateSession(self, request: svc.CreateSessionRequest, context: Any) -> Message:
        body = {
            "tags": list(request.tags),
            "user_metadata": dict(request.user_metadata),
            "project_id": request.project_id,
            "display_name": request.display_name,
        }
        created = await self.gateway.create_session(body, owner=_owner(context))
        return svc.CreateSessionResponse(session_id=created["session_id"])

    async def CreateModel(self, request: svc.CreateModelRequest, context: Any) -> Message:
        lora: JsonDict = {
            name: getattr(request, name)
            for name in ("train_mlp", "train_attn", "train_unembed", "seed")
            if request.HasField(name)
        }
        if request.HasField("lora_rank"):
            lora["rank"] = request.lora_rank
        body = {
            "session_id": request.session_id,
            "model_seq_id": request.model_seq_id,
            "base_model": request.base_model,
            "lora_config": lora,
            "user_metadata": dict(request.user_metadata),
        }
        result = await self._json(await self.gateway.create_model(body), context)
        return svc.CreateModelResponse(model_id=result["model_id"])

    async def LoadState(self, request: svc.LoadStateRequest, context: Any) -> Message:
        body = {
            "session_id": request.session_id,
            "model_seq_id": request.model_seq_id,
            "path": request.path,
            "optimizer": request.with_optimizer,
        }
        result = await self._json(await self.gateway.load_weights(body), context)
        return svc.CreateModelResponse(model_id=result["model_id"])

    async def Forward(self, request: tp.ForwardBackwardRequest, context: Any) -> Message:
        request.forward_only = True
        return await self._forward_backward(request, context)

    async def ForwardBackward(self, request: tp.ForwardBackwardRequest, context: Any) -> Message:
        request.forward_only = False
        return await self._forward_backward(request, context)

    async def _forward_backward(self, request: tp.ForwardBackwardRequest, context: Any) -> Message:
        future = await self.gateway.forward_backward(request.SerializeToString())
        return tp.ForwardBackwardOutput.FromString(await self._bytes(future, context))

    async def OptimStep(self, request: svc.OptimStepRequest, context: Any) -> Message:
        adam = {
            field.name: value for field, value in request.adam_params.ListFields()
        }  # only the fields set: the others take the Tinker defaults
        body = {"model_id": request.model_id, "seq_id": request.seq_id, "adam_params": adam}
        result = await self._json(await self.gateway.optim_step(body), context)
        return svc.OptimStepResponse(metrics=result["metrics"])

    async def SaveState(self, request: svc.SaveRequest, context: Any) -> Message:
        return await self._save(request, context, for_sampler=False)

    async def SaveForSampler(self, request: svc.SaveRequest, context: Any) -> Message:
        return await self._save(request, context, for_sampler=True)

    async def _save(self, request: svc.SaveRequest, context: Any, *, for_sampler: bool) -> Message:
        body: JsonDict = {
            "model_id": request.model_id,
            "seq_id": request.seq_id,
            "path": request.path,
            "overwrite": request.overwrite,
            "user_metadata": dict(request.user_metadata),
        }
        if request.HasField("ttl_seconds"):
            body["ttl_seconds"] = request.ttl_seconds
        if request.HasField("sampling_session_seq_id"):
            body["sampling_session_seq_id"] = request.sampling_session_seq_id
        future = await self.gateway.save_weights(body, for_sampler=for_sampler)
        result = await self._json(future, context)
        return svc.SaveResponse(
            path=result.get("path", ""), sampling_session_id=result.get("sampling_session_id", "")
        )

    # -- sampling ------------------------------------------------------------------------------

    async def CreateSamplingSession(
        self, request: svc.CreateSamplingSessionRequest, context: Any
    ) -> Message:
        body = {
            "session_id": request.session_id,
            "sampling_session_seq_id": request.sampling_session_seq_id,
            "base_model": request.base_model or None,
            "model_path": request.model_path or None,
        }
        created = await self.gateway.create_sampling_session(body)
        return svc.CreateSamplingSessionResponse(sampling_session_id=created["sampling_session_id"])

    async def Sample(self, request: svc.SampleRequest, context: Any) -> Message:
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
        future = await self.gateway.asample(body)
        return tp.SampleResponse.FromString(await self._bytes(future, context))

    # -- catalog -------------------------------------------------------------------------------

    async def ListTrainingRuns(self, request: svc.ListTrainingRunsRequest, context: Any) -> Message:
        limit = request.limit if request.HasField("limit") else 20
        document = await self.rest.ask(
            "training_runs",
            _owner(context),
            limit=limit,
            offset=request.offset,
            access_scope="owned",
            project_id="",
        )
        return svc.CatalogDocument(json=document.decode())

    async def ListCheckpoints(self, request: svc.ListCheckpointsRequest, context: Any) -> Message:
        run = subjects.check_id("training run id", request.training_run_id)
        document = await self.rest.ask(
            "checkpoints", _owner(context), training_run_id=run, access_scope="owned"
        )
        return svc.CatalogDocument(json=document.decode())

    async def GetSession(self, request: svc.GetSessionRequest, context: Any) -> Message:
        session = subjects.check_id("session id", request.session_id)
        document = await self.rest.ask("session", _owner(context), session_id=session)
        return svc.CatalogDocument(json=document.decode())

    # -- futures -------------------------------------------------------------------------------

    async def _bytes(self, future: JsonDict, context: Any) -> bytes:
        """Wait for a future within the call's deadline (a cancelled call stops waiting)."""
        body, _ = await self.gateway.result(future["request_id"], context.time_remaining())
        return body

    async def _json(self, future: JsonDict, context: Any) -> JsonDict:
        result = json.loads(await self._bytes(future, context))
        assert isinstance(result, dict)
        return result


def _owner(context: Any) -> str:
    metadata = dict(context.invocation_metadata() or ())
    key = metadata.get("x-api-key", "")
    return owner_of_key(key if isinstance(key, str) else "")


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


def _method(fn: Method) -> Method:
    """One RPC with the error tree mapped to status codes, as http.py maps it to statuses."""

    async def call(request: Any, context: Any) -> Message:
        try:
            return await fn(request, context)
        except TinsmithError as error:
            if error.http_status >= 500:
                log.error("gRPC %s failed: %s", fn.__name__, error.detail)
            await context.abort(grpc.StatusCode[error.grpc_code], error.detail)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the deadline passed before the result was ready; the request stays queued, "
                "and the same call with the same seq_id gets its result",
            )
        except Exception:
            log.exception("gRPC %s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the gateway log")
        raise AssertionError("unreachable: context.abort raises")

    return call


def _handlers(face: GrpcFace, service: str) -> Any:
    descriptor = svc.DESCRIPTOR.services_by_name[service]
    handlers = {}
    for method in descriptor.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _method(getattr(face, method.name)),
            request_deserializer=request_class.FromString,
            response_serializer=_serialize,
        )
    return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


async def serve(
    gateway: Gateway, rest: Rest, config: GatewayConfig
) -> Callable[[], Awaitable[None]]:
    """Start the gRPC server on ``config.grpc_port``; return its stop function."""
    limit = config.grpc_max_message_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ]
    )
    face = GrpcFace(gateway, rest)
    server.add_generic_rpc_handlers([_handlers(face, name) for name in SERVICES])
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
