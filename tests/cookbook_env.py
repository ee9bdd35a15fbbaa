"""A virtual environment with the tinker-cookbook, apart from the server's, as on a user's laptop.

It is built once and reused: under ``$TINSMITH_TEST_CACHE`` (default: the tinsmith cache directory,
``~/.cache/tinsmith``) as ``cookbook-venv-<version>``. A marker file, written last, records the
exact pins it was built from; a directory without a matching marker is removed and built again.
Building takes about a minute and a half with PyPI reachable (torch comes from the local CPU wheel).

The cookbook is installed with its ``math-rl`` extra (the arithmetic RL recipe imports
``math_verify``). Every package is pinned to what ``tinker-cookbook[math-rl]==0.5.8`` resolved to,
so a later release of any dependency cannot change what the tests run.
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

COOKBOOK = "tinker-cookbook==0.5.8"
# The extras installed with it: math-rl for the math_rl recipe (math-verify, pylatexenc, sympy).
COOKBOOK_EXTRAS = "math-rl"
PIP = "pip==26.3"
# Installed first and on its own: without it pip would resolve torch to the CUDA build (GBs).
TORCH = "torch==2.13.0"
# Everything tinker-cookbook[math-rl] 0.5.8 resolved to (pip freeze of a fresh build), torch's own
# dependencies included. The cookbook pulls tinker 0.38.0, the SDK version tinsmith speaks.
PINS = """
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
antlr4-python3-runtime==4.13.2
anyio==4.16.0
attrs==26.1.0
blobfile==3.3.0
certifi==2026.10.18
charset-normalizer==3.5.2
chz==0.4.0
click==8.5.1
cloudpickle==3.1.2
datasets==5.2.0
dill==0.4.1
distro==1.9.0
filelock==4.2.11
frozenlist==1.8.0
fsspec==2026.9.0
h11==0.16.0
h2==4.4.1
hf-xet==1.8.0
hpack==4.2.0
httpcore==1.0.9
httpx==0.28.1
huggingface-hub==1.33.0
hyperframe==6.1.0
idna==3.20
jinja2==3.1.6
latex2sympy2-extended==1.11.0
lxml==6.1.3
markdown-it-py==4.3.0
markupsafe==3.0.4
math-verify==0.9.0
mdurl==0.1.2
mpmath==1.3.0
multidict==7.2.1
multiprocess==0.70.19
networkx==3.6.1
numpy==2.4.6
opentelemetry-api==1.45.2
orjson==3.13.0
packaging==26.3
pandas==3.1.1
pillow==13.0.0
propcache==0.5.4
protobuf==7.36.2
pyarrow==26.0.1
pycryptodomex==3.24.2
pydantic==2.14.3
pydantic-core==2.50.4
pygments==2.21.0
pylatexenc==2.11
pyqwest==0.12.0
pyrage==1.4.0
python-dateutil==4.0.0
pyyaml==6.0.3
regex==2026.11.15
requests==2.34.2
rich==15.0.0
safetensors==0.8.0
shellingham==1.5.4
sniffio==1.3.1
sympy==1.14.0
termcolor==3.3.0
tiktoken==0.14.0
tinker==0.38.0
tinker-cookbook==0.5.8
tml-renderers==0.2.1
tokenizers==0.22.2
torch==2.13.0
tqdm==4.70.1
transformers==5.5.4
typer==0.29.2
typing-extensions==4.16.0
typing-inspection==0.4.5
tzdata==2026.6
urllib3==2.8.0
xxhash==4.1.0
yarl==1.25.1
zstandard==0.25.0
"""

_MARKER = ".tinsmith-cookbook-installed"
_INSTALL_TIMEOUT_S = 1800


def venv_dir() -> Path:
    root = Path(os.environ.get("TINSMITH_TEST_CACHE") or default_cache_dir()).expanduser()
    return root / f"cookbook-venv-{COOKBOOK.split('==')[1]}"


def _fingerprint() -> str:
    recipe = "\n".join([sys.version, PIP, TORCH, COOKBOOK, COOKBOOK_EXTRAS, PINS])
    return hashlib.sha256(recipe.encode()).hexdigest()


def _marker_ok(venv: Path) -> bool:
    try:
        marker = json.loads((venv / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("fingerprint") == _fingerprint() and (venv / "bin" / "python").exists()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(*args: str | Path) -> None:
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


def ensure_cookbook_venv() -> Path:
    """The cookbook virtual environment's python, building the environment when it is missing."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    if _marker_ok(venv):
        return python
    with _locked(venv.parent / f".{venv.name}.lock"):
        if _marker_ok(venv):  # another process finished it while we waited
            return python
        shutil.rmtree(venv, ignore_errors=True)
        started = time.monotonic()
        _run(sys.executable, "-m", "venv", venv)
        constraints = venv / "constraints.txt"
        constraints.write_text(PINS.strip() + "\n")
        pip = (python, "-m", "pip", "install", "--quiet", "--no-input")
        _run(*pip, PIP)
        _run(*pip, "-c", constraints, TORCH)
        name, version = COOKBOOK.split("==")
        _run(*pip, "-c", constraints, f"{name}[{COOKBOOK_EXTRAS}]=={version}")
        marker = {"fingerprint": _fingerprint(), "seconds": round(time.monotonic() - started, 1)}
        (venv / _MARKER).write_text(json.dumps(marker) + "\n")
    return python


def build_seconds() -> float | None:
    """How long the cached environment took to build, from its marker."""
    try:
        return float(json.loads((venv_dir() / _MARKER).read_text())["seconds"])
    except (OSError, ValueError, KeyError):
        return None


def example_conversations(python: Path) -> Path:
    """The conversations file that ships in the cookbook wheel (128 chats)."""
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    path = Path(site) / "tinker_cookbook" / "example_data" / "conversations.jsonl"
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


def user_environment(work: Path, api_key: str) -> dict[str, str]:
    """A user's shell for a recipe: nothing from the server's environment, nothing cached from
    the hub, the API key set, and the SDK's telemetry left at its default (on)."""
    unset = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "TINKER_BASE_URL", "TINKER_TELEMETRY")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return env | {
        "TINKER_API_KEY": api_key,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(work / "hf-home"),
        "TOKENIZERS_PARALLELISM": "false",
    }
