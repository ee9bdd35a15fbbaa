"""The Tinker HTTP API (what the official SDK speaks), on aiohttp.

Owns: routes, request bodies in and responses out, the HTTP server itself, authentication (every
call but the health check and the signed downloads carries an API key, as ``X-API-Key`` or
``Authorization: Bearer``, which names its tenant: ``authenticated``), and the conversion of
errors to HTTP (400/401/403/404/422 with ``{"detail": ...}``, and OpenAI's ``{"error": {...}}``
beside it on the OpenAI-compatible routes; never an empty 400, never 5xx for a permanent error).
That includes what
aiohttp answers by itself: a body over the bus's message size is a 413 that says the limit, and
a request aiohttp cannot parse is answered in JSON too and logged as one line without the bytes
it carried (they can hold an API key). Each route is a thin translator: its body read into the
operation's typed request (wire.py), performed by the gateway (handlers.py), answered as Tinker
JSON. Does not own: what the operations do (operations.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from aiohttp.web_request import BaseRequest

from tinsmith import telemetry
from tinsmith._proto import bus_pb2 as bus
from tinsmith.bus import MAX_BODY_BYTES
from tinsmith.failures import InternalError, InvalidRequest, TinsmithError, http_body
from tinsmith.tenants import Tenant

from . import console, openai_api, tokenizers, wire
from . import operations as ops
from .handlers import Gateway
from .rest import BodyTooLarge, Rest, read_body, read_json, tenant_of
from .text import TextSampling

log = logging.getLogger(__name__)

API = "/api/v1"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def traced(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Each call is a server span (under the client's ``traceparent``, if it sent one), named by
    its route, and a sample of ``tinsmith.request.duration``."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    attributes = {"http.request.method": request.method, "http.route": route}
    with telemetry.serve_call("http", f"{request.method} {route}", request.headers, attributes) as (
        call
    ):
        response = await handler(request)
        call.status = str(response.status)
        call.span.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            telemetry.record_error(call.span, "internal", f"answered {response.status}")
        return response


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except (HttpProcessingError, RequestPayloadError) as exc:  # e.g. a bad content encoding
        reason = exc.message if isinstance(exc, HttpProcessingError) else str(exc)
        detail = f"{request.method} {request.path}: the body could not be read: {reason}"
        response = _error(request, 400, {"detail": detail[:500]})
        # Where this body ends is unknown now, so the connection ends with the answer; saying
        # so (Connection: close) keeps a client from sending its next request on it.
        response.force_close()
        return response
    except web.HTTPException as exc:
        if exc.status >= 400:
            detail = f"{request.method} {request.path}: {exc.reason}"
            return _error(request, exc.status, {"detail": detail})
        raise
    except TinsmithError as error:
        if error.http_status >= 500:
            log.error("%s %s failed: %s", request.method, request.path, error.detail)
        return _error(request, error.http_status, http_body(error))
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return _error(request, 500, http_body(InternalError("internal error; see the gateway log")))


def _error(request: web.Request, status: int, body: dict[str, Any]) -> web.Response:
    """An error answer: ``{"detail": ...}``, and OpenAI's ``{"error": {...}}`` beside it on
    the OpenAI-compatible routes, whose clients read that."""
    if openai_api.serves(request.path):
        body = openai_api.error_body(status, body)
    return web.json_response(body, status=status)


@web.middleware
async def authenticated(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every API call names its tenant with its key (``request["tenant"]``), or is refused
    with 401, before its body is read. The exceptions carry no tenant's data: the health check,
    the signed downloads (bound to a tenant by their signature, and expiring), and the built-in
    models' tokenizers under ``/hf`` (Hugging Face clients send no tinsmith key), and the
    console's files (the console sends the key with each API call it makes)."""
    route = request.match_info.route.resource
    keyless = route is not None and (
        route.canonical in _KEYLESS
        or route.canonical.startswith(tokenizers.PREFIX + "/")
        or console.keyless(route.canonical)
    )
    if not keyless:
        gateway: Gateway = request.app[GATEWAY]
        request["tenant"] = await gateway.authenticate(api_key(request))
    return await handler(request)


def api_key(request: web.Request) -> str | None:
    """The key a call carries: ``X-API-Key`` (the SDK's), else ``Authorization: Bearer``
    (what OpenAI's clients send)."""
    key = request.headers.get("X-API-Key")
    if key is None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            key = token.strip()
    return key


GATEWAY = web.AppKey("gateway", Gateway)
_KEYLESS = {API + "/healthz", API + "/blobs/{path}", API + "/archives/{path}"}


