"""The trainer's settings, read once from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tinsmith import models

# Trainer and sampler compute at the same time in RL loops: by default each takes half the cores.
# Oversubscribed torch threads spin-wait on each other (measured: a step 10x slower).
_HALF_THE_CORES = max(1, (os.cpu_count() or 2) // 2)


@dataclass(frozen=True)
class TrainerConfig:
    blob_url: str
    cache_dir: Path
    torch_threads: int = _HALF_THE_CORES
    # A run whose session has not heart-beaten (the SDK beats every 10 s) for this long is
    # snapshotted to the object store and unloaded; its next request restores it.
    idle_unload_s: float = 120.0
    # A request held by a trainer that stops extending it (the trainer died) is delivered again
    # after this long. The trainer extends every request it holds every third of it, however long
    # it waits for its turn, so this only bounds how long a dead trainer's work goes unnoticed.
    ack_wait_s: float = 60.0
    # Payload bytes of requests waiting for their turn (far ahead of their run's next seq_id)
    # that the trainer keeps in memory; beyond them it reads each one back from the log when its
    # turn comes.
    buffer_mb: float = 256.0

    @classmethod
    def from_env(cls) -> TrainerConfig:
        return cls(
            blob_url=os.environ.get("TINSMITH_BLOB_URL", f"file://{Path.cwd() / 'blobs'}"),
            cache_dir=Path(os.environ.get("TINSMITH_CACHE_DIR", str(models.default_cache_dir()))),
            torch_threads=int(os.environ.get("TINSMITH_TORCH_THREADS", _HALF_THE_CORES)),
            idle_unload_s=float(os.environ.get("TINSMITH_IDLE_UNLOAD_S", cls.idle_unload_s)),
            ack_wait_s=float(os.environ.get("TINSMITH_TRAINER_ACK_WAIT_S", cls.ack_wait_s)),
            buffer_mb=float(os.environ.get("TINSMITH_TRAINER_BUFFER_MB", cls.buffer_mb)),
        )

    @property
    def buffer_bytes(self) -> int:
        return int(self.buffer_mb * 2**20)
