"""`python -m services.sampler`: the sampling service (wiring only).

Takes accepted sample requests from the shared queue (every replica shares it), runs them on the
engine that TINSMITH_SAMPLER_ENGINE names (torch, or vllm on a GPU), on the device, dtype and
memory budget of TINSMITH_DEVICE, TINSMITH_DTYPE and TINSMITH_DEVICE_MEMORY_MB (services/
device.py), with each run's LoRA adapter fetched from the object store. It states where it
computes (a log line, and the ``device`` fact of /readyz and the readiness ping, which
``tinsmith up`` prints). Base models named in TINSMITH_BASE_MODELS load before it reports ready.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from services import device
from tinsmith import health, runtime
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus

from .config import SamplerConfig
from .engine import make_engine
from .handlers import Sampler

log = logging.getLogger(__name__)


async def start(bus: Bus) -> Callable[[], Awaitable[None]]:
    config = SamplerConfig.from_env()
    try:
        placement = device.placement_from_env()
        engine = make_engine(config, placement)
    except device.DeviceError as exc:
        raise SystemExit(f"sampler: {exc}") from None
    where = engine.describe()
    health.state_fact("device", where)
    log.info("the %s sampling engine computes on %s", config.engine, where)
    sampler = Sampler(bus, engine, BlobStore(config.blob_url), config)
    await runtime.preload_base_models(sampler.compute, engine.load_base)
    await sampler.start()
    return sampler.stop


if __name__ == "__main__":
    runtime.run("sampler", start, __doc__, computes=True)
