"""`python -m services.trainer`: the training service (wiring only)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tinsmith import runtime
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus

from .config import TrainerConfig
from .engine import TrainerEngine
from .handlers import Trainer


async def start(bus: Bus) -> Callable[[], Awaitable[None]]:
    config = TrainerConfig.from_env()
    trainer = Trainer(
        bus,
        TrainerEngine(config.cache_dir, config.torch_threads),
        BlobStore(config.blob_url),
        config.idle_unload_s,
    )
    await trainer.start()
    return trainer.stop


if __name__ == "__main__":
    runtime.run("trainer", start)
