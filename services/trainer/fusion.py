"""Fused training: the forward_backward requests of different runs on one base model that are
ready at the same time run as one pass of the engine (``TrainerEngine.forward_backward_together``),
and their optim_steps as one AdamW step (``TrainerEngine.optim_step_together``).

Owns: the requests waiting for the compute thread, their order, and which go together. Each run
has at most one request in flight (its requests run in seq_id order), so while the compute thread
works, the other runs' next requests gather here; when it is idle (nothing runs on it or waits for
it), the one that waited longest goes, with every other waiting request of the same kind (forward,
forward_backward or optim_step) of another run: for a pass, those on the same base model up to
``token_budget`` tokens in all; for a step, all of them.

A request waits from when its run's order let it go (``Ask.since``), except an optim_step, which
keeps the place of its run's forward_backward (handlers.py): it finishes the step that pass began.
Without that, the optim_steps of runs whose passes just ended queued behind every pass that other
runs had asked for meanwhile, so that each run's step ended only once every run had had its pass;
with several RL jobs the runs then left the trainer together, sampled and waited for their
rewards together, and came back together, leaving the trainer idle in between (lockstep). A run's
next request reaches the fuser some milliseconds after its previous one ended (the result goes
back to its handler, which hands the run's next request over; handlers.py reads that one ahead
and records the previous outcome meanwhile), so after a pass or a step the fuser gives the runs it
served whose next fused request is already waiting in their order (``follows``) until it comes,
at most ``RETURN_WAIT_S``, before it chooses what goes next.

Only requests of at most ``request_tokens`` tokens are fused into a pass: on the CPU, past that a
pass's cost grows faster than its rows and fusing gains little; a GPU's passes cost their
launches more than their tokens, and fusing pays at every size measured (``default_limits``). A
request alone, or one the engine would not run together (it does not fit the memory budget in
one pass, say), runs alone through ``alone`` (the handlers' path, which makes room on the device
when it must). Nothing waits for company: a request that finds the thread free runs at once,
unless a run just served is about to hand over its next request (above). A request that runs alone
in several passes (one longer than a slice: the engine's ``plan``) goes back in line after each
pass, as if it had just come, so the requests other runs had waiting go before its next.

Each request keeps its own outcome (an invalid or non-finite one fails alone) and its own trace:
the fused work's compute span is a child of the first request's, is linked to the others', and
names the runs it carried.

Does not own: the torch math (engine.py), or a run's order of requests (handlers.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from opentelemetry import trace

from tinsmith import telemetry
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.compute import ComputeThread

from .engine import Passes, TrainerEngine, default_slice_tokens

OPTIM_STEP = "optim_step"
# The longest the fuser waits for the runs it just served to hand it their next request.
RETURN_WAIT_S = 0.05


@dataclass(eq=False)  # one request: equal only to itself
class Ask:
    """A run's forward_backward, forward or optim_step, waiting for the compute thread."""

    model_id: str
    base_model: str
    work: tp.ForwardBackwardRequest | bus.AdamParams
    tokens: int  # a step's: 0
    attributes: telemetry.Attributes
    # Its place in line (``time.monotonic``): when its run's order let it go, or for an
    # optim_step, when its run's forward_backward did.
    since: float = field(default_factory=time.monotonic)
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    future: asyncio.Future[Any] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    # A forward_backward or forward that ``alone`` began and that has passes left: it waits for
    # its next pass in line like a new request, and is never fused.
    passes: Passes | None = None

    @property
    def kind(self) -> str:
        if isinstance(self.work, bus.AdamParams):
            return OPTIM_STEP
        return "forward" if self.work.forward_only else "forward_backward"


