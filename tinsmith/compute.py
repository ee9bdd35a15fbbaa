"""The one compute thread of a process.

Owns: running blocking compute off the event loop, on one dedicated thread, so the bus keeps
flowing while a step runs and all torch calls of a process come from the same thread (measured on
2 cores: the same step took 0.45 s on one thread and 0.66 s from several); the time the thread is
busy (the ``tinsmith.compute.busy`` counter: the engine's duty cycle); the ``compute`` spans
of traced work, which start when the work starts on the thread, not when it was queued for it;
and telling long work on the thread whether other work waits behind it (``others_waiting``).
Does not own: what runs there; this module never imports torch (a service hands in a
``GpuClock`` when its engine computes on a GPU).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, ParamSpec, Protocol, TypeVar

from opentelemetry.trace import Link, SpanContext

from tinsmith import telemetry

_P = ParamSpec("_P")
_T = TypeVar("_T")


class GpuClock(Protocol):
    """Measures GPU time between two points of the compute thread (CUDA events, say)."""

    def start(self) -> object:
        """Mark the start; return what ``elapsed_ms`` needs."""

    def elapsed_ms(self, mark: object) -> float:
        """GPU milliseconds from ``mark`` to now (it may wait for the GPU to get there)."""


class ComputeThread:
    def __init__(
        self,
        name: str,
        initializer: Callable[[], None] | None = None,
        *,
        device: Callable[[], str] = lambda: "cpu",
        gpu_clock: GpuClock | None = None,
    ) -> None:
        """``initializer`` runs first on the thread (torch's intra-op thread count, for one, is
        a setting of the thread that computes). ``device`` names where the work runs, for the
        spans; on a CUDA device, ``gpu_clock`` adds the GPU time of each traced piece of work to
        its span."""
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=initializer
        )
        self._device = device
        self.gpu_clock = gpu_clock
        self._pending = 0  # work submitted and not yet done
        self._queued = 0  # work submitted and not yet started (or cancelled before it was)
        self._queued_lock = threading.Lock()  # both threads change it
        self._idle = asyncio.Event()
        self._idle.set()

    async def idle(self) -> None:
        """Return once no work is running on the thread or waiting for it."""
        while self._pending:
            await self._idle.wait()

    def others_waiting(self) -> bool:
        """Whether other work waits for the thread: for long work on it (a loop of steps, say)
        to ask between two pieces whether to return and let it in."""
        return self._queued > 0

    async def run(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Run ``fn`` on the compute thread and await its result."""
        return await self._submit(functools.partial(self._timed, fn, *args, **kwargs))

    async def traced(
        self,
        op: str,
        attributes: telemetry.Attributes,
        fn: Callable[_P, _T],
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> _T:
        """Run ``fn`` like ``run``, inside a ``compute`` span (a child of the current span)
        carrying ``op``, ``attributes``, the device, and the GPU time on a GPU."""
        return await self.linked(op, attributes, (), fn, *args, **kwargs)

    async def linked(
        self,
        op: str,
        attributes: telemetry.Attributes,
        links: Sequence[SpanContext],
        fn: Callable[_P, _T],
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> _T:
        """``traced``, with the span linked to ``links``: the spans of other requests the work
        also does (a fused pass, say), so each request's trace leads to it."""
        work = functools.partial(fn, *args, **kwargs)
        return await self._submit(functools.partial(self._spanned, op, attributes, links, work))

    async def _submit(self, call: Callable[[], _T]) -> _T:
        # The current context goes along, so a span started on the thread has the right parent.
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        self._pending += 1
        self._idle.clear()
        start = _Start(self, call)
        with self._queued_lock:
            self._queued += 1
        try:
            return await loop.run_in_executor(self._executor, context.run, start)
        finally:
            start.unqueue()  # if it never started (cancelled while it waited)
            self._pending -= 1
            if not self._pending:
                self._idle.set()

    def _timed(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        with telemetry.BUSY.working():
            return fn(*args, **kwargs)

    def _spanned(
        self,
        op: str,
        attributes: telemetry.Attributes,
        links: Sequence[SpanContext],
        work: Callable[[], _T],
    ) -> _T:
        device = self._device()
        with telemetry.tracer.start_as_current_span(
            "compute",
            attributes={"tinsmith.op": op, "tinsmith.device": device, **attributes},
            links=[Link(context) for context in links if context.is_valid],
        ) as span:
            on_gpu = device.startswith("cuda") and telemetry.tracing()
            clock = self.gpu_clock if on_gpu else None
            mark = clock.start() if clock is not None else None
            result = self._timed(work)
            if clock is not None:
                span.set_attribute("tinsmith.gpu_time_ms", clock.elapsed_ms(mark))
            return result

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class _Start(Generic[_T]):
    """A call submitted to the compute thread, which leaves the count of waiting work once,
    when it starts or when its wait ends without it."""

    def __init__(self, thread: ComputeThread, call: Callable[[], _T]) -> None:
        self._thread = thread
        self._call = call
        self._queued = True

    def __call__(self) -> _T:
        self.unqueue()
        return self._call()

    def unqueue(self) -> None:
        with self._thread._queued_lock:
            if self._queued:
                self._queued = False
                self._thread._queued -= 1
