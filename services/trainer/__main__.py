"""`python -m services.trainer`: the training service (wiring only).

Runs the requests of the training runs it holds, in seq_id order, on one frozen base model per
name with a LoRA adapter per run, and writes weights to the object store (TINSMITH_BLOB_URL). Any
number of replicas may run: each run is held by one of them at a time (a JetStream KV lease of
TINSMITH_TRAINER_LEASE_S seconds, under the name TINSMITH_REPLICA), and a dead replica's runs are
rebuilt on another from their latest snapshot plus the log. It computes where TINSMITH_DEVICE says
(auto: a GPU if there is one), with base weights in TINSMITH_DTYPE, within
TINSMITH_DEVICE_MEMORY_MB, and states that placement in its readiness answer and its log. Base
models named in TINSMITH_BASE_MODELS load before it reports ready.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from services.device import DeviceError, placement_from_env
from tinsmith import health, runtime
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus

from .config import TrainerConfig
from .engine import TrainerEngine
from .handlers import Trainer

log = logging.getLogger(__name__)


async def start(bus: Bus) -> Callable[[], Awaitable[None]]:
    config = TrainerConfig.from_env()
    try:
        placement = placement_from_env()
    except DeviceError as exc:
        raise SystemExit(f"trainer: {exc}") from None
    health.state_fact("device", placement.describe())
    log.info("the trainer computes on %s", placement.describe())
    engine = TrainerEngine(
        config.cache_dir,
        config.torch_threads,
        placement,
        pass_tokens=config.pass_tokens,
        slice_tokens=config.slice_tokens,
    )
    trainer = Trainer(bus, engine, BlobStore(config.blob_url), config)
    # Its projection starts from the newest snapshot and writes its own
    # (TINSMITH_PROJECTION_SNAPSHOT_EVENTS, TINSMITH_PROJECTION_SNAPSHOT_S); a snapshot keeps
    # what a run's rebuild reads.
    trainer.projection.keep_snapshots("trainer")
    await runtime.preload_base_models(trainer.compute, engine.load_base)
    await trainer.start()
    return trainer.stop


if __name__ == "__main__":
    runtime.run("trainer", start, __doc__, computes=True)
