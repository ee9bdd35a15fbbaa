"""bench.duty_cycle's arithmetic and picture, on synthetic spans (no system): busy time is the
union of an engine's ``compute`` spans, and utilisation is the share of a window it covers."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.duty_cycle import (
    NS,
    SAMPLER,
    TRAINER,
    JobShape,
    Phase,
    Step,
    busy_intervals,
    clip,
    fit_reward_delay,
    render,
    trainer_seconds,
    uncovered,
    union,
    utilisation,
    waiting_intervals,
)
from bench.otlp import Span


def _span(
    service: str,
    start: int,
    end: int,
    name: str = "compute",
    trace: str = "t" * 32,
    links: tuple[tuple[str, str], ...] = (),
) -> Span:
    return Span(trace, "s" * 16, "", name, "INTERNAL", start, end, service, links=links)


def test_union_merges_overlapping_and_touching_intervals_and_drops_empty_ones() -> None:
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9), (8, 6)]) == [(0, 4), (5, 7)]
    assert union([(0, 10), (2, 3), (4, 5)]) == [(0, 10)]
    assert union([]) == []


def test_clip_cuts_the_union_to_the_window() -> None:
    assert clip([(0, 4), (3, 6), (8, 12), (20, 30)], (2, 10)) == [(2, 6), (8, 10)]
    assert clip([(0, 2)], (2, 10)) == []  # ends where the window starts


def test_utilisation_counts_overlapping_spans_once() -> None:
    # Three overlapping requests (continuous batching) and one alone: 0-4 and 6-7 of 0-10.
    spans = [(0, 3), (1, 4), (2, 3), (6, 7)]
    assert utilisation(spans, (0, 10)) == pytest.approx(0.5)
    assert utilisation(spans, (2, 6)) == pytest.approx(0.5)
    assert utilisation([], (0, 10)) == 0.0
    assert utilisation([(-5, 50)], (0, 10)) == 1.0
    with pytest.raises(ValueError, match="empty window"):
        utilisation(spans, (3, 3))


def test_busy_intervals_take_only_the_services_compute_spans() -> None:
    spans = [
        _span(TRAINER, 0, 2),
        _span(TRAINER, 1, 3),
        _span(TRAINER, 5, 9, name="trainer forward_backward"),  # not compute: ignored
        _span(SAMPLER, 4, 6),
        _span("tinsmith-gateway", 0, 10),
    ]
    assert busy_intervals(spans, TRAINER) == [(0, 3)]
    assert busy_intervals(spans, SAMPLER) == [(4, 6)]


def _phase(jobs: int, start: int, busy_every_s: float) -> Phase:
    """A 10 s phase in which the trainer computes 0.5 s out of every ``busy_every_s``."""
    window = (start, start + 10 * NS)
    period = int(busy_every_s * NS)
    trainer = [(t, t + NS // 2) for t in range(start, window[1], period)]
    sampler = [(t + NS // 2, t + NS) for t in range(start, window[1], period)]
    steps = [
        [
            Step(t, (t + NS, t + 2 * NS), t + period)
            for t in range(start + i * NS, window[1], period)
        ]
        for i in range(jobs)
    ]
    return Phase(jobs, window, steps, trainer, sampler)


def test_the_phase_reports_its_shares_and_the_steps_inside_its_window() -> None:
    phase = _phase(1, 1_000 * NS, busy_every_s=2.5)
    assert phase.seconds == 10.0
    assert phase.trainer_share == pytest.approx(0.2)  # 0.5 s in every 2.5 s
    assert phase.sampler_share == pytest.approx(0.2)
    assert phase.steps_done == 4  # ending at 2.5, 5, 7.5 and 10 s

    late = Phase(
        1, phase.window, [[*phase.steps[0], Step(phase.window[1], (0, 0), phase.window[1] + 1)]]
    )
    assert late.steps_done == 4  # a step that ends after the window is not counted


def test_the_trainer_is_asked_at_most_its_jobs_steps_at_their_pace_alone() -> None:
    phase = _phase(1, 1_000 * NS, busy_every_s=2.5)  # 4 steps, the trainer busy 2 s of 10
    # 0.5 s of the trainer a step; a job alone steps every 2.5 s: it asks for at most 20%.
    assert phase.trainer_offered(2.5) == pytest.approx(0.2)
    eight = Phase(8, phase.window, phase.steps, trainer=phase.trainer)
    assert eight.trainer_offered(2.5) == pytest.approx(1.0)  # 160% asked: all of it
    assert eight.trainer_offered(10.0) == pytest.approx(0.4)


def test_the_fitted_grader_makes_the_most_jobs_ask_for_all_of_the_trainer() -> None:
    # A step alone (no grader) of 0.3 s: the trainer busy 0.04 s in it, and 0.05 s of a piece
    # that straddles its end; another step's trainer time does not count.
    step = Step(10 * NS, (0, 0), 10 * NS + 300_000_000)
    trainer = [(10 * NS, 10 * NS + 40_000_000), (10 * NS + 250_000_000, 10 * NS + 350_000_000)]
    trainer.append((20 * NS, 21 * NS))
    assert trainer_seconds(trainer, step) == pytest.approx(0.09)
    # Eight jobs at a step alone's pace ask for 8 x 0.1 s of the trainer every 0.3 s + delay.
    assert fit_reward_delay(0.3, 0.1, 8) == pytest.approx(0.5)
    assert fit_reward_delay(0.3, 0.1, 4) == pytest.approx(0.1)
    # Steps whose other work leaves the trainer idle enough already: no grader.
    assert fit_reward_delay(2.0, 0.1, 8) == 0.0


def test_fairness_is_the_slowest_job_s_mean_step_over_the_fastest_s() -> None:
    window = (0, 10 * NS)
    # Steps of 2 s and 2 s (mean 2), of 3 s (mean 3); one that ends after the window: not counted.
    steps = [
        [Step(0, (0, 0), 2 * NS), Step(2 * NS, (0, 0), 4 * NS)],
        [Step(0, (0, 0), 3 * NS), Step(3 * NS, (0, 0), 11 * NS)],
    ]
    assert Phase(2, window, steps).fairness == pytest.approx(1.5)
    assert Phase(1, window, steps[:1]).fairness == 1.0
    assert Phase(2, window, [steps[0], []]).fairness == 1.0  # nothing to compare with


def test_the_picture_is_a_small_png(tmp_path: Path) -> None:
    phases = [_phase(1, 0, 2.5), _phase(2, 100 * NS, 1.25), _phase(3, 200 * NS, 1.0)]
    out = tmp_path / "duty.png"
    render(phases, JobShape("tinsmith/small", 8, 32, 8, 2.0, 0.25), out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert 10_000 < len(data) < 150_000


def test_a_request_waits_from_its_acceptance_to_the_compute_that_served_it() -> None:
    spans = [
        _span(TRAINER, 0, 4, "queue_wait", trace="a"),  # then computed 6-8
        _span(TRAINER, 6, 8, trace="a"),
        _span(TRAINER, 1, 2, "queue_wait", trace="b"),  # fused into c's pass, 10-12
        _span(TRAINER, 3, 5, "queue_wait", trace="c"),
        _span(TRAINER, 10, 12, trace="c", links=(("b", "s" * 16),)),
        _span(TRAINER, 20, 21, "queue_wait", trace="d"),  # never served: not counted
        _span(SAMPLER, 30, 31, "queue_wait", trace="e"),  # another service's
        _span(SAMPLER, 32, 33, trace="e"),
    ]
    assert waiting_intervals(spans, TRAINER) == [(0, 10)]
    assert waiting_intervals(spans, SAMPLER) == [(30, 32)]


def test_uncovered_is_the_share_of_the_window_waiting_outside_the_busy_time() -> None:
    waiting, busy = [(0, 10), (12, 14)], [(2, 3), (5, 8), (9, 13)]
    # Waiting but idle: 0-2, 3-5, 8-9, 13-14: 6 of 20.
    assert uncovered(waiting, busy, (0, 20)) == pytest.approx(0.3)
    assert uncovered(waiting, busy, (4, 9)) == pytest.approx(2 / 5)  # 4-5, 8-9
    assert uncovered(waiting, [], (0, 20)) == pytest.approx(0.6)
    assert uncovered([], busy, (0, 20)) == 0.0
