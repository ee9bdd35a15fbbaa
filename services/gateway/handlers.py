"""The gateway's shell around the operations: who is calling, then decide, append, wait, answer.

Owns: authenticating a call's key against the keys folded from the log, running an operation
(operations.py) on this replica's projection with the inputs it needs (the time, a fresh id),
carrying out its decision (append the event and wait until the projection has it; or append a
refusal and raise), and the waits that are I/O: futures (``retrieve_future`` long-polls the
projection), streamed tokens, heartbeats. Does not own: what an operation decides
(operations.py), the wire (http.py, grpc_face.py, wire.py) or any compute.

The gateway holds no state that the log cannot rebuild, so any number of replicas can run. A
replica that has not yet seen what another replica appended a moment ago (a session, a key)
catches up with the log once before it answers "not found" or "unauthenticated". The one state
in flight only: the tokens of a streamed sample request come from the sampler to the gateway
replica that accepted it (``stream_id``), for the call that waits there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from tinsmith import events, jobs, models, subjects, telemetry, tenants
from tinsmith._proto import bus_pb2 as bus
from tinsmith.eventlog import EventLog, FollowedProjection
from tinsmith.failures import InternalError, NotFound, TinsmithError, from_kind
from tinsmith.failures import future_failure as failure_body
from tinsmith.tenants import Tenant

from . import operations as ops
from .config import GatewayConfig
from .engines import Engines

log = logging.getLogger(__name__)

JsonDict = dict[str, Any]
A = TypeVar("A")
R = TypeVar("R")


class Gateway:
    def __init__(self, config: GatewayConfig, eventlog: EventLog) -> None:
        self.config = config
        self.log = eventlog
        self.projection = FollowedProjection(eventlog)
        # This replica, as streamed sample requests name it (bus.Sample.stream_to), and the
        # calls waiting for each such request's tokens.
        self.stream_id = uuid.uuid4().hex
        self._watchers: dict[str, list[asyncio.Queue[bus.SampleProgress]]] = {}
        self.engines = Engines(eventlog.bus)

    @property
    def state(self) -> jobs.Projection:
        return self.projection.state

    async def start(self) -> None:
        await self.projection.start()
        await self.engines.start()
        await self.log.bus.listen(subjects.sample_stream_subject(self.stream_id), self._progress)
        telemetry.observe(
            "tinsmith.queue.depth",
            lambda: {
                (("tinsmith.queue", "sampler"),): float(self.state.pending_samples),
                (("tinsmith.queue", "trainer"),): float(self.state.pending_training),
            },
            unit="{request}",
            description="Requests accepted into the log and not yet settled, by the queue that "
            "holds them (as the gateway's view of the log has it)",
        )

    # -- who is calling ------------------------------------------------------------------------

    async def authenticate(self, key: str | None) -> Tenant:
        """The tenant ``key`` stands for, or ``Unauthenticated``. A key issued a moment ago may
        not have reached this replica yet: one in the issued form whose id this replica does
        not know makes it catch up with the log first (in open mode too, where it would
        otherwise pass for a tenant of its own)."""
        key_id = tenants.key_id_of(key or "")
        if key_id is not None and key_id not in self.state.keys:
            await self.projection.catch_up()
        return tenants.authenticate(
            key, self.state.keys, mode=self.config.auth, defaults=self.config.quotas
        )

    # -- operations ----------------------------------------------------------------------------

    async def perform(self, tenant: Tenant, op: Callable[..., ops.Decision[A]], *args: Any) -> A:
        """Decide ``op(call, *args)`` and carry the decision out: its answer, once what it
        appended is in this replica's projection; or its error."""
        decision = await self.decide(tenant, op, *args)
        if isinstance(decision, ops.Done):
            return decision.answer
        if isinstance(decision, ops.Refuse):
            error = decision.error
            if isinstance(error, InternalError):
                log.error("a request was refused by a fault in the gateway: %s", error.detail)
            await self.log.append(decision.event, msg_id=decision.msg_id)
            raise error
        await self._append(decision)
        return decision.answer

    async def decide(self, tenant: Tenant, op: Callable[..., R], *args: Any) -> R:
        """``op`` on this replica's projection; once more after catching up with the log if
        what it names was not found (another replica may have appended it a moment ago)."""
        try:
            return op(self._call(tenant), *args)
        except NotFound:
            await self.projection.catch_up()
            return op(self._call(tenant), *args)

    def _call(self, tenant: Tenant) -> ops.Call:
        return ops.Call(
            tenant=tenant,
            state=self.state,
            limits=self.config.limits,
            sampler_queue_limit=self.config.sampler_queue_limit,
            now=time.time(),
            new_id=str(uuid.uuid4()),
            stream_id=self.stream_id,
        )

    async def _append(self, decision: ops.Append[Any]) -> None:
        """Append, and answer only once the event is durable and folded here."""
        event = decision.event
        if events.kind_of(event) == "request_accepted":
            accepted = event.request_accepted
            telemetry.annotate(
                {
                    "tinsmith.op": events.command_of(accepted),
                    "tinsmith.aggregate_id": accepted.aggregate_id,
                }
            )
            scope: contextlib.AbstractContextManager[None] = telemetry.request_scope(
                accepted.request_id
            )
        else:
            scope = contextlib.nullcontext()
        with scope:
            seq, duplicate = await self.log.append(
                event, msg_id=decision.msg_id, request_aggregate=decision.aggregate
            )
        if duplicate:
            await self.projection.catch_up()
        else:
            await self.projection.wait_for(seq)

    # -- bootstrap and sessions ----------------------------------------------------------------

    def client_config(self) -> JsonDict:
        return {
            "pjwt_auth_enabled": False,
            "parallel_fwdbwd_chunks": True,
            "proto_compress_fwdbwd": False,
            # SDKs before 0.25 send forward_backward as JSON, and forward as JSON to a route of
            # its own, unless these ask for the protobuf forward_backward (forward_only for a
            # forward) that 0.25 and later always send: the one form this gateway reads.
            "proto_write_fwdbwd": True,
            "fwd_via_fwdbwd": True,
            # Chunks must fit a NATS message with its envelope (8 MB max payload).
            "fwdbwd_max_chunk_bytes_count": self.config.max_chunk_bytes,
            "fwdbwd_max_chunk_len": 1024,
            "custom_loss_server_side": False,
            "sample_use_retrieve_futures": False,
            "sample_join_sampling_session": False,
        }

    def server_capabilities(self) -> JsonDict:
        return {
            "supported_models": [
                {
                    "model_name": spec.name,
                    "max_context_length": spec.max_context_length,
                    "trainable": True,
                    "sampleable": True,
                }
                for spec in models.registry().values()
            ]
        }

    async def heartbeat(self, tenant: Tenant, request: ops.SessionRef) -> None:
        session = await self.perform(tenant, ops.heartbeat, request)
        await self.log.bus.notify(subjects.SESSION_HEARTBEATS, session.session_id.encode())

    def usage(self, tenant: Tenant) -> JsonDict:
        return ops.usage(self._call(tenant)).answer

    # -- sampling streams and cancels ----------------------------------------------------------

    @contextlib.contextmanager
    def watch(self, request_id: str) -> Iterator[asyncio.Queue[bus.SampleProgress]]:
        """The tokens of a streamed request as they reach this replica, in order. Watch before
        accepting it (``ops.sample`` with ``stream``), so none is missed; none comes for a
        request accepted without ``stream`` or by another replica."""
        queue: asyncio.Queue[bus.SampleProgress] = asyncio.Queue()
        self._watchers.setdefault(request_id, []).append(queue)
        try:
            yield queue
        finally:
            watchers = self._watchers[request_id]
            watchers.remove(queue)
            if not watchers:
                del self._watchers[request_id]

    async def _progress(self, data: bytes) -> None:
        progress = bus.SampleProgress.FromString(data)
        for queue in self._watchers.get(progress.request_id, ()):
            queue.put_nowait(progress)

    async def cancel_sample(self, tenant: Tenant, request_id: str, detail: str) -> None:
        """Cancel a pending sample request of the tenant's whose caller went away: its future
        fails as cancelled, and the samplers drop its work (or skip it when they fetch it)."""
        with contextlib.suppress(NotFound):
            pending = await self.perform(tenant, ops.cancel_sample, ops.RequestRef(request_id))
            if pending is not None:
                await self.log.cancel(
                    pending.request_id, pending.aggregate_id, detail, request_aggregate="sampler"
                )

    # -- futures -------------------------------------------------------------------------------

    async def retrieve_future(
        self, tenant: Tenant, request: ops.RequestRef
    ) -> tuple[bytes | JsonDict, str]:
        """Long-poll one future: its result as ``(body, media type)``, a failure, or try_again."""
        telemetry.annotate({"tinsmith.request_id": request.request_id})
        settled = await self._settled(tenant, request.request_id, self.config.long_poll_s)
        if settled.status is jobs.Status.PENDING:
            try_again = {"type": "try_again", "request_id": request.request_id}
            return {**try_again, "queue_state": "active"}, ""
        if settled.status is jobs.Status.FAILED:
            return failure_body(settled.error_kind, settled.error_detail), ""
        return await self.log.get_result(settled.result_seq)

    async def result(
        self, tenant: Tenant, request_id: str, timeout_s: float | None
    ) -> tuple[bytes, str]:
        """Wait for one future (the gRPC face): its result as ``(body, media type)``; a failed
        request raises its error, and one still pending after ``timeout_s`` raises
        ``TimeoutError`` (it stays queued: asking again later gets its result)."""
        telemetry.annotate({"tinsmith.request_id": request_id})
        settled = await self._settled(tenant, request_id, timeout_s)
        if settled.status is jobs.Status.PENDING:
            raise TimeoutError(f"request {request_id} is still pending")
        if settled.status is jobs.Status.FAILED:
            raise from_kind(settled.error_kind, settled.error_detail)
        return await self.log.get_result(settled.result_seq)

    async def _settled(
        self, tenant: Tenant, request_id: str, timeout_s: float | None
    ) -> jobs.RequestState:
        """The tenant's request once it has settled, or as it stands after ``timeout_s``."""
        await self.decide(tenant, ops.future, request_id)

        def settled() -> bool:
            return self.state.requests[request_id].status is not jobs.Status.PENDING

        if not settled():
            await self.projection.wait_until(settled, timeout_s)
        return self.state.requests[request_id]

    async def check_download(self, tenant_name: str, blob_key: str) -> str:
        """Refuse (404) a signed download whose tenant may no longer read the checkpoint it
        names: deleted, or neither the tenant's nor published. Answers what it names (the
        checkpoint's tinker:// path, or a trace's session id)."""
        tenant = Tenant(name=tenant_name, quotas=self.config.quotas)
        return await self.decide(tenant, ops.downloadable, blob_key)

    # -- refusals of what could not be read ----------------------------------------------------

    async def spend_refused(
        self, tenant: Tenant, error: TinsmithError, model_id: str, seq_id: int
    ) -> None:
        """Spend ``seq_id`` of the tenant's run ``model_id`` with ``error``, for a request
        refused before it could be read (too large), so that the run's later requests do not
        wait for it. Anything else (not the tenant's run, spent already, too far ahead) is left
        alone: the client sees the refusal either way."""
        with contextlib.suppress(TinsmithError):
            await self.perform(tenant, ops.spend_refused, error, model_id, seq_id)
