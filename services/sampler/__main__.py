"""`python -m services.sampler`: the sampling service (wiring only)."""

from __future__ import annotations

from tinsmith import runtime
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus

from .config import SamplerConfig
from .engine import SamplerEngine
from .handlers import Sampler


async def start(bus: Bus) -> None:
    config = SamplerConfig.from_env()
    engine = SamplerEngine(config.cache_dir, config.torch_threads)
    sampler = Sampler(bus, engine, BlobStore(config.blob_url), config)
    await sampler.start()


if __name__ == "__main__":
    runtime.run("sampler", start)