def build_app(gateway: Gateway, rest: Rest | None = None) -> web.Application:
    app = web.Application(
        middlewares=[traced, errors, authenticated], client_max_size=MAX_BODY_BYTES
    )
    app[GATEWAY] = gateway

    def post(
        path: str,
        answer: Callable[[Tenant, dict[str, Any]], Awaitable[Any]],
        *,
        run_op: bool = False,
    ) -> None:
        """A JSON route; ``run_op``: one of a run's requests, whose refusal for size spends its
        seq_id (``Gateway.spend_refused``)."""

        async def route(request: web.Request) -> web.StreamResponse:
            tenant = tenant_of(request)
            try:
                body = await read_json(request)
            except BodyTooLarge as error:
                found = wire.json_ids(error.prefix) if run_op else None
                if found is not None:
                    await gateway.spend_refused(tenant, error, *found)
                raise
            return web.json_response(await answer(tenant, body))

        app.router.add_post(API + path, route)

    def operation(
        op: Callable[..., ops.Decision[Any]],
        read: Callable[[dict[str, Any]], Any],
        respond: Callable[[Any], Any] = lambda answer: answer,
    ) -> Callable[[Tenant, dict[str, Any]], Awaitable[Any]]:
        """A route's answer: ``read`` the body into the operation's typed request, perform it,
        and ``respond`` with its answer as Tinker JSON."""

        async def answer(tenant: Tenant, body: dict[str, Any]) -> Any:
            return respond(await gateway.perform(tenant, op, read(body)))

        return answer

    async def static(answer: Any) -> Any:
        return answer

    async def heartbeat(tenant: Tenant, body: dict[str, Any]) -> Any:
        await gateway.heartbeat(tenant, wire.session_ref(body))
        return {"type": "session_heartbeat"}

    async def load_weights(tenant: Tenant, body: dict[str, Any]) -> Any:
        request = wire.load_weights(body)
        op = ops.load_weights if isinstance(request, ops.LoadWeights) else ops.load_state
        return future(await gateway.perform(tenant, op, request))

    async def asample(tenant: Tenant, body: dict[str, Any]) -> Any:
        accepted = await gateway.perform(tenant, ops.sample, wire.sample(body))
        return {"request_id": accepted.request_id, "sample_sequence_ids": accepted.sequence_ids}

    def save(
        kind: bus.CheckpointKind,
    ) -> Callable[[Tenant, dict[str, Any]], Awaitable[Any]]:
        return operation(ops.save_weights, lambda body: wire.save_weights(body, kind), future)

    post("/client/config", lambda _t, _b: static(gateway.client_config()))
    post("/client/dynamic_config", lambda _t, _b: static({"refresh_interval_sec": 300}))
    post("/telemetry", lambda _t, _b: static({"status": "accepted"}))
    post("/session_heartbeat", heartbeat)
    post(
        "/create_session",
        operation(
            ops.create_session,
            wire.create_session,
            lambda session_id: {"type": "create_session", "session_id": session_id},
        ),
    )
    post("/create_model", operation(ops.create_model, wire.create_model, future))
    post("/get_info", operation(ops.get_info, wire.model_ref))
    post("/optim_step", operation(ops.optim_step, wire.optim_step, future), run_op=True)
    post("/load_weights", load_weights, run_op=True)
    post("/save_weights", save(bus.CHECKPOINT_KIND_TRAINING), run_op=True)
    post("/save_weights_for_sampler", save(bus.CHECKPOINT_KIND_SAMPLER), run_op=True)
    post("/save_weights_external", save(bus.CHECKPOINT_KIND_EXTERNAL), run_op=True)
    post(
        "/create_sampling_session",
        operation(
            ops.create_sampler,
            wire.create_sampler,
            lambda sampler_id: {
                "type": "create_sampling_session",
                "sampling_session_id": sampler_id,
            },
        ),
    )
    post("/asample", asample)
    # The same sampling with text in and out, for clients without a tokenizer (the console).
    sampling = TextSampling(gateway)
    post("/sample_text", sampling.sample_text)

    async def finish(request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        session = wire.finish_session(request.match_info["id"], body)
        await gateway.perform(tenant_of(request), ops.finish_session, session)
        return web.json_response({})

    async def forward_backward(request: web.Request) -> web.StreamResponse:
        tenant = tenant_of(request)
        if request.headers.get("Content-Encoding", "").lower() not in ("", "identity"):
            raise InvalidRequest("compressed forward_backward bodies are not accepted")
        try:
            body = await read_body(request)
        except BodyTooLarge as error:
            found = wire.protobuf_ids(error.prefix)
            if found is not None:
                await gateway.spend_refused(tenant, error, *found)
            raise
        chunk = wire.forward_backward(body)
        return web.json_response(future(await gateway.perform(tenant, ops.forward_backward, chunk)))

    async def retrieve_future(request: web.Request) -> web.StreamResponse:
        ref = wire.request_ref(await read_json(request))
        result, media_type = await gateway.retrieve_future(tenant_of(request), ref)
        if isinstance(result, bytes):
            return web.Response(body=result, content_type=media_type)
        # A future still pending after the long poll: 408 makes the SDK re-poll at once, like a
        # 200 try_again, without logging a warning for every poll of a long step.
        status = 408 if result.get("type") == "try_again" else 200
        return web.json_response(result, status=status)

    async def get_sampler(request: web.Request) -> web.StreamResponse:
        ref = ops.SamplerRef(request.match_info["id"])
        return web.json_response(await gateway.perform(tenant_of(request), ops.get_sampler, ref))

    async def capabilities(_: web.Request) -> web.StreamResponse:
        return web.json_response(gateway.server_capabilities())

    async def usage(request: web.Request) -> web.StreamResponse:
        return web.json_response(gateway.usage(tenant_of(request)))

    async def healthz(_: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "ok"})

    app.router.add_post(API + "/sessions/{id}/finish", finish)
    app.router.add_post(API + "/forward_backward", forward_backward)
    app.router.add_post(API + "/retrieve_future", retrieve_future)

    app.router.add_get(API + "/samplers/{id}", get_sampler)
    app.router.add_get(API + "/get_server_capabilities", capabilities)
    app.router.add_get(API + "/usage", usage)
    app.router.add_get(API + "/healthz", healthz)
    # Training runs, checkpoints, sessions, downloads: the REST catalog.
    rest = rest or Rest(gateway, None)
    rest.add_routes(app)
    # The same sampling for OpenAI's clients: /v1/completions, /v1/chat/completions, /v1/models.
    openai_api.add_routes(app, sampling, rest)
    tokenizers.add_routes(app)
    console.add_routes(app)
    return app


