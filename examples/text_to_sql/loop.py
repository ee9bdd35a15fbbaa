"""The training: held-out evaluation, the SFT warm start and the RL loop, all through the SDK.

Owns: how a question becomes a prompt and a training example (``Prompts``), the greedy
evaluation on held-out questions (``evaluate``), the warm start (``warm_start``: cross_entropy on
the training pairs' reference SQL), the RL steps (``reinforce``: a group of sampled answers per
question, each rewarded by running it, group-centred advantages, an ``importance_sampling`` or
``ppo`` step with the sampler's logprobs, then the new weights to sample from), and the order of
the whole run (``run``). Does not own: the database, the questions and the reward (the other
modules of this package), the chat format (``examples.sft_pig_latin.ChatFormat``), the metrics
route (``examples.rest``) or what is printed at the end (``report``).

The run's own scores go to ``POST /api/v1/training_runs/{id}/metrics`` at the step of the weights
they measure: the mean reward of each RL step's samples (``rl/reward``), the share of its groups
whose samples disagree, the only ones that teach anything (``rl/mixed_groups``), and the held-out
execution accuracy before training, after the warm start and after RL (``heldout/accuracy``, and
per part). The console's run page draws them beside the trainer's loss.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import tinker
from tinker import types
from tqdm import tqdm

from examples.rest import Rest
from examples.sft_pig_latin import ChatFormat
from examples.text_to_sql import questions
from examples.text_to_sql.database import TABLES, Database
from examples.text_to_sql.questions import Pair, Split
from examples.text_to_sql.reward import Grader, Verdict

# The tables, not their columns: the database is always the same one, so its columns are learned
# from the examples, like a model tuned for one database; a prompt half as long halves the cost
# of every training token on a CPU. (With every column in it, the base model got none right
# either.)
PROMPT = "Tables: {tables}.\nWrite one SQLite query, and nothing else, that answers: {question}"
RLLoss = Literal["importance_sampling", "ppo"]
TABLE_LIST = ", ".join(TABLES)
REWARD = "rl/reward"
MIXED = "rl/mixed_groups"
ACCURACY = "heldout/accuracy"


@dataclass(frozen=True)
class Options:
    url: str
    api_key: str
    base_model: str
    rank: int = 16
    seed: int = 0
    sft_steps: int = 16  # the warm start; 0: none
    sft_batch: int = 16
    sft_lr: float = 2e-3
    rl_steps: int = 8
    rl_batch: int = 8  # questions per RL step
    group: int = 8  # answers sampled per question
    rl_lr: float = 2e-4
    loss: RLLoss = "importance_sampling"
    temperature: float = 0.7
    max_tokens: int = 64  # per answer: the longest reference is 44 tokens
    eval_size: int = 48  # held-out questions scored before, after the warm start, after RL
    # Model-input tokens per forward_backward request, a step's data going in as many as it
    # takes (their gradients add up); 0: the whole step in one request, as a cookbook loop
    # sends it (tinsmith's trainer runs a request in as many passes as its memory asks).
    tokens_per_call: int = 0


@dataclass(frozen=True)
class Evaluation:
    """The greedy answers to the evaluation questions, at one point of the run."""

    name: str  # "before", "warm start", "RL"
    step: int  # the optimizer steps done
    verdicts: list[Verdict]

    def accuracy(self, keep: Sequence[bool] | None = None) -> float:
        marks = [v.right for i, v in enumerate(self.verdicts) if keep is None or keep[i]]
        return sum(marks) / len(marks) if marks else 0.0


@dataclass
class Result:
    run_id: str
    split: Split
    questions: list[Pair]  # what every evaluation asked
    evaluations: list[Evaluation] = field(default_factory=list)
    warm_losses: list[float] = field(default_factory=list)  # per answer token, each step
    rewards: list[float] = field(default_factory=list)  # each RL step's mean reward
    mixed: list[float] = field(default_factory=list)  # each RL step's share of mixed groups
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> wall time
    # The RL steps' time: sampling and grading, then training and the new sampler weights.
    rl_seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("sampling", "training"), 0.0)
    )


@dataclass(frozen=True)
class Prompts:
    """How a question becomes tokens, and a reply text, in the model's chat format."""

    chat: ChatFormat

    @property
    def stop(self) -> list[str]:
        # The end of the assistant's turn only: an untrained model's SQL may span lines.
        return self.chat.stop[:1]

    def prompt(self, question: str) -> list[int]:
        text = self.chat.prompt_template.format(PROMPT.format(tables=TABLE_LIST, question=question))
        return list(self.chat.tokenizer.encode(text, add_special_tokens=False))

    def reply(self, tokens: Sequence[int]) -> str:
        return self.chat.reply(tokens)

    def sft_datum(self, pair: Pair) -> types.Datum:
        """The reference SQL as the answer: next-token targets weighted 1 on its tokens only."""
        prompt = self.prompt(pair.question)
        answer = list(
            self.chat.tokenizer.encode(
                self.chat.answer_template.format(pair.sql), add_special_tokens=False
            )
        )
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        return _datum(prompt + answer, {"weights": weights})

    def rl_datum(
        self, prompt: list[int], sampled: types.SampledSequence, advantage: float
    ) -> types.Datum:
        """A sampled answer for ``importance_sampling``/``ppo``: its tokens' sampler logprobs and
        the answer's advantage on each of them; the prompt's positions weigh nothing."""
        answer = list(sampled.tokens)
        assert sampled.logprobs is not None, "the sampler returns each token's logprob"
        pad = [0.0] * (len(prompt) - 1)
        return _datum(
            prompt + answer,
            {
                "logprobs": pad + list(sampled.logprobs),
                "advantages": pad + [advantage] * len(answer),
            },
        )


