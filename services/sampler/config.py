"""The sampler's settings, read once from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from tinsmith import models, runtime
from tinsmith.limits import bound_from_env

from .engine import DEFAULT_ROWS_PER_REQUEST, default_engine_kind


@dataclass(frozen=True)
class SamplerConfig:
    blob_url: str
    cache_dir: Path
    # "torch" or "vllm"; by default vLLM where it is installed and a GPU is present.
    engine: str = "torch"
    # Half the CPUs this process may use (runtime.torch_threads): the trainer computes too.
    torch_threads: int = field(default_factory=runtime.torch_threads)
    # How many accepted sample requests one replica holds at a time (queued or decoding). It
    # takes more from the shared queue as they finish, so replicas split the load.
    batch: int = 64
    # LoRA adapters kept loaded per base model, least recently used evicted first.
    adapter_cache_mb: int = 1024
    # A request a replica holds and stops extending (the replica died) goes to another after this:
    # it bounds how long a sampler's death delays its requests. A live replica extends each one
    # it holds every third of it (1.3 s), from its event loop (compute runs off the loop).
    ack_wait_s: float = 4.0
    # Rows (sequences decoding at once) one request holds in the torch engine's batch at most;
    # the rest of its samples wait for them, so a long request leaves room for short ones.
    rows_per_request: int = DEFAULT_ROWS_PER_REQUEST
    # How long a batch forms: when the engine is idle and is given a request, it waits this long
    # for more before its first step, so that a burst of requests (an RL group's, sent together
    # but reaching the sampler over some milliseconds) is prefilled in one forward instead of
    # one as the first arrives and the rest in another (handlers.py, ``_form``). 0: no wait.
    batch_delay_s: float = 0.01
    # The most prompt tokens one step of the torch engine prefills: a larger burst's prompts are
    # prefilled over several steps, and a longer prompt in chunks, the running rows decoding
    # between them. None: the device's default (torch_engine.default_prefill_tokens); 0: no
    # bound.
    prefill_tokens: int | None = None

    @classmethod
    def from_env(cls) -> SamplerConfig:
        env = os.environ.get
        return cls(
            blob_url=env("TINSMITH_BLOB_URL", f"file://{Path.cwd() / 'blobs'}"),
            cache_dir=Path(env("TINSMITH_CACHE_DIR", str(models.default_cache_dir()))),
            engine=default_engine_kind(),
            torch_threads=runtime.torch_threads(),
            batch=int(env("TINSMITH_SAMPLER_BATCH", cls.batch)),
            adapter_cache_mb=int(env("TINSMITH_ADAPTER_CACHE_MB", cls.adapter_cache_mb)),
            ack_wait_s=float(env("TINSMITH_SAMPLER_ACK_WAIT_S", cls.ack_wait_s)),
            rows_per_request=int(env("TINSMITH_SAMPLER_ROWS_PER_REQUEST", cls.rows_per_request)),
            batch_delay_s=float(env("TINSMITH_SAMPLER_BATCH_DELAY_MS", cls.batch_delay_s * 1e3))
            / 1e3,
            prefill_tokens=bound_from_env("TINSMITH_SAMPLER_PREFILL_TOKENS"),
        )
