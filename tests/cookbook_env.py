"""A virtual environment with the tinker-cookbook, apart from the server's, as on a user's laptop.

It is built once and reused (tests/pinned_venv.py), as ``cookbook-venv-<version>`` in the test
cache. Building takes about a minute and a half with PyPI reachable (torch comes from the local
CPU wheel, installed first and on its own).

The cookbook is installed with its ``math-rl`` extra (the arithmetic RL recipe imports
``math_verify``). Every package is pinned to what ``tinker-cookbook[math-rl]==0.5.8`` resolved to,
so a later release of any dependency cannot change what the tests run.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests import pinned_venv
from tests.pinned_venv import PinnedVenv

COOKBOOK = "tinker-cookbook==0.5.8"
# The extras installed with it: math-rl for the math_rl recipe (math-verify, pylatexenc, sympy).
COOKBOOK_EXTRAS = "math-rl"
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

VENV = PinnedVenv(
    name=f"cookbook-venv-{COOKBOOK.split('==')[1]}",
    pins=PINS,
    installs=(
        (TORCH,),
        (f"{COOKBOOK.split('==')[0]}[{COOKBOOK_EXTRAS}]=={COOKBOOK.split('==')[1]}",),
    ),
    marker=".tinsmith-cookbook-installed",
)


def ensure_cookbook_venv() -> Path:
    """The cookbook virtual environment's python, building the environment when it is missing."""
    return VENV.ensure()


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
    """A user's shell for a recipe (``pinned_venv.user_environment``), with the API key set and
    the datasets library offline too."""
    return pinned_venv.user_environment(work, TINKER_API_KEY=api_key, HF_DATASETS_OFFLINE="1")
