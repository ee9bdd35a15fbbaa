"""The trainer's settings, read once from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from tinsmith import models, runtime
from tinsmith.limits import bound_from_env, count_from_env


@dataclass(frozen=True)
class TrainerConfig:
    blob_url: str
    cache_dir: Path
    # Half the CPUs this process may use (runtime.torch_threads): the sampler computes too.
    torch_threads: int = field(default_factory=runtime.torch_threads)
    # A run whose session has not heart-beaten (the SDK beats every 10 s) for this long is
    # snapshotted to the object store and unloaded; its next request restores it.
    idle_unload_s: float = 120.0
    # This replica's identity in the fleet, unique among live trainers and kept across restarts
    # of its process (tinsmith up: trainer-0; Kubernetes: the pod's name), so that a restarted
    # trainer takes its predecessor's runs at once. Empty: "trainer@<host>:<pid>".
    replica: str = ""
    # How long a trainer's hold on its runs outlives its last renewal (every third of it): a
    # trainer that died (or is paused, or cut off from the bus) loses its runs to the others
    # this long after.
    lease_s: float = 3.0
    # Optimizer steps between background snapshots of a run (and one at every save_state): what
    # a rebuild after a crash re-executes is bounded by it. 0: only at save_state and unload.
    snapshot_every: int = 20
    # The most tokens of one fused pass: forward_backward requests of several runs on one base
    # model that are ready together run as one pass up to this many tokens (fusion.py). 0: each
    # request runs alone. None: the device's default (fusion.default_limits).
    fuse_tokens: int | None = None
    # The most tokens of a request that is fused with others: a larger one runs alone. None: the
    # device's default (fusion.default_limits).
    fuse_request_tokens: int | None = None
    # What one more forward_backward pass costs, in padded tokens: a batch of mixed lengths is
    # cut into passes of similar lengths where that saves more padding (grouping.py). None: the
    # device's default (engine.default_pass_tokens).
    pass_tokens: int | None = None
    # The most padded tokens of one pass of a request: a larger one runs in several, and the
    # other runs' requests are served between them (engine.plan). 0: no bound but the memory
    # budget. None: the device's default (engine.default_slice_tokens).
    slice_tokens: int | None = None

    @classmethod
    def from_env(cls) -> TrainerConfig:
        return cls(
            blob_url=os.environ.get("TINSMITH_BLOB_URL", f"file://{Path.cwd() / 'blobs'}"),
            cache_dir=Path(os.environ.get("TINSMITH_CACHE_DIR", str(models.default_cache_dir()))),
            torch_threads=runtime.torch_threads(),
            idle_unload_s=float(os.environ.get("TINSMITH_IDLE_UNLOAD_S", cls.idle_unload_s)),
            replica=os.environ.get("TINSMITH_REPLICA", cls.replica),
            lease_s=float(os.environ.get("TINSMITH_TRAINER_LEASE_S", cls.lease_s)),
            snapshot_every=int(os.environ.get("TINSMITH_SNAPSHOT_EVERY", cls.snapshot_every)),
            fuse_tokens=bound_from_env("TINSMITH_TRAINER_FUSE_TOKENS"),
            fuse_request_tokens=count_from_env("TINSMITH_TRAINER_FUSE_REQUEST_TOKENS"),
            pass_tokens=count_from_env("TINSMITH_TRAINER_PASS_TOKENS"),
            slice_tokens=bound_from_env("TINSMITH_TRAINER_SLICE_TOKENS"),
        )