@dataclass(frozen=True)
class Step:
    """One training step in flight: its forward_backward requests (one per chunk of its data;
    their gradients add up) and its optim_step."""

    forward_backwards: list[tinker.APIFuture[types.ForwardBackwardOutput]]
    optim_step: tinker.APIFuture[types.OptimStepResponse]

    async def done(self) -> float:
        """The step's loss (summed over its chunks), once its optim_step is done."""
        loss = 0.0
        for forward_backward in self.forward_backwards:
            output: types.ForwardBackwardOutput = await forward_backward
            loss += output.metrics["loss:sum"]
        await self.optim_step
        return loss


def chunks(data: list[types.Datum], max_tokens: int) -> list[list[types.Datum]]:
    """``data`` cut, in order, into runs of at most ``max_tokens`` model-input tokens (a datum
    longer than that alone); ``max_tokens`` 0: all of it in one."""
    if max_tokens <= 0:
        return [data]
    out: list[list[types.Datum]] = [[]]
    tokens = 0
    for datum in data:
        if out[-1] and tokens + datum.model_input.length > max_tokens:
            out.append([])
            tokens = 0
        out[-1].append(datum)
        tokens += datum.model_input.length
    return out


def _datum(tokens: list[int], inputs: dict[str, list[float]]) -> types.Datum:
    """Next-token targets for ``tokens``, with float32 ``inputs`` (one value per target)."""
    n = len(tokens) - 1
    loss_fn_inputs = {
        "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
        **{
            name: types.TensorData(data=values, dtype="float32", shape=[n])
            for name, values in inputs.items()
        },
    }
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=loss_fn_inputs
    )


def centred(rewards: Sequence[float]) -> list[float]:
    """Group-centred advantages: each answer's reward minus its group's mean."""
    mean = statistics.fmean(rewards)
    return [reward - mean for reward in rewards]


