"""examples/rest.py's busy share of a time span, from an engine replica's report points as
``GET /api/v1/engines`` gives them: ``[time, share]`` of the interval since the point before,
the first one's since ``busy_since``."""

from __future__ import annotations

import pytest

from examples.rest import busy_share

# Reports at 100, 102, 104 and 106: busy half of the first interval, all of the second, none of
# the third.
SINCE = 100.0
POINTS = [[102.0, 0.5], [104.0, 1.0], [106.0, 0.0]]


def test_a_span_within_the_first_interval_counts_once_its_start_is_known() -> None:
    """A sweep shorter than the reports' period, right after the engine began to report, lies
    in its first interval alone: without ``busy_since`` it had no share at all."""
    assert busy_share(POINTS, 100.5, 101.5) is None
    assert busy_share(POINTS, 100.5, 101.5, SINCE) == 0.5


def test_each_interval_weighs_by_how_much_of_the_span_it_covers() -> None:
    # 101 to 105: 1 s of the first interval, 2 s of the second, 1 s of the third.
    assert busy_share(POINTS, 101.0, 105.0, SINCE) == pytest.approx((0.5 + 2.0 + 0.0) / 4)
    assert busy_share(POINTS, 107.0, 108.0, SINCE) is None  # after the last report
