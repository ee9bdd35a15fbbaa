"""The streaming relay (gRPC SampleStream, the OpenAI routes' events): each token reaches the
client once and in order, a lost message is filled in by the last one from the stored result,
and a rerun that drew other tokens is an error rather than a wrong answer."""

from __future__ import annotations

import numpy as np
import pytest

from services.gateway.streams import Relay
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import service_pb2 as svc
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InternalError

TOKENS = [7, 8, 9, 10, 11]
LOGPROBS = [-0.5, -1.0, -1.5, -2.0, -2.5]


def _progress(offset: int, end: int, tokens: list[int] = TOKENS) -> bus.SampleProgress:
    delta = svc.SampleDelta(
        index=0,
        offset=offset,
        tokens=np.asarray(tokens[offset:end], "<i4").tobytes(),
        logprobs=np.asarray(LOGPROBS[offset:end], "<f4").tobytes(),
    )
    return bus.SampleProgress(request_id="S:sample:0:0", deltas=[delta])


def _stored() -> tp.SampleResponse:
    sequence = tp.SampledSequence(
        stop_reason=tp.STOP_REASON_LENGTH,
        tokens=np.asarray(TOKENS, "<i4").tobytes(),
        logprobs=np.asarray(LOGPROBS, "<f4").tobytes(),
    )
    return tp.SampleResponse(sequences=[sequence])


def _received(chunks: list[svc.SampleChunk | None]) -> tuple[list[int], list[float]]:
    tokens: list[int] = []
    logprobs: list[float] = []
    for chunk in chunks:
        for delta in chunk.deltas if chunk is not None else ():
            assert delta.offset == len(tokens)
            tokens += np.frombuffer(delta.tokens, "<i4").tolist()
            logprobs += np.frombuffer(delta.logprobs, "<f4").tolist()
    return tokens, logprobs


def test_a_lost_message_is_filled_in_by_the_last_one() -> None:
    relay = Relay()
    first = relay.forward(_progress(0, 2))
    assert relay.forward(_progress(3, 4)) is None  # 2 was lost: nothing out of order
    last = relay.last(_stored())
    assert _received([first, last]) == (TOKENS, LOGPROBS)
    assert last.response.sequences[0].stop_reason == tp.STOP_REASON_LENGTH
    assert not last.response.sequences[0].tokens


def test_a_rerun_from_the_start_repeats_nothing() -> None:
    relay = Relay()
    chunks = [relay.forward(_progress(0, 3)), relay.forward(_progress(0, 4))]
    chunks.append(relay.last(_stored()))
    assert _received(chunks) == (TOKENS, LOGPROBS)


def test_a_rerun_that_drew_other_tokens_is_an_error() -> None:
    relay = Relay()
    relay.forward(_progress(0, 3))
    assert relay.forward(_progress(0, 4, tokens=[7, 99, 9, 10, 11])) is None
    with pytest.raises(InternalError, match="drew other tokens"):
        relay.last(_stored())