async def evaluate(
    sampler: tinker.SamplingClient,
    prompts: Prompts,
    grader: Grader,
    pairs: Sequence[Pair],
    max_tokens: int,
) -> list[Verdict]:
    """Greedy answers to every question, graded; all are sampled at once (one batch)."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=prompts.stop)
    responses = await asyncio.gather(
        *(
            sampler.sample(types.ModelInput.from_ints(prompts.prompt(pair.question)), 1, params)
            for pair in pairs
        )
    )
    return [
        grader.grade(prompts.reply(response.sequences[0].tokens), pair.sql)
        for pair, response in zip(pairs, responses, strict=True)
    ]


def batches(pairs: Sequence[Pair], size: int, seed: int) -> Callable[[], list[Pair]]:
    """A source of batches of ``size``: the pairs in a seeded order, reshuffled at each pass,
    every pair once before any twice."""
    rng = random.Random(seed)
    queue: list[Pair] = []

    def take() -> list[Pair]:
        while len(queue) < size:
            queue.extend(rng.sample(list(pairs), len(pairs)))
        batch = queue[:size]
        del queue[:size]
        return batch

    return take


class Trainer:
    """One run's training client, sampler and reports, and the progress bar over its steps."""

    def __init__(
        self,
        options: Options,
        training: tinker.TrainingClient,
        prompts: Prompts,
        grader: Grader,
        rest: Rest,
        bar: tqdm,
        show: Callable[[Evaluation, Result], None],
    ) -> None:
        self.options = options
        self.training = training
        self.prompts = prompts
        self.grader = grader
        self.rest = rest
        self.bar = bar
        self.show = show
        self.steps = 0  # optimizer steps done

    @property
    def run_id(self) -> str:
        return str(self.training.model_id)

    async def report(self, step: int, metrics: dict[str, float]) -> None:
        await self.rest.report(self.run_id, step, metrics)

    async def warm_start(self, pairs: Sequence[Pair]) -> list[float]:
        """``sft_steps`` cross_entropy steps on the reference SQL, the learning rate decaying
        linearly to a tenth; each step is submitted before the last is awaited, so the trainer
        never waits for this process. The loss per answer token of each step."""
        options = self.options
        take = batches(pairs, options.sft_batch, options.seed)
        in_flight: deque[tuple[Step, float]] = deque()
        losses: list[float] = []
        for step in range(options.sft_steps):
            data = [self.prompts.sft_datum(pair) for pair in take()]
            tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)
            lr = options.sft_lr * (1.0 - 0.9 * step / max(options.sft_steps - 1, 1))
            in_flight.append((self._step(data, "cross_entropy", lr), tokens))
            if len(in_flight) > 1:
                losses.append(await self._finish_sft(*in_flight.popleft()))
        while in_flight:
            losses.append(await self._finish_sft(*in_flight.popleft()))
        return losses

    def _step(self, data: list[types.Datum], loss: types.LossFnType, lr: float) -> Step:
        return Step(
            [
                self.training.forward_backward(chunk, loss)
                for chunk in chunks(data, self.options.tokens_per_call)
            ],
            self.training.optim_step(types.AdamParams(learning_rate=lr)),
        )

    async def _finish_sft(self, step: Step, tokens: float) -> float:
        loss = await step.done() / tokens
        self.steps += 1
        self.bar.set_postfix_str(f"warm start loss {loss:.3f}")
        self.bar.update()
        return loss

    async def reinforce(
        self, pairs: Sequence[Pair], sampler: tinker.SamplingClient, result: Result
    ) -> tinker.SamplingClient:
        """``rl_steps`` RL steps, each on ``rl_batch`` questions with ``group`` answers each,
        sampled from the latest weights; the sampler of the final weights."""
        options = self.options
        take = batches(pairs, options.rl_batch, options.seed + 1)
        params = types.SamplingParams(
            max_tokens=options.max_tokens, temperature=options.temperature, stop=self.prompts.stop
        )
        for _ in range(options.rl_steps):
            started = time.monotonic()
            batch = take()
            prompts = [self.prompts.prompt(pair.question) for pair in batch]
            responses = await asyncio.gather(
                *(
                    sampler.sample(types.ModelInput.from_ints(prompt), options.group, params)
                    for prompt in prompts
                )
            )
            data: list[types.Datum] = []
            rewards: list[float] = []
            mixed = 0
            for pair, prompt, response in zip(batch, prompts, responses, strict=True):
                group = [
                    self.grader.grade(self.prompts.reply(seq.tokens), pair.sql).reward
                    for seq in response.sequences
                ]
                rewards += group
                if len(set(group)) > 1:  # all alike: every advantage is 0, nothing to learn
                    mixed += 1
                    data += [
                        self.prompts.rl_datum(prompt, seq, advantage)
                        for seq, advantage in zip(response.sequences, centred(group), strict=True)
                    ]
            if not data:
                # Nothing to learn from this batch. A step all the same (on one group, whose
                # advantages are all 0: no gradient), so that every RL step is one optimizer
                # step and the run's curves share their steps.
                data = [
                    self.prompts.rl_datum(prompts[0], seq, 0.0) for seq in responses[0].sequences
                ]
            sampled = time.monotonic()
            reward = statistics.fmean(rewards)
            result.rewards.append(reward)
            result.mixed.append(mixed / len(batch))
            await self.report(self.steps, {REWARD: reward, MIXED: mixed / len(batch)})
            await self._step(data, options.loss, options.rl_lr).done()
            self.steps += 1
            sampler = await self.training.save_weights_and_get_sampling_client()
            result.rl_seconds["sampling"] += sampled - started
            result.rl_seconds["training"] += time.monotonic() - sampled
            self.bar.set_postfix_str(f"reward {reward:.2f}, mixed groups {mixed}/{len(batch)}")
            self.bar.update()
        return sampler

    async def evaluation(
        self, name: str, sampler: tinker.SamplingClient, result: Result
    ) -> Evaluation:
        """Score the held-out questions on ``sampler`` now, and report it at this step."""
        verdicts = await evaluate(
            sampler, self.prompts, self.grader, result.questions, self.options.max_tokens
        )
        evaluation = Evaluation(name, self.steps, verdicts)
        result.evaluations.append(evaluation)
        metrics = {ACCURACY: evaluation.accuracy()}
        for part in (questions.NEW_FILLINGS, questions.NEW_TEMPLATES):
            keep = [result.split.part(pair) == part for pair in result.questions]
            if any(keep):
                metrics[f"{ACCURACY}/{part.replace(' ', '_')}"] = evaluation.accuracy(keep)
        await self.report(self.steps, metrics)
        self.show(evaluation, result)
        return evaluation


