"""Datums of different lengths in passes of similar lengths.

A forward pass over a batch pads every datum to the batch's longest, and pays for the padding
as for real tokens. RL batches mix prompts and completions of very different lengths: 20 datums
of 163 to 955 tokens are 11,768 tokens, padded to 19,100. Each further pass costs a fixed amount
besides its tokens (the model's calls, the LM head, the backward's bookkeeping), so cutting a
batch into passes pays only where it saves more padding than that.

``by_length`` chooses the cut exactly: with the datums sorted by length, the passes are runs of
that order, and the best runs minimise ``padded tokens + pass_tokens x passes`` (a dynamic
programme over the distinct lengths; a pass never splits one length, which could only add a
pass). ``pass_tokens`` is the fixed cost of a pass in tokens' worth of compute: on this 2-core
CPU, a forward_backward of tinsmith/small or SmolLM2-135M costs about 18 ms or 250 ms plus 0.3 or
5.5 ms a token, about 60 and 45 tokens (``bench/mixed_lengths.py``).

Owns: the choice of groups. Does not own: what fits the memory budget (the engine's ``plan``
splits a group further where it must), or running them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def by_length(lengths: Sequence[int], pass_tokens: int) -> list[tuple[int, ...]]:
    """The datums (by their place in ``lengths``) in groups, shortest first, each in its
    original order, that minimise the padded tokens plus ``pass_tokens`` per group. One group,
    in the original order, where cutting saves nothing (equal lengths, or too little padding)."""
    everything = tuple(range(len(lengths)))
    distinct, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    if len(distinct) <= 1:
        return [everything]
    before = np.concatenate([[0], np.cumsum(counts)])  # datums shorter than each length
    # best[j]: the least cost of the datums shorter than distinct[j]; cut[j]: where the last
    # group of that best starts.
    best = np.zeros(len(distinct) + 1, dtype=np.float64)
    cut = np.zeros(len(distinct) + 1, dtype=np.int64)
    for j in range(1, len(distinct) + 1):
        # The last group takes the lengths i..j-1: before[j] - before[i] datums padded to
        # distinct[j - 1].
        costs = best[:j] + (before[j] - before[:j]) * float(distinct[j - 1]) + pass_tokens
        cut[j] = int(np.argmin(costs))
        best[j] = costs[cut[j]]
    bounds: list[tuple[int, int]] = []
    j = len(distinct)
    while j > 0:
        bounds.append((int(cut[j]), j))
        j = int(cut[j])
    if len(bounds) == 1:
        return [everything]
    group_of = {
        int(length): g for g, (i, j) in enumerate(reversed(bounds)) for length in distinct[i:j]
    }
    groups: list[list[int]] = [[] for _ in bounds]
    for datum, length in enumerate(lengths):
        groups[group_of[int(length)]].append(datum)
    return [tuple(group) for group in groups]
