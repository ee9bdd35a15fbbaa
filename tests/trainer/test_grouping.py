"""services/trainer/grouping.py: datums of mixed lengths cut into passes of similar lengths
exactly where that saves more padding than the passes cost."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from services.trainer.grouping import by_length


def _cost(lengths: list[int], groups: list[tuple[int, ...]], pass_tokens: int) -> int:
    return sum(len(g) * max(lengths[i] for i in g) + pass_tokens for g in groups)


def _best_by_brute_force(lengths: list[int], pass_tokens: int) -> int:
    """The least cost over every way to cut the sorted datums into consecutive groups."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    best = None
    for cuts in itertools.product((False, True), repeat=len(order) - 1):
        groups, current = [], [order[0]]
        for cut, datum in zip(cuts, order[1:], strict=True):
            if cut:
                groups.append(tuple(current))
                current = []
            current.append(datum)
        groups.append(tuple(current))
        cost = _cost(lengths, groups, pass_tokens)
        best = cost if best is None else min(best, cost)
    assert best is not None
    return best


def test_equal_lengths_and_small_differences_are_one_group_in_order() -> None:
    assert by_length([128] * 5, 64) == [(0, 1, 2, 3, 4)]
    assert by_length([100, 102, 99, 101], 64) == [(0, 1, 2, 3)]
    assert by_length([7], 64) == [(0,)]


def test_two_clusters_are_two_groups_shortest_first_each_in_order() -> None:
    lengths = [900, 20, 920, 25, 22, 910]
    assert by_length(lengths, 64) == [(1, 3, 4), (0, 2, 5)]
    # A pass that costs more than the padding it saves keeps them together.
    assert by_length(lengths, 10_000) == [(0, 1, 2, 3, 4, 5)]


@pytest.mark.parametrize("seed", range(30))
def test_the_groups_cost_the_least_of_any_cut(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, size=int(rng.integers(2, 11))).tolist()
    pass_tokens = int(rng.choice([1, 16, 64, 256]))
    groups = by_length(lengths, pass_tokens)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(list(g) == sorted(g) for g in groups)
    # Shortest first, and no length split between groups.
    spans = [(min(lengths[i] for i in g), max(lengths[i] for i in g)) for g in groups]
    assert all(a[1] < b[0] for a, b in itertools.pairwise(spans))
    assert _cost(lengths, groups, pass_tokens) == _best_by_brute_force(lengths, pass_tokens)
