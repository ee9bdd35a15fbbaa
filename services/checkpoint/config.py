"""The checkpoint service's settings, read once from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointConfig:
    blob_url: str

    @classmethod
    def from_env(cls) -> CheckpointConfig:
        return cls(blob_url=os.environ.get("TINSMITH_BLOB_URL", "file://./blobs"))
