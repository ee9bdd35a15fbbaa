"""Subjects, ids and tinker:// paths: what becomes a subject token or a storage key is checked."""

from __future__ import annotations

import pytest

from tinsmith import artifacts, subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith.failures import InvalidRequest


def test_event_subjects_per_aggregate() -> None:
    assert subjects.event_subject("run", "S:train:0") == "tinsmith.events.run.S:train:0"
    assert subjects.events_of("sampler") == "tinsmith.events.sampler.>"
    assert subjects.result_subject("S:train:0:4") == "tinsmith.results.S:train:0:4"


def test_cancellations_have_a_subject_below_their_sampler_that_samplers_follow_alone() -> None:
    subject = subjects.event_subject("sampler", "S:sample:0", "request_cancelled")
    assert subject == "tinsmith.events.sampler.S:sample:0.cancelled"
    assert subjects.SAMPLES_CANCELLED == "tinsmith.events.sampler.*.cancelled"
    assert subjects.template(subject) == "tinsmith.events.sampler.*.cancelled"
    # Still one of the sampler's events, for everything that follows all of them.
    assert subjects.events_of("sampler").removesuffix(">") in subject
    assert subjects.event_subject("sampler", "S:sample:0", "request_completed") == (
        "tinsmith.events.sampler.S:sample:0"
    )


@pytest.mark.parametrize("bad", ["a.b", "a b", "*", ">", "", "x" * 201, "run\n", "run\r\n"])
def test_ids_that_would_break_a_subject_are_refused(bad: str) -> None:
    with pytest.raises(InvalidRequest, match="not a valid id"):
        subjects.event_subject("run", bad)


def test_unknown_aggregates_are_a_programming_error() -> None:
    with pytest.raises(ValueError):
        subjects.event_subject("nope", "x")


def test_tinker_paths_round_trip_to_keys() -> None:
    path = artifacts.parse("tinker://S:train:0/sampler_weights/step-3")
    assert path.kind == bus.CHECKPOINT_KIND_SAMPLER
    assert str(path) == "tinker://S:train:0/sampler_weights/step-3"
    assert path.key == "runs/S:train:0/sampler_weights/step-3"


@pytest.mark.parametrize(
    "bad",
    [
        "http://x/weights/a",
        "tinker://S/weights",
        "tinker://S/other/a",
        "tinker://S/weights/..",
        "tinker://S/weights/a/b",
        "tinker://a.b/weights/c",
        "tinker://S/weights/step1\n",
        "tinker://S\n/weights/step1",
    ],
)
def test_malformed_tinker_paths_are_refused(bad: str) -> None:
    with pytest.raises(InvalidRequest):
        artifacts.parse(bad)


@pytest.mark.parametrize("bad", ["step1\n", "\nstep1", "a\x00", "", ".", "x" * 129])
def test_checkpoint_names_must_match_whole(bad: str) -> None:
    """A regex's ``$`` matches before a final newline: names are checked with a full match."""
    with pytest.raises(InvalidRequest, match="not accepted"):
        artifacts.check_name(bad)
