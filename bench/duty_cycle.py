"""The duty-cycle picture: how busy the trainer and the sampler are with 1, 2, 4 and 8 concurrent
RL jobs on one system, from the spans the services export.

One run starts a loopback OTLP receiver (bench.otlp) and ``tinsmith up`` on a free port, with its
own temporary data directory, exporting every service's spans to that receiver. Then, against
that one system, it runs a phase per ``--jobs`` count: 1, then 2, 4 and 8 RL jobs at once, each
measured over the same length of wall-clock time. A job is an independent program using the
official tinker SDK (its own ``ServiceClient``, session and LoRA run) in a thread of this
process; each of its steps

1. saves its weights and gets a sampling client on them (``save_weights_and_get_sampling_client``),
2. samples a group of G completions of T tokens for a random P-token prompt (``stop=[]``, so each
   completion has exactly T tokens and every step costs the same),
3. scores them and waits for a simulated slow grader (a remote model, a test harness): a sleep of
   the grader's delay, give or take ``--reward-jitter`` of it, uniformly, during which the job
   asks nothing of the system (the delay: below),
4. builds importance-sampling datums with group-centred advantages and the sampler's logprobs,
   then ``forward_backward`` and ``optim_step``.

Alone, a job leaves the engines idle while it waits for its rewards: the trainer computes only in
steps 1 and 4, the sampler only in step 2. Other jobs can fill those gaps.

The engines report their busy time as spans named ``compute`` (service ``tinsmith-trainer``: one
per operation; ``tinsmith-sampler``: one per sample request from its admission into the running
batch to its last token, overlapping, and one per adapter load). An engine's busy timeline is the
union of its ``compute`` spans, and its utilisation in a phase is the share of the phase's window
that this union covers. The run prints, for each phase, the utilisation of both engines, the
steps completed inside the window, steps per second and their ratio to the first phase's, and
the slowest job's mean step time over the fastest's, and the share of the window in which a
request waited for the trainer while it computed nothing (from each request's ``queue_wait``
span, its acceptance, to the ``compute`` span that served it: the trainer's busy share can be no
more than the jobs ask of it, and this says whether it left asked work undone), and the most of
the trainer's time the phase's jobs could ask for (``Phase.trainer_offered``: each job steps at
most as fast as alone, and each step keeps the trainer busy as long as it did in the phase);
then issue 17's
targets: steps per second
with 8 jobs at least 5 times one job's, the trainer busy at least 80% of the time with 8 jobs,
and no job's mean step more than 1.25 times another's in a phase. It draws both timelines for
every phase, each job's grader waits under them, into one PNG (``docs/duty-cycle.png``).

    .venv/bin/python -m bench.duty_cycle [--model tinsmith/small] [--phase-seconds 40]
        [--reward-delay SECONDS] [--reward-jitter 0.25] [--group 8] [--prompt 32] [--tokens 8]
        [--jobs 1 2 4 8] [--no-stagger] [--out docs/duty-cycle.png] [--spans FILE]

The grader's delay is fitted to the machine unless ``--reward-delay`` sets it: the delay at which
the largest phase's jobs, each stepping as fast as one job alone, would ask for all of the
trainer's time (``fit_reward_delay``). With N jobs, a step alone of P seconds that keeps the
trainer busy t of them offers the trainer N t / P of its time: the targets need it asked for
at least 80% (or it cannot be 80% busy) and N t / P not far over 1 (or the trainer, saturated,
caps the steps at 1/t a second: for 8 jobs, under 5 times one job's 1/P once 8 t / P
passes 1.6). A fixed delay offers a machine twice as fast half as much work: 2 s, this bench's
default until 2026-11-29, asked for 49% of the trainer on one machine and over 100% on another.

How a phase is measured:
- Before the phases, unmeasured steps of one job without the grader's wait load the base model
  into both engines (the first), then time a step of a job alone and the trainer's part of it
  (the median of three, the trainer's from its spans), which fit the delay; a step alone with
  the delay is the period.
- A phase's runs are created first. Its jobs then start a period apart divided by their number
  (independent jobs do not start in the same instant; ``--no-stagger`` starts them together). The
  window opens when the last one starts and lasts ``--phase-seconds``; jobs start no step after
  it closes, and what runs past it is not counted.
- The system runs with its defaults. The sampler's adapter cache in particular is the default
  one: a run's new sampler weights supersede its older ones, so each job holds one adapter in
  the sampler and every phase starts from the same state.

The model is ``tinsmith/small``: on two cores a SmolLM2-135M step of this shape takes about 12 s
(6 s sampling, 6 s training), too long for four phases of several steps each in a few minutes.
The default run takes about 3 minutes.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when huggingface_hub is imported
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tinker
from tinker import types

from bench.otlp import OtlpReceiver, Span, describe
from tinsmith import models
from tinsmith.child import UpProcess, sigterm_as_interrupt

TRAINER = "tinsmith-trainer"
SAMPLER = "tinsmith-sampler"
COMPUTE = "compute"
QUEUE_WAIT = "queue_wait"
JOB_COUNTS = [1, 2, 4, 8]
# Issue 17's targets: steps per second keep growing with the jobs (the most jobs at least this
# many times one job's), the trainer busy at least this share of the time with the most jobs,
# and in every phase the slowest job's mean step at most this many times the fastest's.
TARGET_SPEEDUP = 5.0
TARGET_TRAINER_SHARE = 0.8
TARGET_FAIRNESS = 1.25
DEFAULT_MODEL = models.SMALL
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "duty-cycle.png"
API_KEY = "tml-duty-cycle"
READY_TIMEOUT_S = 300.0
RANK = 8
WARM_STEPS = 3  # a job's steps alone, after its first, that time it and fit the grader's delay
ADAM = types.AdamParams(learning_rate=1e-4)
NS = 1_000_000_000

Interval = tuple[int, int]  # [start, end) in unix-epoch nanoseconds


# --- busy time: unions of intervals -------------------------------------------------------------


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The disjoint, sorted intervals covering exactly what ``intervals`` cover."""
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    """The union of ``intervals``, cut to ``window``."""
    low, high = window
    return [(max(s, low), min(e, high)) for s, e in union(intervals) if e > low and s < high]


