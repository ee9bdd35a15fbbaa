"""The sweep: its runs, their concurrent training, their held-out scores, and the halving.

Owns: which configurations run (``grid``), how many steps each rung trains (``rung_schedule``),
one run's training steps and held-out scores (``Attempt``), and the successive halving that
drives them all at once (``run_sweep``). Does not own: the pig-latin task, its data and chat
format (``examples.sft_pig_latin``), the REST routes (``examples.rest``), or what is printed and
drawn at the end (``report``).

Every run sees the same examples in the same order and starts from the same LoRA seed, so the
runs differ only by their hyperparameters. The learning rate is constant within a run: how long
a run trains depends on whether it survives, so there is no run length to decay over.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
import numpy as np
import tinker
from tinker import types
from tqdm import tqdm

from examples.rest import NoBusyShare, Rest
from examples.sft_pig_latin import HELD_OUT, SEEN, ChatFormat, ask, grade, training_texts

# The loss variants and the Tinker loss each runs as. "prob" maximizes each answer token's
# probability instead of its log-probability (the "MAE" loss of the label-noise literature):
# importance_sampling with sampler logprobs of 0 has the per-token term -A * exp(logprob - 0), so
# with the answer weights as advantages it is exactly -w * P(target). It raises the tokens the
# model already finds likely and gives up on the unlikely ones, so its held-out NLL, which the
# halving ranks by, goes up while its own objective improves: the sweep shows that quickly.
LOSS_FNS: dict[str, types.LossFnType] = {
    "cross_entropy": "cross_entropy",
    "prob": "importance_sampling",
}
# What each score asks: the held-out words (the score), then two trained on (shown at the end).
QUESTIONS = HELD_OUT + SEEN
NLL = "heldout/nll"
ACCURACY = "heldout/accuracy"


@dataclass(frozen=True)
class Config:
    """One run's hyperparameters."""

    learning_rate: float
    rank: int
    loss: str  # a key of LOSS_FNS

    def label(self) -> str:
        return f"lr {self.learning_rate:g}, rank {self.rank}, {self.loss}"

    def metadata(self, sweep_id: str) -> dict[str, str]:
        """The run's ``user_metadata``: its sweep (which the console groups runs by) and its
        loss variant (the server knows the learning rate and the rank itself, but sees "prob"
        only as importance_sampling)."""
        return {"sweep": sweep_id, "loss": self.loss}


@dataclass(frozen=True)
class Options:
    url: str
    api_key: str
    sweep_id: str
    base_model: str
    runs: int
    rung_steps: int
    batch: int
    learning_rates: tuple[float, ...]
    ranks: tuple[int, ...]
    losses: tuple[str, ...]
    seed: int = 0
    admin_key: str | None = None  # for the engines' busy share; None: the api_key is tried


@dataclass
class Attempt:
    """One run of the sweep, and everything measured on it."""

    number: int  # 1, 2, ...: its place in the table
    config: Config
    client: tinker.TrainingClient
    steps: int = 0
    train_nll: float | None = None  # the last step's NLL per answer token on its own batch
    nll: dict[int, float] = field(default_factory=dict)  # step -> held-out NLL
    answers: dict[int, list[str]] = field(default_factory=dict)  # step -> answers to QUESTIONS
    eliminated_at: int | None = None  # the rung after which it stopped; None: the winner

    @property
    def run_id(self) -> str:
        return str(self.client.model_id)

    def correct(self, step: int) -> int:
        """How many held-out words it translated exactly at ``step``."""
        marks = map(grade, HELD_OUT, self.answers[step][: len(HELD_OUT)])
        return sum(mark == "✓" for mark in marks)


@dataclass
class SweepResult:
    sweep_id: str
    attempts: list[Attempt]
    rung_ends: list[int]  # the step at which each rung ended
    started: float  # Unix times
    finished: float
    busy: dict[str, float] | str = ""  # each engine's busy share, or why there is none
    winner_path: str = ""  # the winner's sampler weights, saved under a name: tinker://...

    @property
    def winner(self) -> Attempt:
        (winner,) = [a for a in self.attempts if a.eliminated_at is None]
        return winner


