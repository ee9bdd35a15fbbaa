"""The sampler's settings, read once from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tinsmith import models

from .engine import DEFAULT_ROWS_PER_REQUEST, default_engine_kind

# Trainer and sampler compute at the same time in RL loops: by default each takes half the cores.
# Oversubscribed torch threads spin-wait on each other (measured: a step 10x slower).
_HALF_THE_CORES = max(1, (os.cpu_count() or 2) // 2)


@dataclass(frozen=True)
class SamplerConfig:
    blob_url: str
    cache_dir: Path
    # "torch" or "vllm"; by default vLLM where it is installed and a GPU is present.
    engine: str = "torch"
    torch_threads: int = _HALF_THE_CORES
    # How many accepted sample requests one replica holds at a time (queued or decoding). It
    # takes more from the shared queue as they finish, so replicas split the load.
    batch: int = 64
    # LoRA adapters kept loaded per base model, least recently used evicted first.
    adapter_cache_mb: int = 1024
    # A request a replica holds and stops extending (the replica died) goes to another after this.
    ack_wait_s: float = 30.0
    # Rows (sequences decoding at once) one request holds in the torch engine's batch at most;
    # the rest of its samples wait for them, so a long request leaves room for short ones.
    rows_per_request: int = DEFAULT_ROWS_PER_REQUEST

    @classmethod
    def from_env(cls) -> SamplerConfig:
        env = os.environ.get
        return cls(
            blob_url=env("TINSMITH_BLOB_URL", f"file://{Path.cwd() / 'blobs'}"),
            cache_dir=Path(env("TINSMITH_CACHE_DIR", str(models.default_cache_dir()))),
            engine=default_engine_kind(),
            torch_threads=int(env("TINSMITH_TORCH_THREADS", _HALF_THE_CORES)),
            batch=int(env("TINSMITH_SAMPLER_BATCH", cls.batch)),
            adapter_cache_mb=int(env("TINSMITH_ADAPTER_CACHE_MB", cls.adapter_cache_mb)),
            ack_wait_s=float(env("TINSMITH_SAMPLER_ACK_WAIT_S", cls.ack_wait_s)),
            rows_per_request=int(env("TINSMITH_SAMPLER_ROWS_PER_REQUEST", cls.rows_per_request)),
        )
