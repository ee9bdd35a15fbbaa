"""The terminal views' layout (``tinsmith runs`` and ``run`` against a running system are in
tests/e2e/test_progress.py)."""

from __future__ import annotations

from tinsmith import watch


def test_a_sparkline_spans_the_values_and_leaves_gaps_for_missing_ones() -> None:
    assert watch.sparkline([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]) == "▁▂▃▄▅▆▇█"
    assert watch.sparkline([3.0, None, float("nan"), 1.0]) == "█  ▁"
    assert watch.sparkline([2.0, 2.0]) == "▁▁"  # flat: no span to scale by
    assert watch.sparkline([None]) == " "
    assert watch.sparkline(list(range(100)), width=10) == watch.sparkline(list(range(90, 100)))


def test_the_run_list_says_how_many_it_shows_of_how_many() -> None:
    run = {
        "training_run_id": "s:train:0",
        "base_model": "m",
        "lora_rank": 8,
        "steps": 0,
        "last_loss": None,
        "status": "training",
        "sweep": "sw",
        "sparkline": [],
    }
    text = watch.runs_text({"runs": [run], "cursor": {"total_count": 7}})
    _, row, shown = text.splitlines()
    assert row.split() == ["s:train:0", "m", "8", "0", "-", "training", "sw"]
    assert shown == "1 of 7 runs"
    assert watch.runs_text({"runs": [], "cursor": {"total_count": 0}}) == "no runs"
