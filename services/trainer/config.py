"""The trainer's settings, read once from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from tinsmith import models, runtime


@dataclass(frozen=True)
class TrainerConfig:
    blob_url: str
    cache_dir: Path
    # Half the CPUs this process may use (runtime.torch_threads): the sampler computes too.
    torch_threads: int = field(default_factory=runtime.torch_threads)
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
            torch_threads=runtime.torch_threads(),
            idle_unload_s=float(os.environ.get("TINSMITH_IDLE_UNLOAD_S", cls.idle_unload_s)),
            ack_wait_s=float(os.environ.get("TINSMITH_TRAINER_ACK_WAIT_S", cls.ack_wait_s)),
            buffer_mb=float(os.environ.get("TINSMITH_TRAINER_BUFFER_MB", cls.buffer_mb)),
        )

    @property
    def buffer_bytes(self) -> int:
        return int(self.buffer_mb * 2**20)
