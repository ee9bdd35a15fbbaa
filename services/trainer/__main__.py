"""`python -m services.trainer`: the training service (wiring only).

Runs every training run's requests in seq_id order on one frozen base model per name with a LoRA
adapter per run, and writes weights to the object store (TINSMITH_BLOB_URL). One replica: it holds
its runs in memory. Base models named in TINSMITH_BASE_MODELS load before it reports ready.
"""

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
    engine = TrainerEngine(config.cache_dir, config.torch_threads)
    trainer = Trainer(bus, engine, BlobStore(config.blob_url), config)
    await runtime.preload_base_models(trainer.compute, engine.load_base)
    await trainer.start()
    return trainer.stop


if __name__ == "__main__":
    runtime.run("trainer", start, __doc__)