def utilisation(intervals: Iterable[Interval], window: Interval) -> float:
    """The share of ``window`` that the union of ``intervals`` covers, from 0 to 1."""
    width = window[1] - window[0]
    if width <= 0:
        raise ValueError(f"empty window {window}")
    return sum(e - s for s, e in clip(intervals, window)) / width


def busy_intervals(spans: Iterable[Span], service: str) -> list[Interval]:
    """The union of a service's ``compute`` spans: when its engine was busy."""
    return union(
        (s.start_ns, s.end_ns) for s in spans if s.service == service and s.name == COMPUTE
    )


def waiting_intervals(spans: Sequence[Span], service: str) -> list[Interval]:
    """When some request waited for a service's engine: each request from its acceptance into
    the log (the start of its ``queue_wait`` span) to the start of the first ``compute`` span
    that served it (in its trace, or linked to it: a fused pass or joint step is a child of one
    request's span, linked from the others')."""
    served: dict[str, int] = {}
    for span in spans:
        if span.service == service and span.name == COMPUTE:
            for trace in (span.trace_id, *(trace for trace, _ in span.links)):
                served[trace] = min(served.get(trace, span.start_ns), span.start_ns)
    return union(
        (span.start_ns, served[span.trace_id])
        for span in spans
        if span.service == service and span.name == QUEUE_WAIT and span.trace_id in served
    )


