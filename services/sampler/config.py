"""The sampler's settings, read once from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tinsmith import models

# Trainer and sampler compute at the same time in RL loops: by default each takes half the cores.
# Oversubscribed torch threads spin-wait on each other (measured: a step 10x slower).
_HALF_THE_CORES = max(1, (os.cpu_count() or 2) // 2)


@dataclass(frozen=True)
class SamplerConfig:
    blob_url: str
    cache_dir: Path
    torch_threads: int = _HALF_THE_CORES
    # How many accepted sample requests one replica takes from the shared queue at a time; they
    # run as one batch. 1 runs requests one at a time.
    batch: int = 16

    @classmethod
    def from_env(cls) -> SamplerConfig:
        return cls(
            blob_url=os.environ.get("TINSMITH_BLOB_URL", f"file://{Path.cwd() / 'blobs'}"),
            cache_dir=Path(os.environ.get("TINSMITH_CACHE_DIR", str(models.default_cache_dir()))),
            torch_threads=int(os.environ.get("TINSMITH_TORCH_THREADS", _HALF_THE_CORES)),
            batch=int(os.environ.get("TINSMITH_SAMPLER_BATCH", cls.batch)),
        )
