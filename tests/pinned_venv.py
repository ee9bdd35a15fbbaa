"""Virtual environments apart from the server's, as on a user's laptop: the cookbook's
(tests/cookbook_env.py) and one per older tinker SDK (tests/sdk_env.py).

Each is built once and reused: under ``$TINSMITH_TEST_CACHE`` (default: the tinsmith cache
directory, ``~/.cache/tinsmith``). Every package comes from exact pins (a pip freeze of a fresh
build), so a later release of a dependency cannot change what the tests run. A marker file,
written last, records a fingerprint of what the environment was built from; a directory without
a matching marker is removed and built again. Two processes that need the same environment take
turns on a lock file beside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tinsmith.models import default_cache_dir

PIP = "pip==26.3"


@dataclass(frozen=True)
class PinnedVenv:
    """``name``: the directory under the cache; ``pins``: the constraints every install runs
    under; ``installs``: the ``pip install`` arguments, in order, after pip itself; ``exact``:
    fail, naming them, if the installs brought any package the pins do not name."""

    name: str
    pins: str
    installs: tuple[tuple[str, ...], ...]
    marker: str
    timeout_s: float = 1800
    exact: bool = False

    @property
    def directory(self) -> Path:
        root = Path(os.environ.get("TINSMITH_TEST_CACHE") or default_cache_dir()).expanduser()
        return root / self.name

    @property
    def python(self) -> Path:
        return self.directory / "bin" / "python"

    def fingerprint(self) -> str:
        recipe = [sys.version, PIP, *(" ".join(step) for step in self.installs), self.pins]
        return hashlib.sha256("\n".join(recipe).encode()).hexdigest()

    def ready(self) -> bool:
        try:
            marker = json.loads((self.directory / self.marker).read_text())
        except (OSError, ValueError):
            return False
        return marker.get("fingerprint") == self.fingerprint() and self.python.exists()

    def build_seconds(self) -> float | None:
        """How long the cached environment took to build, from its marker."""
        try:
            return float(json.loads((self.directory / self.marker).read_text())["seconds"])
        except (OSError, ValueError, KeyError):
            return None

    def ensure(self) -> Path:
        """The environment's python, building the environment when it is missing."""
        if self.ready():
            return self.python
        with _locked(self.directory.parent / f".{self.name}.lock"):
            if self.ready():  # another process finished it while this one waited
                return self.python
            shutil.rmtree(self.directory, ignore_errors=True)
            started = time.monotonic()
            self._run(sys.executable, "-m", "venv", self.directory)
            constraints = self.directory / "constraints.txt"
            constraints.write_text(self.pins.strip() + "\n")
            pip = (self.python, "-m", "pip", "install", "--quiet", "--no-input")
            self._run(*pip, PIP)
            for step in self.installs:
                self._run(*pip, "-c", constraints, *step)
            if self.exact:
                self._check_exact()
            marker = {
                "fingerprint": self.fingerprint(),
                "seconds": round(time.monotonic() - started, 1),
            }
            (self.directory / self.marker).write_text(json.dumps(marker) + "\n")
        return self.python

    def _check_exact(self) -> None:
        installed = {_normalized(r) for step in self.installs for r in step if "==" in r}
        pinned = {_normalized(line) for line in self.pins.split()} | installed
        frozen = self._run(self.python, "-m", "pip", "freeze", "--exclude", "pip").split()
        unpinned = sorted(line for line in frozen if _normalized(line) not in pinned)
        if unpinned:
            raise RuntimeError(
                f"{self.name} installed packages its pins do not name: {', '.join(unpinned)}; "
                "add them to the pins"
            )

    def _run(self, *args: str | Path) -> str:
        result = subprocess.run(
            [str(a) for a in args],
            capture_output=True,
            text=True,
            timeout=self.timeout_s,
            env={k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")},
        )
        if result.returncode != 0:
            output = (result.stdout + result.stderr)[-6000:]
            command = " ".join(map(str, args))
            raise RuntimeError(f"{command} failed ({result.returncode}):\n{output}")
        return result.stdout


def user_environment(work: Path, **extra: str) -> dict[str, str]:
    """A user's shell: nothing from the server's environment, nothing cached from the hub, the
    SDK's telemetry left at its default (on), and ``extra`` on top."""
    unset = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "TINKER_BASE_URL", "TINKER_TELEMETRY")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return env | {
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(work / "hf-home"),
        "TOKENIZERS_PARALLELISM": "false",
        **extra,
    }


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _normalized(requirement: str) -> str:
    """A ``name==version`` line as PEP 503 names it (pip freeze keeps the distribution's case
    and underscores)."""
    name, _, version = requirement.partition("==")
    name = name.split("[")[0]
    return f"{name.lower().replace('_', '-').replace('.', '-')}=={version}"
