"""A virtual environment per released ``tinker`` SDK version, apart from the server's, as on the
laptop of a user who has not upgraded: what ``tests/e2e/test_sdk_versions.py`` runs the protocol
story (``tests/sdk_story.py``) with.

Each is built once and reused (tests/pinned_venv.py), as ``sdk-venv-<version>`` in the test
cache. Building one takes about a minute with PyPI reachable (the SDK needs no torch).

Every package is pinned (``PINS``: a pip freeze of fresh builds, which resolved to the same
dependencies for every version below), so a later release of a dependency cannot change what the
tests run; a build that installs anything not pinned here fails and names it.
"""

from __future__ import annotations

from pathlib import Path

from tests.pinned_venv import PinnedVenv

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


def venv(version: str) -> PinnedVenv:
    return PinnedVenv(
        name=f"sdk-venv-{version}",
        pins=PINS,
        installs=((f"tinker=={version}",),),
        marker=".tinsmith-sdk-installed",
        timeout_s=900,
        exact=True,
    )


def ensure_sdk_venv(version: str) -> Path:
    """The python of tinker ``version``'s virtual environment, building it when it is missing."""
    return venv(version).ensure()
