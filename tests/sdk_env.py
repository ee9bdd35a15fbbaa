"""A virtual environment per released ``tinker`` SDK version, apart from the server's, as on the
laptop of a user who has not upgraded: what ``tests/e2e/test_sdk_versions.py`` runs the protocol
story (``tests/sdk_story.py``) with.

Each is built once and reused: under ``$TINSMITH_TEST_CACHE`` (default: the tinsmith cache
directory, ``~/.cache/tinsmith``) as ``sdk-venv-<version>``. A marker file, written last, records
the exact pins it was built from; a directory without a matching marker is removed and built
again. Building one takes about a minute with PyPI reachable (the SDK needs no torch).

Every package is pinned (``PINS``: a pip freeze of fresh builds, which resolved to the same
dependencies for every version below), so a later release of a dependency cannot change what the
tests run; a build that installs anything not pinned here fails and names it.
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
from pathlib import Path

from tinsmith.models import default_cache_dir

PIP = "pip==26.3"
# The versions `make test-sdks` runs the story with (its SDK_VERSIONS): 0.24.1, the last that sends
# forward_backward as JSON unless the server asks for protobuf; 0.25.0, the first that always
# sends protobuf; 0.34.0, the newest of 0.30-0.34; 0.36.0, whose create-from-state still sends
# weights_info, create_model and load_weights. 0.38.0 is the one the project itself installs.
# What tinker 0.24.1, 0.25.0, 0.34.0 and 0.36.0 each resolved to (pip freeze of a fresh build).
PINS = """
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
certifi==2026.10.19.post1
click==8.5.1
distro==1.9.0
filelock==4.2.12
fsspec==2026.9.0
h11==0.16.0
h2==4.4.1
hf-xet==1.8.0
hpack==4.2.0
httpcore==1.0.9
httpcore2==2.16.2
httpx==0.28.1
httpx2==2.16.2
huggingface-hub==2.4.0
hyperframe==6.1.0
idna==3.20
markdown-it-py==4.3.0
mdurl==0.1.2
numpy==2.4.6
opentelemetry-api==1.45.2
orjson==3.13.0
packaging==26.3
protobuf==7.36.2
pydantic==2.14.4
pydantic-core==2.50.5
pygments==2.21.0
pyqwest==0.12.0
pyyaml==6.0.4
regex==2026.11.19
rich==15.0.0
safetensors==0.8.0
shellingham==1.5.4
sniffio==1.3.1
tokenizers==0.23.3
tqdm==4.70.1
transformers==5.24.0
truststore==0.10.5
typer==0.29.2
typing-extensions==4.16.0
typing-inspection==0.4.5
zstandard==0.25.0
"""

_MARKER = ".tinsmith-sdk-installed"
_INSTALL_TIMEOUT_S = 900


def venv_dir(version: str) -> Path:
    root = Path(os.environ.get("TINSMITH_TEST_CACHE") or default_cache_dir()).expanduser()
    return root / f"sdk-venv-{version}"


def _fingerprint(version: str) -> str:
    recipe = "\n".join([sys.version, PIP, f"tinker=={version}", PINS])
    return hashlib.sha256(recipe.encode()).hexdigest()


def _marker_ok(venv: Path, version: str) -> bool:
    try:
        marker = json.loads((venv / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("fingerprint") == _fingerprint(version) and (venv / "bin/python").exists()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(*args: str | Path) -> str:
    result = subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=_INSTALL_TIMEOUT_S,
        env={k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")},
    )
    if result.returncode != 0:
        output = (result.stdout + result.stderr)[-6000:]
        raise RuntimeError(f"{' '.join(map(str, args))} failed ({result.returncode}):\n{output}")
    return result.stdout


def _normalized(requirement: str) -> str:
    """A ``name==version`` line as PEP 503 names it (pip freeze keeps the distribution's case
    and underscores)."""
    name, _, version = requirement.partition("==")
    return f"{name.lower().replace('_', '-').replace('.', '-')}=={version}"


def ensure_sdk_venv(version: str) -> Path:
    """The python of tinker ``version``'s virtual environment, building it when it is missing."""
    venv = venv_dir(version)
    python = venv / "bin" / "python"
    if _marker_ok(venv, version):
        return python
    with _locked(venv.parent / f".{venv.name}.lock"):
        if _marker_ok(venv, version):  # another process finished it while we waited
            return python
        shutil.rmtree(venv, ignore_errors=True)
        started = time.monotonic()
        _run(sys.executable, "-m", "venv", venv)
        constraints = venv / "constraints.txt"
        constraints.write_text(PINS.strip() + "\n")
        pip = (python, "-m", "pip", "install", "--quiet", "--no-input")
        _run(*pip, PIP)
        _run(*pip, "-c", constraints, f"tinker=={version}")
        pinned = {_normalized(line) for line in PINS.split()} | {f"tinker=={version}"}
        frozen = _run(python, "-m", "pip", "freeze", "--exclude", "pip").split()
        unpinned = sorted(line for line in frozen if _normalized(line) not in pinned)
        if unpinned:
            raise RuntimeError(
                f"tinker {version} installed packages that tests/sdk_env.py does not pin: "
                f"{', '.join(unpinned)}; add them to PINS"
            )
        marker = {
            "fingerprint": _fingerprint(version),
            "seconds": round(time.monotonic() - started, 1),
        }
        (venv / _MARKER).write_text(json.dumps(marker) + "\n")
    return python


def user_environment(work: Path) -> dict[str, str]:
    """A user's shell for the story: nothing from the server's environment, nothing cached from
    the hub, and the SDK's telemetry left at its default (on)."""
    unset = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "TINKER_BASE_URL", "TINKER_TELEMETRY")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return env | {
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(work / "hf-home"),
        "TOKENIZERS_PARALLELISM": "false",
    }
