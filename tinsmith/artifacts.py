"""Where artifacts live and what they contain: object-store keys, ``tinker://`` paths, names.

Owns: every object-store key, the mapping between ``tinker://<run>/<segment>/<name>`` and
checkpoint kinds, the validation of user-chosen names, and the file names inside an artifact
(PEFT's on-disk format, which vLLM loads directly, plus optimizer state and metadata). Does not
own: reading or writing bytes (blobs.py) or tensors (the trainer and sampler).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tinsmith import subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith.failures import InvalidRequest

# Files of an artifact directory.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
OPTIMIZER_STATE = "optimizer.safetensors"
GRADIENTS = "gradients.safetensors"  # snapshots only: accumulated, not yet applied
METADATA = "tinsmith.json"

SCHEME = "tinker://"
SEGMENTS = {
    bus.CHECKPOINT_KIND_TRAINING: "weights",
    bus.CHECKPOINT_KIND_SAMPLER: "sampler_weights",
    bus.CHECKPOINT_KIND_EXTERNAL: "external_weights",
}
KINDS = {segment: kind for kind, segment in SEGMENTS.items()}
# The REST API's ``checkpoint_type`` of each kind.
CHECKPOINT_TYPES = {
    bus.CHECKPOINT_KIND_TRAINING: "training",
    bus.CHECKPOINT_KIND_SAMPLER: "sampler",
    bus.CHECKPOINT_KIND_EXTERNAL: "external",
}
# Every artifact of a run lives under runs/<run id>/<what>/<name>: exactly four key components.
RUNS = "runs"
TRACES = "traces"  # traces/<session id>: a session's trace, outside every run
KEY_DEPTH = 4
_EPHEMERAL = "ephemeral"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: bus.CheckpointKind
    name: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.model_id}/{SEGMENTS[self.kind]}/{self.name}"

    @property
    def key(self) -> str:
        """Where the first save of this name is stored."""
        return f"{RUNS}/{self.model_id}/{SEGMENTS[self.kind]}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        """The REST API's id of the checkpoint within its run, e.g. ``weights/step-1``."""
        return f"{SEGMENTS[self.kind]}/{self.name}"

    def overwrite_key(self, seq_id: int) -> str:
        """Where a save that overwrites this name is stored: a new key (artifacts are never
        rewritten in place), which no checkpoint name can collide with ('@' is not allowed in
        names)."""
        return f"{self.key}@{seq_id:08d}"


def check_name(name: str) -> str:
    """A checkpoint name: no '/', not '.' or '..', at most 128 characters."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise InvalidRequest(
            f"checkpoint name {name!r:.150} is not accepted: use 1-128 characters from A-Z, a-z, "
            "0-9, '_', '-' and '.', and not '.' or '..'"
        )
    return name


def parse(path: str) -> TinkerPath:
    """Parse ``tinker://<run>/<weights|sampler_weights|external_weights>/<name>``."""
    if not isinstance(path, str) or not path.startswith(SCHEME):
        raise InvalidRequest(f"{path!r:.300} is not a tinker:// path")
    parts = path[len(SCHEME) :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS:
        raise InvalidRequest(
            f"{path!r:.300} is not a checkpoint path: expected tinker://<run id>/weights/<name>, "
            "tinker://<run id>/sampler_weights/<name> or tinker://<run id>/external_weights/<name>"
        )
    return checkpoint(parts[0], f"{parts[1]}/{parts[2]}")


def checkpoint(run_id: str, checkpoint_id: str) -> TinkerPath:
    """The checkpoint ``<segment>/<name>`` of a run, as the REST routes name it."""
    segment, _, name = checkpoint_id.partition("/")
    if segment not in KINDS:
        raise InvalidRequest(
            f"checkpoint id {checkpoint_id!r:.200} is not accepted: expected weights/<name>, "
            "sampler_weights/<name> or external_weights/<name>"
        )
    model_id = subjects.check_id("run id", run_id)
    return TinkerPath(model_id=model_id, kind=KINDS[segment], name=check_name(name))


def snapshot_key(model_id: str, next_seq_id: int) -> str:
    """The key of the snapshot the trainer takes before it lets go of an idle run."""
    return f"runs/{subjects.check_id('run id', model_id)}/snapshots/{next_seq_id:08d}"


def run_of_key(key: str) -> str:
    """The run whose artifact ``key`` is (``runs/<run id>/...``); "" for any other key."""
    parts = key.split("/")
    return parts[1] if len(parts) == KEY_DEPTH and parts[0] == RUNS else ""


def ephemeral_run(key: str) -> str:
    """The run whose unnamed sampler weights ``key`` holds (``ephemeral_sampler_key``); "" for
    any other key."""
    return run_of_key(key) if key.split("/")[2:3] == [_EPHEMERAL] else ""


def ephemeral_sampler_key(model_id: str, sampler_id: str) -> str:
    """The key of the unnamed snapshot behind ``save_weights_and_get_sampling_client``."""
    return f"{RUNS}/{model_id}/{_EPHEMERAL}/{subjects.check_id('sampler id', sampler_id)}"


def trace_key(session_id: str) -> str:
    """The key of a session's trace (``export_session_trace``), rewritten at each export."""
    return f"{TRACES}/{subjects.check_id('session id', session_id)}"


def trace_session(key: str) -> str:
    """The session whose trace ``key`` holds; "" for any other key."""
    parts = key.split("/")
    return parts[1] if len(parts) == 2 and parts[0] == TRACES else ""