async def run(
    options: Options,
    database: Database,
    split: Split,
    show: Callable[[Evaluation, Result], None],
) -> Result:
    """Evaluate, warm-start, evaluate, RL, evaluate: one LoRA run, start to end; ``show`` is
    called with each evaluation as soon as it is done."""
    service = tinker.ServiceClient(base_url=options.url, api_key=options.api_key)
    status: Literal["success", "errored"] = "errored"
    try:
        training = await service.create_lora_training_client(
            options.base_model,
            rank=options.rank,
            seed=options.seed,
            user_metadata={"example": "text_to_sql"},
        )
        prompts = Prompts(ChatFormat.for_tokenizer(training.get_tokenizer()))
        result = Result(
            str(training.model_id),
            split,
            questions.evaluation_set(split.held_out, options.eval_size),
        )
        total = options.sft_steps + options.rl_steps
        async with Rest(options.url, options.api_key) as rest:
            with tqdm(total=total, desc="text-to-SQL", unit="step", dynamic_ncols=True) as bar:
                trainer = Trainer(options, training, prompts, Grader(database), rest, bar, show)
                await _phases(trainer, service, split, result)
        status = "success"
        return result
    finally:
        await service.close(status)


async def _phases(
    trainer: Trainer, service: tinker.ServiceClient, split: Split, result: Result
) -> None:
    options = trainer.options
    clock = time.monotonic()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.monotonic()
        result.seconds[name] = now - clock
        clock = now

    trainer.bar.set_description("before training")
    base = await service.create_sampling_client(base_model=options.base_model)
    await trainer.evaluation("before", base, result)
    lap("evaluation before")
    sampler = base
    if options.sft_steps:
        trainer.bar.set_description("warm start")
        result.warm_losses = await trainer.warm_start(split.train)
        sampler = await trainer.training.save_weights_and_get_sampling_client()
        lap("warm start")
        await trainer.evaluation("warm start", sampler, result)
        lap("evaluation after warm start")
    trainer.bar.set_description("RL")
    sampler = await trainer.reinforce(split.train, sampler, result)
    lap("RL")
    await trainer.evaluation("RL", sampler, result)
    lap("evaluation after RL")
