"""What the example prints: the held-out questions with the model's SQL at each evaluation, and
at the end the accuracies side by side, the reward curve and the timings.

Owns: the tables (cells wrapped to a width, so SQL stays readable in a terminal), the grading
marks, the reward sparkline and the summary. Does not own: any of the numbers (``loop``).
"""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Sequence

from examples.text_to_sql import questions
from examples.text_to_sql.loop import Evaluation, Result
from examples.text_to_sql.questions import Pair, Split
from examples.text_to_sql.reward import RIGHT, Verdict

QUESTION_WIDTH = 34
SQL_WIDTH = 56
BARS = "▁▂▃▄▅▆▇█"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], widths: Sequence[int]) -> str:
    """A table whose cells are wrapped at ``widths`` (0: not wrapped), the rows apart."""
    wrapped = [
        [
            textwrap.wrap(cell, width) or [""] if width else [cell]
            for cell, width in zip(row, widths, strict=True)
        ]
        for row in [header, *rows]
    ]
    columns = [max(len(line) for row in wrapped for line in row[c]) for c in range(len(header))]
    lines = []
    for number, row in enumerate(wrapped):
        for parts in itertools.zip_longest(*row, fillvalue=""):
            lines.append(
                "  " + "  ".join(p.ljust(w) for p, w in zip(parts, columns, strict=True)).rstrip()
            )
        if number == 0:
            lines.append("  " + "  ".join("-" * w for w in columns))
    return "\n".join(lines)


def mark(verdict: Verdict) -> str:
    """``✓`` right, ``✗`` and why not otherwise."""
    return "✓" if verdict.outcome == RIGHT else f"✗ {verdict.outcome}"


def written(verdict: Verdict, limit: int = 120) -> str:
    """The SQL that was run; if the reply had none, the start of the reply, quoted."""
    if verdict.sql:
        return verdict.sql
    reply = " ".join(verdict.reply.split())
    return repr(reply if len(reply) <= limit else reply[:limit] + "…")


def evaluation_table(
    evaluation: Evaluation, pairs: Sequence[Pair], split: Split, shown: int
) -> str:
    """The first ``shown`` questions with the reference and the model's SQL, then the accuracy
    over all of them, by part."""
    rows = [
        [pair.question, pair.sql, written(verdict), mark(verdict)]
        for pair, verdict in list(zip(pairs, evaluation.verdicts, strict=True))[:shown]
    ]
    header = ["question", "reference", "model SQL", "result"]
    title = (
        f"Held-out questions, {evaluation.name} (step {evaluation.step};"
        f" {min(shown, len(pairs))} of {len(pairs)} shown):"
    )
    body = table(header, rows, [QUESTION_WIDTH, SQL_WIDTH, SQL_WIDTH, 28])
    return f"\n{title}\n{body}\n  {accuracy_line(evaluation, pairs, split)}"


def accuracy_line(evaluation: Evaluation, pairs: Sequence[Pair], split: Split) -> str:
    cells = [f"{_fraction(evaluation.verdicts)} right"]
    for part in (questions.NEW_FILLINGS, questions.NEW_TEMPLATES):
        verdicts = in_part(part, pairs, evaluation, split)
        if verdicts:
            cells.append(f"{part} {_fraction(verdicts)}")
    return "execution accuracy: " + ", ".join(cells)


def in_part(
    part: str, pairs: Sequence[Pair], evaluation: Evaluation, split: Split
) -> list[Verdict]:
    """The verdicts on the questions of one part of the held-out set."""
    return [v for p, v in zip(pairs, evaluation.verdicts, strict=True) if split.part(p) == part]


def sparkline(values: Sequence[float]) -> str:
    """One bar per value, from ▁ (0) to █ (1)."""
    return "".join(BARS[min(int(v * len(BARS)), len(BARS) - 1)] for v in values)


def summary(result: Result, shown: int, url: str) -> str:
    """The end: the shown questions with their marks at every evaluation and the last SQL, the
    accuracies side by side, the warm start's loss, the reward curve, the time of each phase and
    where the console shows the run."""
    pairs, split = result.questions, result.split
    last = result.evaluations[-1]
    names = [evaluation.name for evaluation in result.evaluations]
    rows = [
        [
            pair.question,
            pair.sql,
            written(last.verdicts[i]),
            " ".join("✓" if e.verdicts[i].right else "✗" for e in result.evaluations),
        ]
        for i, pair in enumerate(pairs[:shown])
    ]
    header = ["question", "reference", f"model SQL ({last.name})", " / ".join(names)]
    out = [
        f"\nHeld-out questions at every evaluation ({min(shown, len(pairs))} of {len(pairs)}):",
        table(header, rows, [QUESTION_WIDTH, SQL_WIDTH, SQL_WIDTH, 0]),
    ]
    parts = [questions.NEW_FILLINGS, questions.NEW_TEMPLATES]
    counts = {part: sum(split.part(p) == part for p in pairs) for part in parts}
    out.append(
        f"\nHeld-out execution accuracy ({len(pairs)} questions: {counts[parts[0]]} new fillings"
        f" of trained templates, {counts[parts[1]]} of templates never trained on):"
    )
    accuracy_rows = []
    for evaluation in result.evaluations:
        cells = [evaluation.name, str(evaluation.step), _fraction(evaluation.verdicts)]
        for part in parts:
            cells.append(_fraction(in_part(part, pairs, evaluation, split)))
        accuracy_rows.append(cells)
    out.append(table(["after", "step", "all", *parts], accuracy_rows, [0] * 5))
    if result.warm_losses:
        losses = result.warm_losses
        out.append(
            f"\nwarm start: {len(losses)} steps, loss per answer token {losses[0]:.3f} ->"
            f" {statistics_tail(losses):.3f}"
        )
    if result.rewards:
        rewards = result.rewards
        out.append(
            f"RL: {len(rewards)} steps, mean reward by step {sparkline(rewards)}"
            f" {rewards[0]:.2f} -> {statistics_tail(rewards):.2f} (first step, mean of the last"
            f" {min(4, len(rewards))});"
            f" groups with mixed rewards {statistics_tail(result.mixed, len(result.mixed)):.0%}"
        )
        out.append("  " + " ".join(f"{reward:.2f}" for reward in rewards))
        spent = result.rl_seconds
        out.append(
            f"  per RL step: {spent['sampling'] / len(rewards):.1f}s sampling and grading,"
            f" {spent['training'] / len(rewards):.1f}s training and new sampler weights"
        )
    out.append(
        "time: " + ", ".join(f"{name} {seconds:.0f}s" for name, seconds in result.seconds.items())
    )
    out.append(f"the run in the console: {url.rstrip('/')}/console/#/runs/{result.run_id}")
    return "\n".join(out)


def statistics_tail(values: Sequence[float], count: int = 4) -> float:
    """The mean of the last ``count`` values (all of them if there are fewer)."""
    tail = values[-count:]
    return sum(tail) / len(tail)


def _fraction(verdicts: Sequence[Verdict]) -> str:
    right = sum(verdict.right for verdict in verdicts)
    share = right / len(verdicts) if verdicts else 0.0
    return f"{right}/{len(verdicts)} {share:4.0%}"
