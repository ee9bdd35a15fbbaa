"""The work queues: durable JetStream pull consumers that a service's replicas share.

Owns: creating (or updating) a durable consumer, keeping pull requests open on it, and handing
each message to the service the moment it arrives, as a ``Delivery`` the service acks once the
work's outcome is durable. Also the bound on redelivery: a message is delivered at most
``MAX_DELIVER`` times, and the last delivery says so (``Delivery.last``), so that the service
records a failure for it instead of running it once more: a request that kills or stalls every
worker that takes it ends failed, never dropped and never looping.

Does not own: what the messages mean (the services), or the connection (tinsmith/bus.py).

Why not nats-py's ``fetch``: a fetch of a batch returns only when the batch is full, a status
ends it, or its timeout passes. A pull request left on the server by an earlier fetch (one that
timed out on a starved client) can take a message, and then the current fetch holds that message
until its own request expires: measured, training steps that took exactly the 30 s of the fetch
timeout on a busy machine. Here pull requests only grant credit, and every message that arrives
on the consumer's inbox, for whichever request, is handed over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, set_span_in_context

from tinsmith import subjects, telemetry
from tinsmith.failures import InternalError

if TYPE_CHECKING:
    from tinsmith.bus import Bus

log = logging.getLogger(__name__)

# How many times JetStream delivers a message at most. A worker that gets a message for the last
# time records a failure for it instead of running it (``Delivery.last``): the earlier deliveries
# all ended without an outcome (their workers died, stalled past the ack wait, or handed the
# work back on a stop), so the request is failed rather than tried forever.
MAX_DELIVER = 5
# A pull request asks for this long at most; new ones replace it as it expires. Messages never
# wait for it: they are handed over as they arrive.
_PULL_EXPIRES_S = 10.0
# After its expiry, a pull request the server never confirmed the end of is forgotten this late.
_PULL_GRACE_S = 1.0
_STATUS = api.Header.STATUS.value
_HEARTBEAT = "100"
_EXPIRED = "408"


class Delivery:
    """One message of a work queue. The handler acks it once its effect is durable, or naks it
    to hand it back; a replica that neither acks nor extends it (``in_progress``) within the ack
    wait loses it to another replica."""

    def __init__(self, msg: Msg, max_deliver: int = MAX_DELIVER) -> None:
        self._msg = msg
        metadata = msg.metadata
        self.stream_seq = int(metadata.sequence.stream)
        self.num_delivered = int(metadata.num_delivered or 1)
        self.max_deliver = max_deliver
        # When JetStream stored the message (unix ns): where a request's queue wait starts.
        stored = metadata.timestamp
        self.published_ns = int(stored.timestamp() * 1e9) if stored is not None else 0
        self.received_ns = time.time_ns()
        self._data: bytes | None = msg.data
        msg.data = b""  # the payload has one owner: this object, until it is released

    @property
    def data(self) -> bytes:
        """The payload; after ``release`` it must be read again from the stream (by
        ``stream_seq``)."""
        if self._data is None:
            raise RuntimeError(f"the payload of message {self.stream_seq} was released")
        return self._data

    @property
    def released(self) -> bool:
        return self._data is None

    def release(self) -> None:
        """Drop the payload from memory while the message waits its turn (it stays in the
        stream: read it again by ``stream_seq`` then)."""
        self._data = None

    @property
    def last(self) -> bool:
        """Whether JetStream will not deliver this message again: its earlier deliveries all
        ended without an outcome, so the work should be failed now rather than tried."""
        return self.num_delivered >= self.max_deliver

    @functools.cached_property
    def trace(self) -> Context:
        """The trace the message belongs to, with this consumer's receive span in it: spans of
        its work start under it. Made on first use, so messages a handler only acks (events it
        has no work for) add nothing to the traces."""
        subject = self._msg.subject
        span = telemetry.tracer.start_span(
            f"receive {subjects.template(subject)}",
            context=telemetry.extract(self._msg.headers),
            kind=SpanKind.CONSUMER,
            attributes={
                "messaging.system": "nats",
                "messaging.operation.type": "receive",
                "messaging.destination.name": subject,
                "messaging.message.id": str(self.stream_seq),
                "messaging.nats.delivery_count": self.num_delivered,
            },
            start_time=self.received_ns,
        )
        span.end(end_time=self.received_ns)
        return set_span_in_context(span)

    async def ack(self) -> None:
        await self._msg.ack()

    async def nak(self, delay: float | None = None) -> None:
        await self._msg.nak(delay=delay)

    async def in_progress(self) -> None:
        """Tell JetStream the work is still going on, so it is not redelivered meanwhile."""
        await self._msg.in_progress()


def exhausted(delivery: Delivery, request_id: str) -> InternalError:
    """The failure a worker records for a request on its last delivery, instead of running it."""
    return InternalError(
        f"request {request_id} was taken {delivery.num_delivered} times by workers that stopped "
        "before recording its outcome (they crashed, stalled past the ack wait or were stopped); "
        "it is failed so that it cannot take down more of them. If it did not cause that, send "
        "it again"
    )


@dataclass
class _Pull:
    """A pull request the server may still be filling."""

    deadline: float  # monotonic: when it expires (plus grace)
    remaining: int


Handler = Callable[[list[Delivery]], Awaitable[None]]
Room = Callable[[], Awaitable[int]]


class WorkQueue:
    """One replica's side of a durable pull consumer: pull requests kept open for as much work as
    the replica takes (``batch``, or what ``room`` allows), and every message passed to
    ``handler`` as soon as it arrives, in order."""

    def __init__(
        self,
        bus: Bus,
        stream: str,
        durable: str,
        subject: str,
        handler: Handler,
        *,
        batch: int,
        ack_wait_s: float,
        room: Room | None = None,
        max_deliver: int = MAX_DELIVER,
    ) -> None:
        self.bus = bus
        self.stream = stream
        self.durable = durable
        self.config = api.ConsumerConfig(
            durable_name=durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_deliver=max_deliver,
            max_ack_pending=-1,
            deliver_policy=api.DeliverPolicy.ALL,
            filter_subject=subject,
        )
        self.handler = handler
        self.batch = batch
        self.room = room
        self.max_deliver = max_deliver
        self._pulls: deque[_Pull] = deque()
        self._arrived: asyncio.Queue[Msg] = asyncio.Queue()
        self._changed = asyncio.Event()
        self._inbox = ""
        self._subscription: Subscription | None = None
        self._stopped = False

    async def start(self) -> None:
        # Create the consumer, or bring an existing one to this configuration (ack wait,
        # redelivery bound): the settings of a data directory made by an older version apply
        # as soon as a replica starts.
        await self.bus.js.add_consumer(self.stream, self.config)
        self._inbox = self.bus.nc.new_inbox()
        self._subscription = await self.bus.nc.subscribe(self._inbox, cb=self._on_msg)
        self.bus.on_reconnect(self._on_reconnect)
        self.bus.spawn(self._pull_loop())
        self.bus.spawn(self._handle_loop())

    async def stop(self) -> None:
        """Take no more work: the open pull requests end with the inbox (the server drops a pull
        request whose inbox nobody listens to), and what arrived but was not handed over yet goes
        back at once. What the service holds is its own to hand back (``Delivery.nak``), for
        another replica now: nothing here can take it again."""
        self._stopped = True
        self.bus.off_reconnect(self._on_reconnect)
        self._changed.set()
        if self._subscription is not None:
            await self._subscription.unsubscribe()
        while not self._arrived.empty():
            with contextlib.suppress(Exception):
                await self._arrived.get_nowait().nak()

    def _on_reconnect(self) -> None:
        """The connection was made again: a restarted server forgot the open pull requests (and
        one that did not would send to the inbox of the lost connection). Ask again now, not
        when they would have expired."""
        self._pulls.clear()
        self._changed.set()

    async def _on_msg(self, msg: Msg) -> None:
        status = (msg.headers or {}).get(_STATUS)
        if status == _HEARTBEAT:
            return
        if status == _EXPIRED:
            # The oldest pull request expired (they all live equally long, so they expire in
            # the order they were made): what it still asked for will not come.
            if self._pulls:
                self._pulls.popleft()
            self._changed.set()
            return
        if status:
            # Refused or cut short (the server's bound on waiting requests, a consumer change):
            # ask again for everything, at worst a little more than the replica takes.
            description = (msg.headers or {}).get(api.Header.DESCRIPTION.value, "")
            log.warning("pull requests on %s ended: %s %s", self.durable, status, description)
            self._pulls.clear()
            self._changed.set()
            return
        while self._pulls and self._pulls[0].remaining <= 0:
            self._pulls.popleft()
        if self._pulls:
            self._pulls[0].remaining -= 1
        self._arrived.put_nowait(msg)
        self._changed.set()

    async def _pull_loop(self) -> None:
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.durable}"
        while not self.bus.closing and not self._stopped:
            wanted = self.batch if self.room is None else min(self.batch, await self.room())
            now = time.monotonic()
            while self._pulls and (self._pulls[0].deadline <= now or self._pulls[0].remaining <= 0):
                self._pulls.popleft()  # ended long ago, or filled: the server owes nothing
            asked = sum(pull.remaining for pull in self._pulls)
            if wanted > asked and not self.bus.closing and not self._stopped:
                request = {"batch": wanted - asked, "expires": int(_PULL_EXPIRES_S * 1e9)}
                try:
                    await self.bus.nc.publish(
                        subject, json.dumps(request).encode(), reply=self._inbox
                    )
                    expiry = now + _PULL_EXPIRES_S + _PULL_GRACE_S
                    self._pulls.append(_Pull(expiry, wanted - asked))
                except Exception:
                    if self.bus.closing:
                        return
                    log.exception("could not ask %s for work; retrying", self.durable)
                    await asyncio.sleep(0.5)
                    continue
            self._changed.clear()
            timeout = (self._pulls[0].deadline - time.monotonic()) if self._pulls else 1.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(0.01, timeout))

    async def _handle_loop(self) -> None:
        while True:
            msgs = [await self._arrived.get()]
            while not self._arrived.empty():
                msgs.append(self._arrived.get_nowait())
            deliveries = [Delivery(msg, self.max_deliver) for msg in msgs]
            try:
                await self.handler(deliveries)
            except Exception:
                # A bug in a handler must not stop the queue; the messages it did not settle
                # come back after the ack wait, and their redelivery is bounded.
                log.exception("the handler of %s failed", self.durable)
