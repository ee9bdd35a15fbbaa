"""Reading a stream in order, from any position, with bounded memory: how a process replays the
event log and then keeps following it.

Owns: an ephemeral JetStream pull consumer per reader (no acks, in memory on the server), the
credit it grants (never more messages or bytes than ``window`` and ``window_bytes`` in this
process at once, whatever the handler's speed), handing each message to the handler in stream
order, and recovering from a lost consumer (a reconnection, a gap in its delivery, silence) by
making a new one from the next sequence. Does not own: what the messages mean, or the
connection (tinsmith/bus.py).

Why not nats-py's ordered push consumer, which ``Bus.follow`` used before: it is pushed as fast
as the server reads, and only the client's pending limits stand between a slow handler and the
process's memory. nats-py 2.16 holds its flow-control reply until the handler has taken the
message before it, but answers at once the "consumer stalled" heartbeat that the server sends
while it waits for that reply (``client._process_msg``), so a slow handler lets one more window
in at every heartbeat. Once the subscription's pending bytes pass ``pending_bytes_limit`` (256
MiB for JetStream subscriptions) nats-py drops each further message with a SlowConsumerError,
after it has already counted the message as delivered for its ordering check: the gap is never
seen and the tail of a long replay is lost without a trace. Measured before: a checkpoint service
replaying 180,000 events (256 MB) never became ready; and with the limit lowered to 256 KiB, of
20,000 messages of 1 KB to a handler taking 0.5 ms each, 302 arrived. Here the server sends only
what was asked for, and a new request is made only as the handler frees room.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

from tinsmith.limits import MAX_PAYLOAD

if TYPE_CHECKING:
    from tinsmith.bus import Bus

log = logging.getLogger(__name__)

Handler = Callable[[int, bytes], Awaitable[None]]

# At most this many messages, and this many bytes, are in this process at once for one reader:
# asked for and not yet handled (a single message larger than the bytes is read alone).
WINDOW = 1024
WINDOW_BYTES = 4 * MAX_PAYLOAD
# A pull request waits this long for messages at most (then another replaces it), and asks the
# server for a heartbeat this often while it waits: silence for a few heartbeats means the
# consumer or the request was lost (a server restart, a reconnect), and a new consumer is made.
_EXPIRES_S = 10.0
_HEARTBEAT_S = 2.0
_SILENCE_S = 3 * _HEARTBEAT_S
# The server deletes the consumer of a reader that stopped asking (its process died) this late.
_INACTIVE_S = 300.0
_STATUS = api.Header.STATUS.value
_DESCRIPTION = api.Header.DESCRIPTION.value
# Status codes that end a pull request normally: it expired (408), or it reached its bytes or
# its batch (409 "Message Size Exceeds MaxBytes", "Batch Completed").
_ENDED = {"408", "409"}
_HEARTBEAT = "100"


class Follower:
    """Hands every message of ``subject`` in ``stream`` to ``handler(stream_seq, data)``, one at a
    time in stream order, from ``start_seq`` on, and then each new one as it is stored."""

    def __init__(
        self,
        bus: Bus,
        stream: str,
        subject: str,
        handler: Handler,
        *,
        start_seq: int = 1,
        window: int = WINDOW,
        window_bytes: int = WINDOW_BYTES,
    ) -> None:
        self.bus = bus
        self.stream = stream
        self.subject = subject
        self.handler = handler
        self.next_seq = max(1, start_seq)  # the first stream sequence not yet handled
        self.window = window
        self.window_bytes = window_bytes
        self.restarts = 0  # consumers made again after a loss (for tests and logs)
        self._consumer = ""
        self._expected_dseq = 1  # the consumer sequence of the next message of this consumer
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffered_bytes = 0
        self._asked = 0  # messages the open pull request may still bring (0: none is open)
        self._request = 0  # the number of the latest pull request (its reply subject ends so)
        self._got = 0  # messages the latest pull request brought
        self._oversized = False  # the next message is larger than the window's bytes
        self._asked_at = 0.0
        self._heard_at = 0.0  # monotonic: the last message, heartbeat or status of a request
        self._lost = False  # the consumer must be made again from next_seq
        self._arrived = asyncio.Event()  # wakes the handling loop
        self._changed = asyncio.Event()  # wakes the pull loop: room made, a request ended
        self._stopped = False
        self._subscription: Subscription | None = None
        self._inbox = ""

    @property
    def buffered(self) -> tuple[int, int]:
        """Messages and bytes received and not yet handled."""
        return len(self._buffer), self._buffered_bytes

    async def start(self) -> None:
        await self._new_consumer()
        self.bus.on_reconnect(self._on_reconnect)
        self.bus.spawn(self._pull_loop())
        self.bus.spawn(self._handle_loop())

    async def stop(self) -> None:
        """Hand over nothing more (the message being handled finishes) and delete the consumer."""
        self._stopped = True
        self.bus.off_reconnect(self._on_reconnect)
        self._arrived.set()
        self._changed.set()
        await self._drop_consumer()

    async def _new_consumer(self) -> None:
        """A consumer that starts at ``next_seq``, and an inbox of its own: messages of an earlier
        consumer that are still on their way are told apart by the inbox they come to. Each pull
        request's replies come to a subject of their own under it (``<inbox>.<request>``), so
        that the end of a request is told apart from the end of the one before: the server ends
        a filled batch with a "409 Batch Completed" that may come after the next request was
        made, and taken for that one's end it let a third be asked for while the second was
        still open (a reader allowed 32 messages held 57)."""
        await self._drop_consumer()
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            filter_subject=self.subject,
            inactive_threshold=_INACTIVE_S,
            mem_storage=True,
            num_replicas=1,
            max_waiting=4,
        )
        if self.next_seq > 1:
            config.deliver_policy = api.DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = self.next_seq
        else:
            config.deliver_policy = api.DeliverPolicy.ALL
        info = await self.bus.js.add_consumer(self.stream, config)
        self._consumer = info.name or ""
        self._expected_dseq = 1
        self._inbox = self.bus.nc.new_inbox()
        inbox = self._inbox

        async def on_msg(msg: Msg) -> None:
            self._on_msg(inbox, msg)

        # The pending limits are never reached: the server sends no more than was asked for, and
        # the callback only queues. They are set so that a bug here could not hold more either.
        self._subscription = await self.bus.nc.subscribe(
            f"{inbox}.*",
            cb=on_msg,
            pending_msgs_limit=4 * self.window,
            pending_bytes_limit=4 * self.window_bytes + 2 * MAX_PAYLOAD,
        )
        self._asked = 0
        self._lost = False
        self._heard_at = time.monotonic()

    async def _drop_consumer(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
        consumer, self._consumer = self._consumer, ""
        if consumer and not self.bus.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.bus.js.delete_consumer(self.stream, consumer)
        self._buffer.clear()
        self._buffered_bytes = 0

    def _on_reconnect(self) -> None:
        """The connection was made again: the server may have restarted without this in-memory
        consumer, and the open pull request is lost either way. Start over now rather than
        after a silence."""
        log.info("reading %s: reconnected; making a new consumer at %d", self.stream, self.next_seq)
        self._lost = True
        self._changed.set()

    def _on_msg(self, inbox: str, msg: Msg) -> None:
        if inbox != self._inbox or self._stopped:
            return  # for a consumer given up
        self._heard_at = time.monotonic()
        headers = msg.headers or {}
        status = headers.get(_STATUS)
        if status == _HEARTBEAT:
            return
        current = msg.subject == f"{inbox}.{self._request}"
        if status in _ENDED and not current:
            return  # the end of a request that had already brought all it asked for
        if status in _ENDED:
            if status == "409" and self._got == 0 and "MaxBytes" in headers.get(_DESCRIPTION, ""):
                self._oversized = True  # the next message alone is larger than what was asked
            self._asked = 0
        elif status:
            # The consumer is gone (503: no one answers its pull requests; 409 Consumer
            # Deleted), or the request was refused: start over from what was handled.
            log.warning(
                "reading %s: pull request ended with %s %s; making a new consumer at %d",
                self.stream,
                status,
                headers.get(_DESCRIPTION, "").strip(),
                self.next_seq,
            )
            self._lost = True
        else:
            metadata = msg.metadata
            dseq = int(metadata.sequence.consumer)
            if dseq != self._expected_dseq:  # a message of this consumer went missing
                log.warning(
                    "reading %s: expected message %d of the consumer, got %d; making a new "
                    "consumer at %d",
                    self.stream,
                    self._expected_dseq,
                    dseq,
                    self.next_seq,
                )
                self._lost = True
            else:
                self._expected_dseq = dseq + 1
                data = msg.data or b""
                self._buffer.append((int(metadata.sequence.stream), data))
                self._buffered_bytes += len(data)
                if current:
                    self._asked = max(0, self._asked - 1)
                    self._got += 1
                self._arrived.set()
        self._changed.set()

    async def _pull_loop(self) -> None:
        while not self._stopped and not self.bus.closing:
            try:
                await self._pull_once()
            except Exception:
                if self._stopped or self.bus.closing:
                    return
                log.exception("reading %s: could not ask for more; retrying in 0.5 s", self.stream)
                self._lost = True
                await asyncio.sleep(0.5)

    async def _pull_once(self) -> None:
        self._changed.clear()
        now = time.monotonic()
        if self._asked and now - self._heard_at > _SILENCE_S:
            log.warning(
                "reading %s: nothing heard for %.0f s; making a new consumer at %d",
                self.stream,
                now - self._heard_at,
                self.next_seq,
            )
            self._lost = True
        if self._asked and now - self._asked_at > _EXPIRES_S + _SILENCE_S:
            self._asked = 0  # its end never came: ask again
        if self._lost:
            self.restarts += 1
            await self._new_consumer()
        count, size = self.buffered
        room, room_bytes = self.window - count, self.window_bytes - size
        if self._oversized:
            # One message larger than the window: it comes alone, once the handler has taken
            # everything before it.
            room, room_bytes = (1, 0) if count == 0 else (0, 0)
        elif room * 2 < self.window or room_bytes * 2 < self.window_bytes:
            room = 0  # ask again once half the window is free, not for every message handled
        if not self._asked and room > 0:
            request = {
                "batch": room,
                "max_bytes": room_bytes,
                "expires": int(_EXPIRES_S * 1e9),
                "idle_heartbeat": int(_HEARTBEAT_S * 1e9),
            }
            subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self._consumer}"
            self._asked, self._asked_at, self._heard_at = room, now, now
            self._got, self._oversized = 0, False
            self._request += 1
            reply = f"{self._inbox}.{self._request}"
            await self.bus.nc.publish(subject, json.dumps(request).encode(), reply=reply)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), _HEARTBEAT_S)

    async def _handle_loop(self) -> None:
        while not self._stopped:
            if not self._buffer:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            seq, data = self._buffer.popleft()
            self._buffered_bytes -= len(data)
            if not self._asked:
                self._changed.set()  # room was made: the pull loop may ask for more
            if seq < self.next_seq:
                continue  # handled already, before a new consumer started over
            self.next_seq = seq + 1
            try:
                await self.handler(seq, data)
            except Exception:
                log.exception("reading %s: the handler of message %d failed", self.stream, seq)
