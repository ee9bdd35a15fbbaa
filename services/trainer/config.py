"""The trainer's settings, read once from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tinsmith import models


@dataclass(frozen=True)
class TrainerConfig:
    blob_url: str
    cache_dir: Path

    @classmethod
    def from_env(cls) -> TrainerConfig:
        return cls(
            blob_url=os.environ.get("TINSMITH_BLOB_URL", f"file://{Path.cwd() / 'blobs'}"),
            cache_dir=Path(os.environ.get("TINSMITH_CACHE_DIR", str(models.default_cache_dir()))),
        )