def uncovered(intervals: Iterable[Interval], cover: Iterable[Interval], window: Interval) -> float:
    """The share of ``window`` that ``intervals`` cover and ``cover`` does not, from 0 to 1."""
    left = clip(intervals, window)
    covering = clip(cover, window)
    overlap, j = 0, 0
    for start, end in left:
        while j < len(covering) and covering[j][1] <= start:
            j += 1
        k = j
        while k < len(covering) and covering[k][0] < end:
            overlap += min(end, covering[k][1]) - max(start, covering[k][0])
            k += 1
    return (sum(e - s for s, e in left) - overlap) / (window[1] - window[0])


# --- the system ---------------------------------------------------------------------------------


def start_system(data_dir: Path, otlp_endpoint: str) -> UpProcess:
    """``tinsmith up`` as a child process, exporting its spans to ``otlp_endpoint``."""
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "200",  # ms: spans arrive soon after they end
        "OTEL_METRICS_EXPORTER": "none",
    }
    return UpProcess(data_dir, env=env)


# --- one RL job ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobShape:
    model: str
    group: int  # completions sampled per step
    prompt_tokens: int
    tokens: int  # generated per completion
    reward_delay_s: float  # the grader's mean latency
    reward_jitter: float  # its spread: each wait is uniform in delay * (1 -/+ jitter)

    def describe(self) -> str:
        spread = f" ± {self.reward_jitter:.0%}" if self.reward_jitter else ""
        return (
            f"{self.model}; each step: save weights, sample {self.group} x {self.tokens} tokens "
            f"({self.prompt_tokens}-token prompt), {self.reward_delay_s:g} s{spread} reward, "
            "forward_backward + optim_step"
        )


@dataclass
class Step:
    start_ns: int
    reward_ns: Interval  # the simulated grader's wait
    end_ns: int


def reward(tokens: Sequence[int]) -> float:
    """A stand-in for a real grader's score: the share of distinct tokens in a completion."""
    return len(set(tokens)) / max(len(tokens), 1)


def rl_datums(
    prompt: list[int], sequences: Sequence[types.SampledSequence], advantages: Sequence[float]
) -> list[types.Datum]:
    """Importance-sampling datums: the completion's tokens weighted by the group-centred
    advantage, with the sampler's logprobs as the denominators; the prompt's positions carry 0."""
    datums = []
    for sequence, advantage in zip(sequences, advantages, strict=True):
        completion = list(sequence.tokens)
        assert sequence.logprobs is not None
        tokens = prompt + completion
        pad = [0.0] * (len(prompt) - 1)
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], np.int64)),
                    "logprobs": types.TensorData.from_numpy(
                        np.array(pad + list(sequence.logprobs), np.float32)
                    ),
                    "advantages": types.TensorData.from_numpy(
                        np.array(pad + [advantage] * len(completion), np.float32)
                    ),
                },
            )
        )
    return datums


