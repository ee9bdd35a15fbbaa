"""The Tinker HTTP API (what the official SDK speaks), on aiohttp.

Owns: routes, request bodies in and responses out, the HTTP server itself, and the conversion
of errors to HTTP (400/404/422 with ``{"detail": ...}``; never an empty 400, never 5xx for a
permanent error). That includes what aiohttp answers by itself: a body over the bus's message
size is a 413 that says the limit, and a request aiohttp cannot parse is answered in JSON too and
logged as one line without the bytes it carried (they can hold an API key). Does not own: what
the operations do (handlers.py).
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
from tinsmith.bus import MAX_BODY_BYTES
from tinsmith.failures import InternalError, InvalidRequest, TinsmithError, http_body

from .handlers import Gateway
from .rest import BodyTooLarge, Rest, owner_of, read_body, read_json

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
        return web.json_response({"detail": detail[:500]}, status=400)
    except web.HTTPException as exc:
        if exc.status >= 400:
            return web.json_response(
                {"detail": f"{request.method} {request.path}: {exc.reason}"}, status=exc.status
            )
        raise
    except TinsmithError as error:
        if error.http_status >= 500:
            log.error("%s %s failed: %s", request.method, request.path, error.detail)
        return web.json_response(http_body(error), status=error.http_status)
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return web.json_response(
            http_body(InternalError("internal error; see the gateway log")), status=500
        )


def build_app(gateway: Gateway, rest: Rest | None = None) -> web.Application:
    app = web.Application(middlewares=[traced, errors], client_max_size=MAX_BODY_BYTES)

    def post(
        path: str, fn: Callable[[dict[str, Any]], Awaitable[Any] | Any], *, run_op: bool = False
    ) -> None:
        """A JSON route; ``run_op``: one of a run's requests, whose refusal for size spends its
        seq_id (``Gateway.refuse_oversized``)."""

        async def route(request: web.Request) -> web.StreamResponse:
            try:
                body = await read_json(request)
            except BodyTooLarge as error:
                if run_op:
                    await gateway.refuse_oversized(error, error.prefix, protobuf=False)
                raise
            result = fn(body)
            if isinstance(result, Awaitable):
                result = await result
            return web.json_response(result)

        app.router.add_post(API + path, route)

    post("/client/config", lambda _: gateway.client_config())
    post("/client/dynamic_config", lambda _: {"refresh_interval_sec": 300})
    post("/telemetry", lambda _: {"status": "accepted"})
    post("/session_heartbeat", gateway.heartbeat)
    post("/create_model", gateway.create_model)
    post("/get_info", gateway.get_info)
    post("/optim_step", gateway.optim_step, run_op=True)
    post("/load_weights", gateway.load_weights, run_op=True)
    post("/save_weights", lambda body: gateway.save_weights(body, for_sampler=False), run_op=True)
    post(
        "/save_weights_for_sampler",
        lambda body: gateway.save_weights(body, for_sampler=True),
        run_op=True,
    )
    post(
        "/save_weights_external",
        lambda body: gateway.save_weights(body, external=True),
        run_op=True,
    )
    post("/create_sampling_session", gateway.create_sampling_session)
    post("/asample", gateway.asample)

    async def create_session(request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        return web.json_response(await gateway.create_session(body, owner=owner_of(request)))

    async def finish(request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        return web.json_response(await gateway.finish_session(request.match_info["id"], body))

    async def forward_backward(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Content-Encoding", "").lower() not in ("", "identity"):
            raise InvalidRequest("compressed forward_backward bodies are not accepted")
        try:
            body = await read_body(request)
        except BodyTooLarge as error:
            await gateway.refuse_oversized(error, error.prefix, protobuf=True)
            raise
        return web.json_response(await gateway.forward_backward(body))

    async def retrieve_future(request: web.Request) -> web.StreamResponse:
        result, media_type = await gateway.retrieve_future(await read_json(request))
        if isinstance(result, bytes):
            return web.Response(body=result, content_type=media_type)
        # A future still pending after the long poll: 408 makes the SDK re-poll at once, like a
        # 200 try_again, without logging a warning for every poll of a long step.
        status = 408 if result.get("type") == "try_again" else 200
        return web.json_response(result, status=status)

    async def get_sampler(request: web.Request) -> web.StreamResponse:
        return web.json_response(gateway.get_sampler(request.match_info["id"]))

    async def capabilities(_: web.Request) -> web.StreamResponse:
        return web.json_response(gateway.server_capabilities())

    async def healthz(_: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "ok"})

    app.router.add_post(API + "/create_session", create_session)
    app.router.add_post(API + "/sessions/{id}/finish", finish)
    app.router.add_post(API + "/forward_backward", forward_backward)
    app.router.add_post(API + "/retrieve_future", retrieve_future)

    app.router.add_get(API + "/samplers/{id}", get_sampler)
    app.router.add_get(API + "/get_server_capabilities", capabilities)
    app.router.add_get(API + "/healthz", healthz)
    # Training runs, checkpoints, sessions, downloads: the REST catalog.
    (rest or Rest(gateway.log.bus, None, gateway.config)).add_routes(app)
    return app


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
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    manager = runner.server
    assert manager is not None
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Protocol(manager, loop=loop), host, port, reuse_address=True
    )

    async def stop() -> None:
        server.close()
        await runner.cleanup()

    return stop
