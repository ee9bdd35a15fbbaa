"""The NATS wrapper: connection, streams, request-reply, and the entry to the work queues.

Owns: how tinsmith talks to NATS and JetStream (stream settings, message ids for
de-duplication), and carrying trace context in message headers: a publish or a request is a span
whose context travels with the message, and the receiving side starts its spans under it. Does
not own: subject names (tinsmith/subjects.py), the durable consumers that services work through
(tinsmith/workqueue.py), reading a stream in order (tinsmith/follower.py) or what the bytes mean
(tinsmith/eventlog.py and the services). Handlers receive payloads and never touch headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import api
from nats.js.errors import NotFoundError
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, set_span_in_context

from tinsmith import follower, subjects, telemetry
from tinsmith.failures import Unavailable
from tinsmith.limits import MAX_BODY_BYTES, MAX_PAYLOAD
from tinsmith.workqueue import Delivery, WorkQueue

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["MAX_BODY_BYTES", "MAX_PAYLOAD", "Bus"]
DUPLICATE_WINDOW_S = 120.0
# A request that may be repeated is given this long for its first answer, twice that for the
# second, and so on within its whole timeout: a responder that died holding it (a killed
# checkpoint service) costs this much, not the whole timeout, once another one answers.
FIRST_ATTEMPT_S = 1.0
# While no one answers a subject (its service restarts), a request is sent again this often.
NO_RESPONDERS_RETRY_S = 0.2
CLOSE_TASKS_TIMEOUT_S = 1.0
# A closing connection waits this long at most for its subscriptions' messages in hand to be
# processed (nats-py's own default is 30 s, which made a stopping service wait that long).
DRAIN_TIMEOUT_S = 1


class Bus:
    """A connection to NATS with JetStream, and the few patterns tinsmith uses on it."""

    def __init__(self, nc: Client, name: str = "") -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=10.0)
        # This process among the replicas of its service, as events record who did the work.
        self.replica = f"{name}@{socket.gethostname()}:{os.getpid()}"
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._reconnected_event = asyncio.Event()  # set, and replaced, at each reconnection
        self._on_reconnect: list[Callable[[], None]] = []

    @classmethod
    async def connect(cls, url: str, name: str) -> Bus:
        bus = cls(Client(), name)
        await bus.nc.connect(
            url,
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,  # type: ignore[arg-type]  # seconds; typed int, takes float
            connect_timeout=5,
            drain_timeout=DRAIN_TIMEOUT_S,
            reconnected_cb=bus._reconnected,
        )
        return bus

    def on_reconnect(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` each time the connection is made again: whatever the server kept
        in memory for this client (ephemeral consumers, pull requests) may be gone."""
        self._on_reconnect.append(listener)

    def off_reconnect(self, listener: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._on_reconnect.remove(listener)

    async def _reconnected(self) -> None:
        """The connection was made again (nats-py's ``reconnected_cb``)."""
        log.info("reconnected to NATS")
        event, self._reconnected_event = self._reconnected_event, asyncio.Event()
        event.set()
        for listener in list(self._on_reconnect):
            listener()

    async def resent_after_reconnect(self, send: Callable[[], Awaitable[T]]) -> T:
        """``await send()``, sent again if the connection is made again before it is answered:
        what was in flight on the lost connection is never answered, and its caller would wait
        out the whole timeout. Only for what may be sent twice (a JetStream publish with a
        message id, a read)."""
        while True:
            reconnected = self._reconnected_event
            attempt = asyncio.ensure_future(send())
            waiter = asyncio.ensure_future(reconnected.wait())
            try:
                await asyncio.wait({attempt, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                answered = attempt.done()
                if not answered:
                    attempt.cancel()
            if answered:
                return attempt.result()
            log.info("sending again what was in flight when the connection was lost")

    @property
    def closing(self) -> bool:
        return self._closing

    async def close(self) -> None:
        self._closing = True
        # Bounded: nats-py's fetch can swallow a cancel (a pull consumer's loop then held the
        # stop of a trainer for 15 s); the drain below ends such a loop anyway, by closing the
        # connection under its fetch.
        await ended(list(self._tasks), CLOSE_TASKS_TIMEOUT_S)
        await self.nc.drain()

    async def ensure_streams(self, results_max_age_s: float) -> None:
        """Create the event log and the results stream if they do not exist yet."""
        await self._ensure(
            api.StreamConfig(
                name=subjects.EVENTS_STREAM,
                subjects=[subjects.EVENTS_ALL],
                storage=api.StorageType.FILE,
                retention=api.RetentionPolicy.LIMITS,
                duplicate_window=DUPLICATE_WINDOW_S,
                max_msg_size=MAX_PAYLOAD,
            )
        )
        await self._ensure(
            api.StreamConfig(
                name=subjects.RESULTS_STREAM,
                subjects=[subjects.RESULTS_ALL],
                storage=api.StorageType.FILE,
                retention=api.RetentionPolicy.LIMITS,
                max_age=results_max_age_s,
                max_msg_size=MAX_PAYLOAD,
                allow_direct=True,
            )
        )

    async def _ensure(self, config: api.StreamConfig) -> None:
        assert config.name is not None
        try:
            await self.js.stream_info(config.name)
        except NotFoundError:
            await self.js.add_stream(config)

    async def publish(self, subject: str, payload: bytes, msg_id: str | None = None) -> api.PubAck:
        """Append to a stream and wait until it is durable. ``msg_id`` de-duplicates retries."""
        with telemetry.tracer.start_as_current_span(
            f"publish {subjects.template(subject)}",
            kind=SpanKind.PRODUCER,
            attributes=_messaging(subject, "publish"),
        ) as span:
            # Every append has a message id, the caller's or a fresh one, so that one sent again
            # after a reconnection is stored once.
            headers = {api.Header.MSG_ID.value: msg_id or uuid.uuid4().hex}
            telemetry.inject(headers)
            ack = await self.resent_after_reconnect(
                lambda: self.js.publish(subject, payload, headers=headers)
            )
            span.set_attribute("messaging.message.id", str(ack.seq))
            return ack

    async def get(self, stream: str, seq: int) -> bytes:
        msg = await self.resent_after_reconnect(lambda: self.js.get_msg(stream, seq))
        return msg.data or b""

    async def get_message(self, stream: str, seq: int) -> tuple[bytes, Context, int]:
        """A stored message by sequence: its payload, the trace context its headers carry with
        this reader's receive span in it (its work's spans start under it), and when the stream
        stored it (unix ns; 0 if unknown)."""
        msg = await self.resent_after_reconnect(lambda: self.js.get_msg(stream, seq))
        stored = int(msg.time.timestamp() * 1e9) if msg.time is not None else 0
        subject, now = msg.subject or "", time.time_ns()
        span = telemetry.tracer.start_span(
            f"receive {subjects.template(subject)}",
            context=telemetry.extract(msg.headers),
            kind=SpanKind.CONSUMER,
            attributes={
                **_messaging(subject, "receive"),
                "messaging.message.id": str(seq),
            },
            start_time=now,
        )
        span.end(end_time=now)
        return msg.data or b"", set_span_in_context(span), stored

    async def last_seq(self, stream: str) -> int:
        info = await self.resent_after_reconnect(lambda: self.js.stream_info(stream))
        return int(info.state.last_seq)

    async def follow(
        self,
        stream: str,
        subject: str,
        handler: Callable[[int, bytes], Awaitable[None]],
        *,
        start_seq: int = 1,
        window: int = follower.WINDOW,
        window_bytes: int = follower.WINDOW_BYTES,
    ) -> follower.Follower:
        """Deliver every message of ``subject`` from the start of ``stream`` (or from stream
        sequence ``start_seq``), in order, then keep delivering new ones (each process reads the
        log for itself). Pull-based: at most ``window`` messages and ``window_bytes`` bytes are
        held for the handler at once, however long the log and however slow the handler
        (tinsmith/follower.py); ``Follower.stop`` ends it."""
        reader = follower.Follower(
            self,
            stream,
            subject,
            handler,
            start_seq=start_seq,
            window=window,
            window_bytes=window_bytes,
        )
        await reader.start()
        return reader

    async def consume(
        self,
        stream: str,
        durable: str,
        subject: str,
        handler: Callable[[list[Delivery]], Awaitable[None]],
        *,
        batch: int,
        ack_wait_s: float,
        room: Callable[[], Awaitable[int]] | None = None,
    ) -> WorkQueue:
        """Work through a durable consumer shared by every replica of a service: each message
        goes to one replica, and one that is not acked within ``ack_wait_s`` is delivered again,
        at most ``workqueue.MAX_DELIVER`` times in all (tinsmith/workqueue.py).

        A replica asks for up to ``batch`` messages at a time; with ``room``, for up to what
        ``await room()`` returns (it waits until there is room), so a replica takes only what it
        can start on and leaves the rest to the others. ``WorkQueue.stop`` takes no more."""
        queue = WorkQueue(
            self, stream, durable, subject, handler, batch=batch, ack_wait_s=ack_wait_s, room=room
        )
        await queue.start()
        return queue

    async def serve(self, subject: str, handler: Callable[[bytes], Awaitable[bytes]]) -> None:
        """Answer requests on ``subject``; replicas share them through a queue group."""

        async def on_msg(msg: Msg) -> None:
            with telemetry.tracer.start_as_current_span(
                f"process {subject}",
                context=telemetry.extract(msg.headers),
                kind=SpanKind.SERVER,
                attributes=_messaging(subject, "process"),
            ):
                try:
                    reply = await handler(msg.data)
                except Exception:
                    log.exception("handler for %s failed", subject)
                    return
            await msg.respond(reply)

        await self.nc.subscribe(subject, queue=subject, cb=on_msg)

    async def notify(self, subject: str, payload: bytes) -> None:
        """Fire-and-forget on core NATS: for signals whose loss is harmless (heartbeats)."""
        await self.nc.publish(subject, payload)

    async def listen(self, subject: str, handler: Callable[[bytes], Awaitable[None]]) -> None:
        """Receive every ``notify`` on ``subject`` (each replica gets each message)."""

        async def on_msg(msg: Msg) -> None:
            await handler(msg.data)

        await self.nc.subscribe(subject, cb=on_msg)

    async def request(
        self, subject: str, payload: bytes, timeout: float = 10.0, *, repeatable: bool = False
    ) -> bytes:
        """Ask the service behind ``subject``; its absence is transient (Unavailable), which
        clients retry. While no one answers (the service restarts), the request is sent again
        until ``timeout``: no one had it. A ``repeatable`` request (a read, or a change that
        does nothing the second time) is also sent again when an attempt is not answered in
        ``FIRST_ATTEMPT_S`` (doubling) or the connection is made again: the one who had it may
        have died with it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        attempt_s = FIRST_ATTEMPT_S if repeatable else timeout
        with telemetry.tracer.start_as_current_span(
            f"send {subject}", kind=SpanKind.CLIENT, attributes=_messaging(subject, "send")
        ):
            headers: dict[str, str] = {}
            telemetry.inject(headers)
            while True:
                left = deadline - loop.time()
                wait_s = max(0.001, min(attempt_s, left))

                def send(wait_s: float = wait_s) -> Awaitable[Msg]:
                    return self.nc.request(
                        subject, payload, timeout=wait_s, headers=headers or None
                    )

                try:
                    msg = await (self.resent_after_reconnect(send) if repeatable else send())
                    return msg.data
                except NoRespondersError as exc:
                    if left <= NO_RESPONDERS_RETRY_S:
                        raise Unavailable(
                            f"no service answers {subject} yet; retry shortly"
                        ) from exc
                    await asyncio.sleep(NO_RESPONDERS_RETRY_S)
                except NatsTimeoutError as exc:
                    if not repeatable or loop.time() >= deadline - 0.01:
                        raise Unavailable(
                            f"{subject} was not answered within {timeout:.0f} s; retry shortly"
                        ) from exc
                    attempt_s *= 2

    def spawn(self, coro: Awaitable[None]) -> asyncio.Future[None]:
        """Run a background task owned by this connection; it is cancelled on close (or by its
        owner, which the task is returned to)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


async def ended(tasks: Iterable[asyncio.Future[Any]], timeout_s: float) -> set[asyncio.Future[Any]]:
    """Cancel ``tasks`` and wait up to ``timeout_s`` for them to end, whatever they end with;
    return those that have not (some swallow a cancel: nats-py's fetch; a SQLAlchemy aiosqlite
    connection cancelled as it opens never ends its close)."""
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return set()
    _, running = await asyncio.wait(pending, timeout=timeout_s)
    return running


def _messaging(subject: str, operation: str) -> dict[str, str]:
    return {
        "messaging.system": "nats",
        "messaging.operation.type": operation,
        "messaging.destination.name": subject,
    }