class RlJob:
    """One RL training program: its own session and LoRA run, stepping in a thread."""

    def __init__(self, url: str, shape: JobShape, seed: int) -> None:
        self.shape = shape
        self.service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        self.training = self.service.create_lora_training_client(
            base_model=shape.model, rank=RANK, seed=seed
        ).result()
        self.steps: list[Step] = []
        self.error: BaseException | None = None
        vocab = models.get(shape.model).vocab_size
        self._rng = np.random.default_rng(seed)
        self._vocab = (vocab // 4, 3 * vocab // 4)  # clear of the special tokens at the ends

    def step(self) -> Step:
        shape = self.shape
        start = time.time_ns()
        sampler = self.training.save_weights_and_get_sampling_client().result()
        prompt = self._rng.integers(*self._vocab, shape.prompt_tokens).tolist()
        params = types.SamplingParams(
            max_tokens=shape.tokens, stop=[], temperature=1.0, seed=int(self._rng.integers(1 << 30))
        )
        sampled = sampler.sample(types.ModelInput.from_ints(prompt), shape.group, params).result()
        waited = time.time_ns()
        rewards = np.array([reward(s.tokens) for s in sampled.sequences])
        spread = shape.reward_jitter * float(self._rng.uniform(-1.0, 1.0))
        time.sleep(shape.reward_delay_s * (1.0 + spread))
        graded = time.time_ns()
        advantages = (rewards - rewards.mean()).tolist()
        datums = rl_datums(prompt, sampled.sequences, advantages)
        backward = self.training.forward_backward(datums, "importance_sampling")
        optim = self.training.optim_step(ADAM)
        backward.result()
        optim.result()
        return Step(start, (waited, graded), time.time_ns())

    def run_until(self, deadline_ns: int) -> None:
        try:
            while time.time_ns() < deadline_ns:
                self.steps.append(self.step())
        except BaseException as error:  # reported by the phase, in the main thread
            self.error = error


# --- the phases ---------------------------------------------------------------------------------


@dataclass
class Phase:
    jobs: int
    window: Interval
    steps: list[list[Step]]  # per job
    trainer: list[Interval] = field(default_factory=list)
    sampler: list[Interval] = field(default_factory=list)
    # When some request waited for the trainer (``waiting_intervals``).
    trainer_waiting: list[Interval] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return (self.window[1] - self.window[0]) / NS

    @property
    def steps_done(self) -> int:
        """The steps that ended inside the window."""
        return sum(1 for job in self.steps for s in job if s.end_ns <= self.window[1])

    @property
    def trainer_share(self) -> float:
        return utilisation(self.trainer, self.window)

    def trainer_offered(self, period_s: float) -> float:
        """The most of the trainer's time this phase's jobs could ask for: each job makes at
        most one step per ``period_s`` (a step of a job alone), and each step kept the trainer
        busy for the phase's trainer seconds per step (bench/README.md, "What bounds the
        trainer's share")."""
        if not self.steps_done or period_s <= 0:
            return float("nan")
        per_step_s = self.trainer_share * self.seconds / self.steps_done
        return min(1.0, self.jobs * per_step_s / period_s)

    @property
    def fairness(self) -> float:
        """The slowest job's mean step time over the fastest's, from the steps that ended in
        the window (1.0 with one job, or none to compare)."""
        means = [
            statistics.mean((s.end_ns - s.start_ns) / NS for s in ended)
            for ended in ([s for s in job if s.end_ns <= self.window[1]] for job in self.steps)
            if ended
        ]
        return max(means) / min(means) if len(means) > 1 else 1.0

    @property
    def sampler_share(self) -> float:
        return utilisation(self.sampler, self.window)

    @property
    def trainer_idle_waited(self) -> float:
        """The share of the window in which a request waited for the trainer and its engine
        computed nothing: what the trainer left undone that it was asked (0 for a scheduler
        that never idles with work to do; the service's own work around each computation, reading
        the request and recording its outcome, counts here)."""
        return uncovered(self.trainer_waiting, self.trainer, self.window)


def run_phase(
    url: str, shape: JobShape, jobs: int, seconds: float, stagger_s: float, seed: int
) -> Phase:
    """``jobs`` RL jobs, started ``stagger_s`` apart; the window opens when the last one starts
    and lasts ``seconds``. Their runs are created before any starts."""
    programs = [RlJob(url, shape, seed + i) for i in range(jobs)]
    start = time.time_ns()
    opens = start + int((jobs - 1) * stagger_s * NS)
    window = (opens, opens + int(seconds * NS))

    def run(i: int) -> None:
        time.sleep(max(0.0, (start + int(i * stagger_s * NS) - time.time_ns()) / NS))
        programs[i].run_until(window[1])

    threads = [
        threading.Thread(target=run, args=(i,), name=f"rl-job-{i}", daemon=True)  # for Ctrl-C
        for i in range(jobs)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for job in programs:
        if job.error is not None:
            raise RuntimeError(f"an RL job failed: {job.error!r}") from job.error
    return Phase(jobs, window, [job.steps for job in programs])


def settle(receiver: OtlpReceiver, quiet_s: float = 1.5, timeout_s: float = 20.0) -> list[Span]:
    """The spans, once none has arrived for ``quiet_s`` (the services export in batches)."""
    deadline = time.monotonic() + timeout_s
    count, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        spans = receiver.spans()
        if len(spans) != count:
            count, since = len(spans), time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.1)
    return receiver.spans()


def trainer_seconds(trainer: Iterable[Interval], step: Step) -> float:
    """How long the trainer was busy (``trainer``: its busy intervals) during ``step``."""
    window = (step.start_ns, step.end_ns)
    return utilisation(trainer, window) * (window[1] - window[0]) / NS


def fit_reward_delay(step_s: float, trainer_s: float, jobs: int) -> float:
    """The grader's mean seconds at which ``jobs`` jobs, each stepping as fast as one job alone,
    would ask for all of the trainer's time: a step of one job without the grader's wait took
    ``step_s``, ``trainer_s`` of them on the trainer, so ``jobs`` jobs ask for ``jobs`` x
    ``trainer_s`` of every ``step_s`` + delay seconds. 0 where the steps' other work already
    leaves the trainer idle that much."""
    return max(0.0, jobs * trainer_s - step_s)


def measure(
    url: str,
    receiver: OtlpReceiver,
    shape: JobShape,
    job_counts: Sequence[int],
    seconds: float,
    stagger: bool,
    reward_delay_s: float | None,
) -> tuple[list[Phase], list[Span], JobShape]:
    """Warm up and set the grader's delay (``reward_delay_s``, or fitted where that is None),
    run one phase per count of jobs, then give each phase its engines' busy time from the spans
    received; also return every span and the shape the jobs had."""
    # Unmeasured steps of one job, without the grader: the first loads the base model into both
    # engines, the others time a step of a job alone and its trainer part (medians).
    warm = RlJob(url, dataclasses.replace(shape, reward_delay_s=0.0, reward_jitter=0.0), seed=0)
    warm.step()
    alone = [warm.step() for _ in range(WARM_STEPS)]
    trainer = busy_intervals(settle(receiver), TRAINER)
    step_s = statistics.median((step.end_ns - step.start_ns) / NS for step in alone)
    trainer_s = statistics.median(trainer_seconds(trainer, step) for step in alone)
    if reward_delay_s is None:
        most = max(job_counts)
        reward_delay_s = round(fit_reward_delay(step_s, trainer_s, most), 2)
        how = f"fitted: {most} jobs stepping as fast as one alone ask for all of the trainer"
    else:
        how = "--reward-delay"
    shape = dataclasses.replace(shape, reward_delay_s=reward_delay_s)
    period_s = step_s + reward_delay_s
    print(
        f"warm-up: a step of one job alone takes {step_s:.2f} s without the grader, "
        f"{trainer_s:.3f} s of it on the trainer; the grader takes {reward_delay_s:g} s ({how}), "
        f"so a step alone takes about {period_s:.2f} s",
        flush=True,
    )
    phases = []
    for index, jobs in enumerate(job_counts):
        stagger_s = period_s / jobs if stagger else 0.0
        plural = "job" if jobs == 1 else "jobs"
        print(
            f"phase: {jobs} RL {plural}, started {stagger_s:.2f} s apart, for {seconds:g} s",
            flush=True,
        )
        phases.append(run_phase(url, shape, jobs, seconds, stagger_s, seed=100 * (index + 1)))
    spans = settle(receiver)
    trainer, sampler = busy_intervals(spans, TRAINER), busy_intervals(spans, SAMPLER)
    waiting = waiting_intervals(spans, TRAINER)
    for phase in phases:
        phase.trainer = clip(trainer, phase.window)
        phase.sampler = clip(sampler, phase.window)
        phase.trainer_waiting = clip(waiting, phase.window)
    return phases, spans, shape


# --- the picture --------------------------------------------------------------------------------


def _seconds(intervals: Iterable[Interval], origin: int) -> list[tuple[float, float]]:
    return [((s - origin) / NS, (e - s) / NS) for s, e in intervals]


def render(phases: Sequence[Phase], shape: JobShape, out: Path) -> None:
    """Each phase's trainer and sampler lanes (busy in colour, idle in grey) and its jobs'
    reward waits, on one time axis relative to the phase's start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = [2 + phase.jobs for phase in phases]
    figure, axes = plt.subplots(
        len(phases),
        1,
        figsize=(10, 1.2 + 0.42 * sum(lanes)),
        sharex=True,
        gridspec_kw={"height_ratios": lanes},
        squeeze=False,
    )
    width = max(phase.seconds for phase in phases)
    for ax, phase in zip(axes[:, 0], phases, strict=True):
        origin, window = phase.window[0], phase.window
        rows: list[tuple[str, list[tuple[float, float]], str]] = [
            (
                f"trainer {phase.trainer_share:.0%}",
                _seconds(clip(phase.trainer, window), origin),
                "tab:blue",
            ),
            (
                f"sampler {phase.sampler_share:.0%}",
                _seconds(clip(phase.sampler, window), origin),
                "tab:orange",
            ),
        ]
        for i, steps in enumerate(phase.steps):
            waits = clip((s.reward_ns for s in steps), window)
            rows.append((f"job {i + 1} reward", _seconds(waits, origin), "tab:green"))
        for y, (_, bars, colour) in enumerate(reversed(rows)):
            is_engine = y >= len(rows) - 2
            if is_engine:
                ax.broken_barh([(0, phase.seconds)], (y + 0.1, 0.8), color="0.92")  # idle
            ax.broken_barh(bars, (y + 0.1, 0.8), color=colour, alpha=1.0 if is_engine else 0.45)
        ax.set_yticks([y + 0.5 for y in range(len(rows))])
        ax.set_yticklabels([label for label, _, _ in reversed(rows)])
        ax.set_ylim(0, len(rows))
        ax.set_xlim(0, width)
        plural = "job" if phase.jobs == 1 else "jobs"
        ax.set_title(
            f"{phase.jobs} RL {plural}: {phase.steps_done} steps, "
            f"{phase.steps_done / phase.seconds:.2f} steps/s",
            loc="left",
            fontsize=10,
        )
        ax.tick_params(axis="y", length=0)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
    axes[-1, 0].set_xlabel("seconds since the phase's window opened")
    ratio = phases[-1].trainer_share / phases[0].trainer_share if phases[0].trainer_share else 0
    figure.suptitle(
        "tinsmith duty cycle: the trainer and the sampler busy (colour) or idle (grey), "
        "jobs waiting for rewards (green)\n"
        f"{shape.describe()}\n"
        f"the trainer is busy {ratio:.1f}x as much with {phases[-1].jobs} jobs as with "
        f"{phases[0].jobs}",
        fontsize=10,
    )
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=90)
    plt.close(figure)


# --- the run ------------------------------------------------------------------------------------


def report(phases: Sequence[Phase]) -> None:
    """Print the table the README quotes, and the targets: the last phase's steps per second
    against the first's, its trainer share, and each phase's slowest job against its fastest."""
    first = phases[0]
    base = first.steps_done / first.seconds
    # A job's step alone: the first phase's mean step (its one job's, in the default run).
    period_s = first.seconds * first.jobs / first.steps_done if first.steps_done else 0.0
    print(
        "\njobs  window s  steps  steps/s  x first  trainer  sampler  slowest/fastest job  "
        "trainer idle, work waiting  trainer asked at most"
    )
    for phase in phases:
        rate = phase.steps_done / phase.seconds
        print(
            f"{phase.jobs:>4}  {phase.seconds:>8.1f}  {phase.steps_done:>5}  {rate:>7.3f}  "
            f"{rate / base if base else float('nan'):>7.2f}  {phase.trainer_share:>7.1%}  "
            f"{phase.sampler_share:>7.1%}  {phase.fairness:>19.2f}  "
            f"{phase.trainer_idle_waited:>26.1%}  {phase.trainer_offered(period_s):>21.0%}"
        )
    last = phases[-1]
    speedup = (last.steps_done / last.seconds) / base if base else float("nan")
    worst = max(phase.fairness for phase in phases)

    def verdict(met: bool) -> str:
        return "met" if met else "NOT met"

    print(
        f"\nsteps/s, {last.jobs} jobs / {first.jobs}: {speedup:.2f} (target >= "
        f"{TARGET_SPEEDUP:g}: {verdict(speedup >= TARGET_SPEEDUP)}); trainer busy with "
        f"{last.jobs} jobs: {last.trainer_share:.0%} (target >= {TARGET_TRAINER_SHARE:.0%}: "
        f"{verdict(last.trainer_share >= TARGET_TRAINER_SHARE)}; its jobs asked it for at most "
        f"{last.trainer_offered(period_s):.0%}); slowest job's mean step / "
        f"fastest's, worst phase: {worst:.2f} (target <= {TARGET_FAIRNESS:g}: "
        f"{verdict(worst <= TARGET_FAIRNESS)})"
    )


def write_spans(spans: Sequence[Span], path: Path) -> None:
    with path.open("w") as out:
        for span in sorted(spans, key=lambda s: s.start_ns):
            out.write(json.dumps(dataclasses.asdict(span), default=list) + "\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"default {DEFAULT_MODEL}")
    parser.add_argument(
        "--phase-seconds", type=float, default=40.0, help="each phase's window (default 40)"
    )
    parser.add_argument(
        "--reward-delay",
        type=float,
        help="the simulated grader's mean seconds (default: fitted, so that the largest phase's "
        "jobs, stepping as fast as one alone, would ask for all of the trainer's time)",
    )
    parser.add_argument(
        "--reward-jitter",
        type=float,
        default=0.25,
        help="each grader wait is uniform in delay * (1 -/+ this) (default 0.25)",
    )
    parser.add_argument("--group", type=int, default=8, help="completions per step (default 8)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per completion (default 8)")
    parser.add_argument(
        "--jobs",
        type=int,
        nargs="+",
        default=JOB_COUNTS,
        help="concurrent jobs of each phase, in order (default 1 2 4 8)",
    )
    parser.add_argument(
        "--no-stagger",
        action="store_true",
        help="start a phase's jobs together (by default a step's time apart, divided evenly)",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="the PNG (docs/duty-cycle.png)"
    )
    parser.add_argument(
        "--spans", type=Path, help="also write every span received to this file, as JSON lines"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    shape = JobShape(args.model, args.group, args.prompt, args.tokens, 0.0, args.reward_jitter)
    started = time.monotonic()
    data_dir = Path(tempfile.mkdtemp(prefix="tinsmith-duty-cycle-"))
    with sigterm_as_interrupt(), OtlpReceiver() as receiver:
        system = start_system(data_dir, receiver.endpoint)
        try:
            url = system.wait_ready(READY_TIMEOUT_S)
            system.wait_standby(READY_TIMEOUT_S)
            elapsed = time.monotonic() - started
            print(f"tinsmith ready at {url} after {elapsed:.0f} s; spans go to {receiver.endpoint}")
            phases, spans, shape = measure(
                url,
                receiver,
                shape,
                args.jobs,
                args.phase_seconds,
                not args.no_stagger,
                args.reward_delay,
            )
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
        except Exception:
            system.print_logs(15)
            raise
        finally:
            system.stop()
            shutil.rmtree(data_dir, ignore_errors=True)
    if not any(phase.trainer or phase.sampler for phase in phases):
        print(
            f"no compute spans from {TRAINER} or {SAMPLER} ({describe(spans)}): does this build "
            "export them?",
            file=sys.stderr,
        )
        return 1
    report(phases)
    render(phases, shape, args.out)
    if args.spans is not None:
        write_spans(spans, args.spans)
    size_kib = args.out.stat().st_size // 1024
    print(f"wrote {args.out} ({size_kib} KiB); {time.monotonic() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
