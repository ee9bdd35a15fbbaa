"""Streamed sampling: a request's tokens relayed as the sampler generates them, for any face that
streams (gRPC's SampleStream, the OpenAI routes' server-sent events).

The sampler publishes each step's new tokens of a request accepted with ``stream`` to the gateway
replica that accepted it (``Gateway.watch``). Those messages are fire-and-forget: one can be lost,
and a request that ran again after a sampler replica died sends its tokens again from the start.
``Relay`` turns them into each token exactly once and in order, and its last message comes from
the stored result, so what a client concatenates is exactly what a plain sample answers.

Owns: the relay and the loop that waits on progress and the result together. Does not own:
accepting or cancelling the request (the faces do, each with its own deadline and reasons).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import numpy as np

from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import service_pb2 as svc
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InternalError
from tinsmith.tenants import Tenant

from .handlers import Gateway


class Relay:
    """What one streamed call has sent of each sequence, so that it forwards each token once
    and in order, and ends with exactly what the stored result holds."""

    def __init__(self) -> None:
        self.sent: dict[int, list[int]] = {}
        self.diverged = False  # a rerun of the request drew other tokens than those sent
        self.messages = 0

    def forward(self, progress: bus.SampleProgress) -> svc.SampleChunk | None:
        """The part of the sampler's news not sent yet: a delta that starts past what was sent
        (one before it was lost) is left for the last message; one that overlaps what was sent
        (the request ran again after a replica died) is checked against it."""
        chunk = svc.SampleChunk()
        for delta in progress.deltas:
            sent = self.sent.setdefault(delta.index, [])
            tokens = np.frombuffer(delta.tokens, "<i4")
            known = len(sent) - delta.offset
            if known < 0 or self.diverged:
                continue
            if tokens[:known].tolist() != sent[delta.offset :]:
                self.diverged = True
                continue
            if known >= len(tokens):
                continue
            chunk.deltas.add(
                index=delta.index,
                offset=len(sent),
                tokens=tokens[known:].tobytes(),
                logprobs=np.frombuffer(delta.logprobs, "<f4")[known:].tobytes(),
            )
            sent.extend(tokens[known:].tolist())
        if not chunk.deltas:
            return None
        self.messages += 1
        return chunk

    def last(self, response: tp.SampleResponse) -> svc.SampleChunk:
        """The last message: each sequence's tokens not sent yet, and the rest of the answer."""
        chunk = svc.SampleChunk()
        for index, sequence in enumerate(response.sequences):
            tokens = np.frombuffer(sequence.tokens, "<i4")
            sent = self.sent.get(index, [])
            if self.diverged or tokens[: len(sent)].tolist() != sent:
                raise InternalError(
                    "the request ran again on another sampler replica (one stopped mid-request) "
                    "and drew other tokens than those streamed; its stored result is final: ask "
                    "for the same request again (gRPC: Sample with the same seq_id) to get it"
                )
            if len(tokens) > len(sent):
                chunk.deltas.add(
                    index=index,
                    offset=len(sent),
                    tokens=tokens[len(sent) :].tobytes(),
                    logprobs=np.frombuffer(sequence.logprobs, "<f4")[len(sent) :].tobytes(),
                )
            sequence.ClearField("tokens")
            sequence.ClearField("logprobs")
        chunk.response.CopyFrom(response)
        self.messages += 1
        return chunk


async def relayed(
    gateway: Gateway,
    tenant: Tenant,
    request_id: str,
    progress: asyncio.Queue[bus.SampleProgress],
    timeout: float | None,
) -> AsyncGenerator[svc.SampleChunk, None]:
    """The chunks of a streamed request accepted with ``stream`` and watched through
    ``progress`` (``Gateway.watch``, entered before it was accepted): each step's new tokens as
    they come, then the last chunk, built from the stored result, whose ``response`` holds the
    rest of the answer. Waiting longer than ``timeout`` raises ``TimeoutError``; the caller
    cancels the request if it stops before the last chunk."""
    relay = Relay()
    settled = asyncio.ensure_future(gateway.result(tenant, request_id, timeout))
    arrival: asyncio.Future[bus.SampleProgress] | None = None
    try:
        while not settled.done():
            arrival = asyncio.ensure_future(progress.get())
            await asyncio.wait({arrival, settled}, return_when=asyncio.FIRST_COMPLETED)
            if arrival.done():
                chunk = relay.forward(arrival.result())
                if chunk is not None:
                    yield chunk
        body, _ = settled.result()
    finally:
        settled.cancel()
        if arrival is not None:
            arrival.cancel()  # what it would have got is in the stored result
    yield relay.last(tp.SampleResponse.FromString(body))