def default_limits(device: torch.device) -> tuple[int, int]:
    """The most tokens of one fused pass, and of a request fused with others, where
    ``TINSMITH_TRAINER_FUSE_TOKENS`` and ``TINSMITH_TRAINER_FUSE_REQUEST_TOKENS`` are unset.

    On the CPU 2048 and 128: there a pass's cost is mostly its tokens', and fusing a request
    gains less than 1.1x past about 128 tokens (bench/fused_training.py, 4 runs of
    tinsmith/small on one thread, since a run's pass alone lost the slot layer's extra passes
    over the output: 1.53x at 16 tokens a request, 1.40x at 32, 1.24x at 64, 1.09x and 1.15x
    at 128, 1.09x at 192, 1.06x at 256, 0.96x at 1024; with 40-token datums, before that
    change, 1.08x and 1.09x at 240 and 320 tokens).
    What it gains there it gives back where requests come from closed loops: runs fused into
    one pass leave the trainer together and come back together (bench/duty_cycle.py: eight RL
    jobs of 320-token requests fell into lockstep and left the trainer idle a third of the
    time). On an accelerator 16384 and 4096: on an H200, 4 runs of SmolLM2-135M's shape in
    bfloat16 trained 1.82x to 2.04x faster fused at 16 to 1024 tokens each, and 1.65x at 4096
    (tinsmith/small: 1.58x), the largest measured (docs/performance.md). A fused pass is at
    most as long as a slice of one request alone (engine.default_slice_tokens)."""
    return default_slice_tokens(device), (128 if device.type == "cpu" else 4096)


