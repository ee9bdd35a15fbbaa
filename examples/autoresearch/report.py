"""What the sweep shows at the end: a table of every run, a plot, and a few lines of summary.

Owns: the table (each run's configuration, steps trained, last training NLL, its held-out NLL and
accuracy at every rung it reached, and where it stopped), the plot of the held-out scores over
the steps (a PNG, through matplotlib's Agg backend where matplotlib is installed), the winner's
answers before and after, the engines' busy share and the console URL of the sweep. Does not
own: measuring any of it (``sweep``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from examples.autoresearch.sweep import QUESTIONS, Attempt, SweepResult
from examples.sft_pig_latin import HELD_OUT, show


def print_report(result: SweepResult, url: str) -> None:
    print_table(result)
    winner = result.winner
    first, last = 0, winner.steps
    print(
        f"\nwinner: #{winner.number} ({winner.config.label()}), {last} steps: held-out NLL"
        f" {winner.nll[first]:.3f} -> {winner.nll[last]:.3f}, exact"
        f" {winner.correct(first)}/{len(HELD_OUT)} -> {winner.correct(last)}/{len(HELD_OUT)}"
    )
    show(
        f"The winner's answers before and after its {last} steps:",
        QUESTIONS,
        {"before": winner.answers[first], f"step {last}": winner.answers[last]},
    )
    print(f"\n{busy_line(result)}")
    print(f"the winner's weights: {result.winner_path}")
    print(f"the sweep in the console: {console_url(url, result.sweep_id)}")


def console_url(url: str, sweep_id: str) -> str:
    return f"{url.rstrip('/')}/console/#/sweeps/{sweep_id}"


def busy_line(result: SweepResult) -> str:
    span = f"{result.finished - result.started:.0f} s"
    if isinstance(result.busy, str):
        return f"engines' busy share during the sweep ({span}): not measured: {result.busy}"
    shares = ", ".join(f"{name} {share:.0%}" for name, share in sorted(result.busy.items()))
    return f"engines' busy share during the sweep ({span}): {shares}"


def print_table(result: SweepResult) -> None:
    """Every run: its configuration, what it reached, its held-out NLL and exact answers at the
    start and at the end of every rung it trained in, and where it stopped."""
    evaluated = [0, *result.rung_ends]
    header = ["run", "lr", "rank", "loss", "steps", "train nll"]
    header += [
        "before" if step == 0 else f"rung {i - 1} @{step}" for i, step in enumerate(evaluated)
    ]
    header += ["result", "training run id"]
    rows = [_row(attempt, evaluated) for attempt in result.attempts]
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    print(
        f"\nsweep {result.sweep_id}: held-out NLL per answer token, then exact answers of"
        f" {len(HELD_OUT)} held-out words"
    )
    for row in [header, ["-" * width for width in widths], *rows]:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print("  " + "  ".join(cells).rstrip())


def _row(attempt: Attempt, evaluated: list[int]) -> list[str]:
    config = attempt.config
    scores = [
        f"{attempt.nll[step]:.3f} {attempt.correct(step)}/{len(HELD_OUT)}"
        if step in attempt.nll
        else ""
        for step in evaluated
    ]
    stopped = attempt.eliminated_at
    outcome = "winner" if stopped is None else f"out at rung {stopped}"
    train_nll = f"{attempt.train_nll:.3f}" if attempt.train_nll is not None else "-"
    return [
        f"#{attempt.number}",
        f"{config.learning_rate:g}",
        str(config.rank),
        config.loss,
        str(attempt.steps),
        train_nll,
        *scores,
        outcome,
        attempt.run_id,
    ]


def plot(result: SweepResult, path: Path) -> Path | None:
    """The held-out NLL and accuracy of every run over the steps, each rung's end marked, as a
    PNG at ``path``; None, with a line saying so, without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # a file, never a window
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FormatStrFormatter, MaxNLocator
    except ImportError:
        print("no plot: matplotlib is not installed (`pip install matplotlib`)")
        return None
    figure, (nll_axes, accuracy_axes) = plt.subplots(1, 2, figsize=(12, 4.8))
    for attempt in result.attempts:
        _draw(nll_axes, attempt, attempt.nll)
        accuracy = {step: attempt.correct(step) / len(HELD_OUT) for step in attempt.answers}
        _draw(accuracy_axes, attempt, accuracy)
    for axes in (nll_axes, accuracy_axes):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        for end in result.rung_ends:
            axes.axvline(end, color="0.8", linestyle="--", linewidth=0.8)
        axes.set_xlabel("step (dashed: end of a rung)")
        axes.grid(alpha=0.3)
    nll_axes.set_ylabel("held-out NLL per answer token (log scale)")
    nll_axes.set_yscale("log")  # a diverging run would flatten the others' curves
    for ticks in (nll_axes.yaxis.set_major_formatter, nll_axes.yaxis.set_minor_formatter):
        ticks(FormatStrFormatter("%g"))  # 3, not 3 x 10^0
    accuracy_axes.set_ylabel("held-out exact-match accuracy")
    accuracy_axes.set_ylim(-0.05, 1.05)
    nll_axes.legend(fontsize=8)
    figure.suptitle(f"sweep {result.sweep_id}: successive halving on the held-out NLL (x: stopped)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _draw(axes: Any, attempt: Attempt, values: dict[int, float]) -> None:
    """One run's curve: bold for the winner, ending in an x where the run was stopped."""
    steps = sorted(values)
    winner = attempt.eliminated_at is None
    (line,) = axes.plot(
        steps,
        [values[step] for step in steps],
        marker="o",
        markersize=3,
        linewidth=2.5 if winner else 1.2,
        label=f"#{attempt.number} {attempt.config.label()}{' (winner)' if winner else ''}",
    )
    if not winner:
        axes.plot(steps[-1], values[steps[-1]], marker="x", markersize=9, color=line.get_color())