def grid(
    learning_rates: Sequence[float], ranks: Sequence[int], losses: Sequence[str], runs: int
) -> list[Config]:
    """``runs`` configurations from the grid of every combination. Points whose level indices
    sum to an even number come first: for a 2x2x2 grid those four are its half fraction, in which
    each value of each setting appears twice and each pair of values of two settings once, so
    four runs still tell the three settings' effects apart."""
    points = list(
        itertools.product(range(len(learning_rates)), range(len(ranks)), range(len(losses)))
    )
    if not 1 <= runs <= len(points):
        raise ValueError(
            f"{runs} runs asked for; the grid of {len(learning_rates)} learning rates,"
            f" {len(ranks)} ranks and {len(losses)} losses has {len(points)}"
        )
    points.sort(key=lambda point: sum(point) % 2)  # stable: in grid order within each half
    return [Config(learning_rates[i], ranks[j], losses[k]) for i, j, k in points[:runs]]


def rung_schedule(runs: int, rung_steps: int) -> list[int]:
    """The steps each survivor trains in each rung: ``rung_steps``, then twice as many at each
    rung, as half the runs go on (so each rung costs the trainer about the same), until one is
    left."""
    schedule = [rung_steps]
    alive = max(1, runs // 2)
    while alive > 1:
        schedule.append(rung_steps * 2 ** len(schedule))
        alive //= 2
    return schedule


def halve(survivors: list[Attempt], rung: int) -> list[Attempt]:
    """The better half by held-out NLL now (at least one; ties go to the earlier run); the others
    are marked as stopped at ``rung``."""
    ranked = sorted(survivors, key=lambda attempt: attempt.nll[attempt.steps])
    kept = ranked[: max(1, len(ranked) // 2)]
    for attempt in ranked[len(kept) :]:
        attempt.eliminated_at = rung
    return [attempt for attempt in survivors if attempt in kept]


def answer_nll(output: types.ForwardBackwardOutput, data: Sequence[types.Datum]) -> float:
    """The negative log-likelihood per answer token, from the target log-probabilities that the
    server returns for every loss (so it means the same whatever loss a run trains with)."""
    total = tokens = 0.0
    for out, datum in zip(output.loss_fn_outputs, data, strict=True):
        weights = datum.loss_fn_inputs["weights"].to_numpy()
        total -= float(np.sum(out["logprobs"].to_numpy() * weights))
        tokens += float(np.sum(weights))
    return total / tokens


def for_loss(datum: types.Datum, loss: str) -> types.Datum:
    """A training example (``ChatFormat.datum``: answer tokens weighted 1) as ``loss`` takes it."""
    if loss == "cross_entropy":
        return datum
    weights = datum.loss_fn_inputs["weights"]
    zeros = types.TensorData(data=[0.0] * len(weights.data), dtype="float32", shape=weights.shape)
    return types.Datum(
        model_input=datum.model_input,
        loss_fn_inputs={
            "target_tokens": datum.loss_fn_inputs["target_tokens"],
            "logprobs": zeros,
            "advantages": weights,
        },
    )


@dataclass(frozen=True)
class Step:
    """One training step in flight: its examples and its two requests' futures."""

    data: list[types.Datum]
    forward_backward: tinker.APIFuture[types.ForwardBackwardOutput]
    optim_step: tinker.APIFuture[types.OptimStepResponse]


class Sweep:
    """The state shared by every run's coroutines: the data, the REST session, the progress."""

    def __init__(self, options: Options, chat: ChatFormat, rest: Rest, bar: tqdm) -> None:
        steps = sum(rung_schedule(options.runs, options.rung_steps))
        self.options = options
        self.chat = chat
        self.rest = rest
        self.bar = bar
        self.examples = [
            chat.datum(text) for text in training_texts(steps * options.batch, options.seed)
        ]
        self.heldout = [chat.datum(text) for text in HELD_OUT]
        self.background: list[asyncio.Task[None]] = []  # answers being sampled and reported

    async def train(self, attempt: Attempt, steps: int) -> None:
        """``steps`` more optimizer steps. Each step's requests are submitted before the step
        before it is awaited, so the trainer always has this run's next step queued and never
        waits for this process."""
        loss = attempt.config.loss
        adam = types.AdamParams(learning_rate=attempt.config.learning_rate)
        batch = self.options.batch
        in_flight: deque[Step] = deque()
        for step in range(attempt.steps, attempt.steps + steps):
            data = self.examples[step * batch : (step + 1) * batch]
            requests = [for_loss(datum, loss) for datum in data]
            forward_backward = attempt.client.forward_backward(requests, LOSS_FNS[loss])
            in_flight.append(Step(data, forward_backward, attempt.client.optim_step(adam)))
            if len(in_flight) > 1:
                await self._finish(attempt, in_flight.popleft())
        while in_flight:
            await self._finish(attempt, in_flight.popleft())

    async def _finish(self, attempt: Attempt, step: Step) -> None:
        attempt.train_nll = answer_nll(await step.forward_backward, step.data)
        await step.optim_step
        attempt.steps += 1
        self.bar.update()

    async def score(self, attempt: Attempt) -> None:
        """The held-out NLL now, reported to the run; and, in the background, its greedy
        answers to the held-out words (on the sampler, while the trainer goes on), reported as
        the exact-match accuracy at the same step."""
        step = attempt.steps
        # Both requests are submitted before the run's next training step, so both see the
        # weights of this step.
        forward = attempt.client.forward(self.heldout, "cross_entropy")
        sampler = attempt.client.save_weights_and_get_sampling_client()
        self.background.append(asyncio.create_task(self._answers(attempt, step, sampler)))
        attempt.nll[step] = answer_nll(await forward, self.heldout)
        await self.rest.report(attempt.run_id, step, {NLL: attempt.nll[step]})

    async def _answers(
        self,
        attempt: Attempt,
        step: int,
        sampler: tinker.APIFuture[tinker.SamplingClient],
    ) -> None:
        client = await sampler
        # ask() waits on its futures' results; a thread keeps it off this event loop.
        attempt.answers[step] = await asyncio.to_thread(ask, client, self.chat, QUESTIONS)
        accuracy = attempt.correct(step) / len(HELD_OUT)
        await self.rest.report(attempt.run_id, step, {ACCURACY: accuracy})


async def run_sweep(options: Options) -> SweepResult:
    """Create every run, then rung by rung: train the survivors concurrently, score them, keep
    the better half; until one is left. Every run is scored before training too."""
    configs = grid(options.learning_rates, options.ranks, options.losses, options.runs)
    schedule = rung_schedule(len(configs), options.rung_steps)
    service = tinker.ServiceClient(base_url=options.url, api_key=options.api_key)
    status: Literal["success", "errored"] = "errored"
    try:
        clients = await asyncio.gather(
            *(
                service.create_lora_training_client(
                    options.base_model,
                    rank=config.rank,
                    seed=options.seed,
                    user_metadata=config.metadata(options.sweep_id),
                )
                for config in configs
            )
        )
        attempts = [
            Attempt(number, config, client)
            for number, (config, client) in enumerate(zip(configs, clients, strict=True), 1)
        ]
        chat = ChatFormat.for_tokenizer(clients[0].get_tokenizer())
        result = await _halve_until_one(options, attempts, schedule, chat)
        # Kept under a name (the scoring's sampler weights are ephemeral): to sample the winner
        # later, from the SDK or the console's playground.
        saved = await result.winner.client.save_weights_for_sampler(f"{options.sweep_id}-winner")
        result.winner_path = saved.path
        status = "success"
        return result
    finally:
        await service.close(status)


async def _halve_until_one(
    options: Options, attempts: list[Attempt], schedule: list[int], chat: ChatFormat
) -> SweepResult:
    total = sum(steps * max(1, len(attempts) >> rung) for rung, steps in enumerate(schedule))
    started = time.time()
    rung_ends = []
    async with Rest(options.url, options.api_key) as rest:
        with tqdm(total=total, desc="sweep", unit="step", dynamic_ncols=True) as bar:
            sweep = Sweep(options, chat, rest, bar)
            survivors = attempts
            await asyncio.gather(*(sweep.score(attempt) for attempt in survivors))
            _say_scores(bar, "before training", survivors)
            for rung, steps in enumerate(schedule):
                bar.set_description(f"rung {rung}: {len(survivors)} runs x {steps} steps")
                await asyncio.gather(*(sweep.train(attempt, steps) for attempt in survivors))
                await asyncio.gather(*(sweep.score(attempt) for attempt in survivors))
                rung_ends.append(survivors[0].steps)
                _say_scores(bar, f"rung {rung} (step {rung_ends[-1]})", survivors)
                survivors = halve(survivors, rung)
            await asyncio.gather(*sweep.background)
        finished = time.time()
        result = SweepResult(options.sweep_id, attempts, rung_ends, started, finished)
        admin_key = options.admin_key or options.api_key
        try:
            result.busy = await rest.busy_shares(admin_key, started, finished)
        except (NoBusyShare, aiohttp.ClientError) as exc:  # the results stand without it
            result.busy = str(exc)
    return result


def _say_scores(bar: tqdm, when: str, attempts: list[Attempt]) -> None:
    ranked = sorted(attempts, key=lambda attempt: attempt.nll[attempt.steps])
    scores = ", ".join(f"#{a.number} {a.nll[a.steps]:.3f}" for a in ranked)
    bar.write(f"{when}: held-out NLL {scores}")