class Fuser:
    def __init__(
        self,
        compute: ComputeThread,
        engine: TrainerEngine,
        alone: Callable[[Ask], Coroutine[Any, Any, Any]],
        token_budget: int,
        request_tokens: int,
        follows: Callable[[str], bool],
    ) -> None:
        """``alone(ask)`` runs one request by itself and returns its result; ``token_budget``:
        the most tokens of one fused pass (0: never fuse, steps neither); ``request_tokens``: the
        most tokens of a request that is fused with others; ``follows(model_id)``: whether the
        run's next request, already waiting in its order, comes here (a forward_backward,
        forward or optim_step)."""
        self.compute = compute
        self.engine = engine
        self.alone = alone
        self.token_budget = token_budget
        self.request_tokens = request_tokens
        self.follows = follows
        self._waiting: list[Ask] = []
        self._draining = False
        self._returning: set[str] = set()  # runs just served whose next request is coming
        self._came = asyncio.Event()
        self.fused_passes = 0  # passes that carried more than one run's request
        self.fused_steps = 0  # AdamW steps that stepped more than one run

    @property
    def waiting(self) -> int:
        """The requests waiting in line for the compute thread."""
        return len(self._waiting)

    async def forward_backward(self, ask: Ask) -> bytes:
        """Run ``ask``'s forward_backward or forward (with others, when they are ready
        together) and return its serialized output."""
        output: bytes = await self._submit(ask)
        return output

    async def optim_step(self, ask: Ask) -> dict[str, float]:
        """Take ``ask``'s optim_step (with others, when they are ready together) and return its
        metrics."""
        metrics: dict[str, float] = await self._submit(ask)
        return metrics

    def release(self, model_id: str) -> None:
        """The run hands nothing more to the fuser for now (its next request went elsewhere, or
        it has none): do not wait for it."""
        if model_id in self._returning:
            self._returning.discard(model_id)
            self._came.set()

    async def _submit(self, ask: Ask) -> Any:
        self._waiting.append(ask)
        self.release(ask.model_id)
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await ask.future

    def _goes_with(self, first: Ask, ask: Ask) -> bool:
        if ask.kind != first.kind or self.token_budget <= 0:
            return False
        if first.passes is not None or ask.passes is not None:
            return False
        if ask.kind == OPTIM_STEP:
            return True
        return (
            first.tokens <= self.request_tokens
            and ask.tokens <= self.request_tokens
            and ask.base_model == first.base_model
        )

    def _take(self) -> list[Ask]:
        """The request that waited longest, and the waiting requests that go with it (those
        that waited longest first, while the pass has room)."""
        self._waiting.sort(key=lambda ask: ask.since)  # stable: equal places keep their order
        first = self._waiting[0]
        group, tokens = [first], first.tokens
        for ask in self._waiting[1:]:
            if (
                self._goes_with(first, ask)
                and all(ask.model_id != other.model_id for other in group)
                and (ask.kind == OPTIM_STEP or tokens + ask.tokens <= self.token_budget)
            ):
                group.append(ask)
                tokens += ask.tokens
        self._waiting = [ask for ask in self._waiting if ask not in group]
        return group

    async def _drain(self) -> None:
        try:
            while self._waiting:
                # Other work on the thread (a save, a snapshot) gives more requests time to come.
                await self.compute.idle()
                await self._returned()
                group = self._take()
                for ask in group:
                    if ask.future.done() and ask.passes is not None:  # cancelled between passes
                        with contextlib.suppress(Exception):  # the thread is gone: so is the run
                            await self.compute.run(self.engine.abandon, ask.passes)
                pending = [ask for ask in group if not ask.future.done()]  # cancelled: skip
                if len(pending) > 1:
                    pending = await self._together(pending)
                for ask in pending:
                    await self._settle(ask)
        finally:
            self._draining = False

    async def _returned(self) -> None:
        """Wait until the runs just served have handed over their next requests (or gone
        elsewhere), at most ``RETURN_WAIT_S``."""
        self._returning.difference_update(ask.model_id for ask in self._waiting)  # here already
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RETURN_WAIT_S
        while self._returning and loop.time() < deadline:
            self._came.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._came.wait(), deadline - loop.time())
        self._returning.clear()

    async def _together(self, group: list[Ask]) -> list[Ask]:
        """Run ``group`` as one pass or one step; return the requests left to run alone."""
        first = group[0]
        attributes = {
            **first.attributes,
            "tinsmith.fused_runs": len(group),
            "tinsmith.fused_models": ",".join(ask.model_id for ask in group),
        }
        # A child of the first request's span, linked from the others'.
        links = [ask.context.run(trace.get_current_span).get_span_context() for ask in group[1:]]
        work: Coroutine[Any, Any, list[Any]]
        if first.kind == OPTIM_STEP:
            steps = [(ask.model_id, cast(bus.AdamParams, ask.work)) for ask in group]
            work = self.compute.linked(
                first.kind, attributes, links, self.engine.optim_step_together, steps
            )
        else:
            attributes["tinsmith.tokens"] = sum(ask.tokens for ask in group)
            passes = [(ask.model_id, cast(tp.ForwardBackwardRequest, ask.work)) for ask in group]
            work = self.compute.linked(
                first.kind, attributes, links, self.engine.forward_backward_together, passes
            )
        try:
            results = await asyncio.get_running_loop().create_task(work, context=first.context)
        except Exception:
            return group  # alone, each fails (or not) on its own
        left = []
        if sum(result is not None for result in results) > 1:
            if first.kind == OPTIM_STEP:
                self.fused_steps += 1
            else:
                self.fused_passes += 1
        for ask, result in zip(group, results, strict=True):
            if result is None:
                left.append(ask)
            else:
                self._deliver(ask, result)
        return left

    async def _settle(self, ask: Ask) -> None:
        """Run the request alone, in its own context, and hand it its outcome; or, where
        ``alone`` ran only its next pass (None, with ``ask.passes`` set), put it back in line
        behind what waits now."""
        try:
            work = self.alone(ask)
            result = await asyncio.get_running_loop().create_task(work, context=ask.context)
        except Exception as exc:
            self._deliver(ask, exc)
            return
        if result is None and ask.passes is not None:
            ask.since = time.monotonic()
            self._waiting.append(ask)
            return
        self._deliver(ask, result)

    def _deliver(self, ask: Ask, outcome: Any) -> None:
        """Hand ``ask`` its result (an exception: its failure), noting first whether its run's
        next request will come here (``_returned`` waits for it)."""
        if ask.future.done():  # cancelled
            return
        if self.follows(ask.model_id):
            self._returning.add(ask.model_id)
        if isinstance(outcome, Exception):
            ask.future.set_exception(outcome)
        else:
            ask.future.set_result(outcome)