def future(accepted: ops.Future) -> dict[str, str]:
    """A run's request as the SDK expects its acceptance: the future to poll."""
    return {"request_id": accepted.request_id, "model_id": accepted.aggregate_id}


class _Protocol(web.RequestHandler):
    """aiohttp's connection handler, answering what it cannot parse (a malformed request line
    or header, a bad chunked body) in JSON with a detail, and logging it as one line: aiohttp's
    own answer is plain text, and it logs the parser's message, which quotes the header bytes."""

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        """aiohttp's own logging of a failure: a body it cannot read (met again when it drains
        what the handler left) is the client's, one line without its bytes; anything else is
        logged in full."""
        error = kwargs.get("exc_info")
        if isinstance(error, HttpProcessingError | RequestPayloadError):
            log.warning("a request body could not be read: %s", type(error).__name__)
            return
        super().log_exception(*args, **kwargs)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        kind = type(exc).__name__ if exc is not None else "error"
        if status >= 500:
            log.error("HTTP connection from %s failed: %s", request.remote, kind, exc_info=exc)
            detail = "internal error; see the gateway log"
        else:
            log.warning(
                "refused a malformed HTTP request from %s: %d %s", request.remote, status, kind
            )
            reason = getattr(exc, "message", None) or message or kind
            detail = f"the request is not valid HTTP/1.1 ({kind}): {str(reason)[:200]}"
        if request.writer.output_size > 0:
            raise ConnectionError("the response had begun: no error response can follow")
        response = web.json_response({"detail": detail}, status=status)
        response.force_close()
        return response


async def serve(app: web.Application, host: str, port: int) -> Callable[[], Awaitable[None]]:
    """Serve ``app`` on ``host:port``; return its stop function. Like aiohttp's ``TCPSite``,
    with ``_Protocol`` for each connection."""
    runner = web.AppRunner(app)
    await runner.setup()
    manager = runner.server
    assert manager is not None
    loop = asyncio.get_running_loop()
    # No access log: every call is in the event log, traced and counted (tinsmith/telemetry.py),
    # and a line per call was the largest part of the gateway's CPU per request after the calls
    # themselves (bench/request_cost.py). None is what aiohttp's own server passes for that; its
    # annotation says Logger.
    quiet: Any = None
    server = await loop.create_server(
        lambda: _Protocol(manager, loop=loop, access_log=quiet), host, port, reuse_address=True
    )

    async def stop() -> None:
        server.close()
        await runner.cleanup()

    return stop
