"""`python -m services.sampler`: the sampling service (wiring only).

Takes accepted sample requests from the shared queue (every replica shares it), runs them on the
engine that TINSMITH_SAMPLER_ENGINE names (torch, or vllm on a GPU), with each run's LoRA adapter
fetched from the object store. Base models named in TINSMITH_BASE_MODELS load before it reports
ready.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tinsmith import runtime
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus

from .config import SamplerConfig
from .engine import make_engine
from .handlers import Sampler


async def start(bus: Bus) -> Callable[[], Awaitable[None]]:
    config = SamplerConfig.from_env()
    engine = make_engine(config)
    sampler = Sampler(bus, engine, BlobStore(config.blob_url), config)
    await runtime.preload_base_models(sampler.compute, engine.load_base)
    await sampler.start()
    return sampler.stop


if __name__ == "__main__":
    runtime.run("sampler", start, __doc__)
