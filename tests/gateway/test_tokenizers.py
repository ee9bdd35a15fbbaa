"""The gateway's hub routes: each built-in model's config and tokenizer files, in the layout
huggingface_hub downloads from, so that ``AutoTokenizer.from_pretrained("tinsmith/tiny")`` (what
the SDK's ``get_tokenizer()`` calls with get_info's tokenizer id) loads them with
``HF_ENDPOINT=<gateway>/hf``; and nothing else, with the hub's error codes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.gateway import tokenizers
from tinsmith import models

TINY = models.hub_snapshot(models.TINY)


@pytest.fixture
async def client() -> AsyncIterator[TestClient[web.Request, web.Application]]:
    app = web.Application()
    tokenizers.add_routes(app)
    async with TestClient(TestServer(app, host="127.0.0.1")) as test_client:
        yield test_client


async def test_a_file_of_main_is_served_with_the_headers_huggingface_hub_caches_by(
    client: TestClient[web.Request, web.Application],
) -> None:
    head = await client.head("/hf/tinsmith/tiny/resolve/main/tokenizer.json")
    got = await client.get(f"/hf/tinsmith/tiny/resolve/{TINY.commit}/tokenizer.json")
    body = await got.read()

    assert head.status == got.status == 200
    assert head.headers["X-Repo-Commit"] == got.headers["X-Repo-Commit"] == TINY.commit
    digest = hashlib.sha256(body).hexdigest()
    assert head.headers["ETag"] == got.headers["ETag"] == f'"{digest}"'
    assert int(head.headers["Content-Length"]) == len(body)
    assert body == TINY.files["tokenizer.json"]
    assert body == (models.materialize(models.TINY) / "tokenizer.json").read_bytes()


async def test_model_info_and_tree_list_the_files(
    client: TestClient[web.Request, web.Application],
) -> None:
    info = await (await client.get("/hf/api/models/tinsmith/tiny/revision/main")).json()
    tree = await (await client.get("/hf/api/models/tinsmith/tiny/tree/main?recursive=true")).json()

    assert (info["id"], info["sha"]) == ("tinsmith/tiny", TINY.commit)
    assert sorted(s["rfilename"] for s in info["siblings"]) == sorted(TINY.files)
    assert "model.safetensors" not in TINY.files
    config = next(entry for entry in tree if entry["path"] == "config.json")
    content = TINY.files["config.json"]
    git_id = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
    assert config == {"type": "file", "path": "config.json", "size": len(content), "oid": git_id}
    assert sorted(entry["path"] for entry in tree) == sorted(TINY.files)


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("/hf/tinsmith/nope/resolve/main/config.json", "RepoNotFound"),
        ("/hf/etc/passwd/resolve/main/config.json", "RepoNotFound"),
        ("/hf/api/models/tinsmith/nope", "RepoNotFound"),
        ("/hf/tinsmith/tiny/resolve/v2/config.json", "RevisionNotFound"),
        ("/hf/api/models/tinsmith/tiny/tree/" + "0" * 40, "RevisionNotFound"),
        ("/hf/tinsmith/tiny/resolve/main/model.safetensors", "EntryNotFound"),
        ("/hf/tinsmith/tiny/resolve/main/vocab.json", "EntryNotFound"),
        ("/hf/tinsmith/tiny/resolve/main/sub/config.json", "EntryNotFound"),
        ("/hf/api/models/tinsmith/tiny/tree/main/additional_chat_templates", "EntryNotFound"),
    ],
)
async def test_what_is_not_there_is_the_hubs_404_and_names_no_server_path(
    client: TestClient[web.Request, web.Application], path: str, code: str
) -> None:
    response = await client.get(path)
    body = await response.json()

    assert (response.status, response.headers.get("X-Error-Code")) == (404, code)
    assert response.headers["X-Error-Message"] == body["error"]
    for server_path in (str(models.default_cache_dir()), str(Path.home()), os.getcwd()):
        assert server_path not in json.dumps(body)


async def test_a_model_whose_source_is_missing_is_an_error_and_is_tried_again(
    client: TestClient[web.Request, web.Application], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tinsmith.failures import InternalError

    calls: list[str] = []

    def missing(name: str) -> models.HubSnapshot:
        calls.append(name)
        raise InternalError("model file SmolLM2-135M-Instruct.Q4_1.gguf is not installed")

    monkeypatch.setattr(models, "hub_snapshot", missing)
    path = f"/hf/{models.SMOLLM2}/resolve/main/tokenizer.json"

    first, second = await client.get(path), await client.get(path)

    assert first.status == second.status == 500
    assert "not installed" in (await first.json())["error"]
    assert calls == [models.SMOLLM2, models.SMOLLM2]


async def test_concurrent_first_requests_share_one_build(
    client: TestClient[web.Request, web.Application], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = models.hub_snapshot

    def counted(name: str) -> models.HubSnapshot:
        calls.append(name)
        return real(name)

    monkeypatch.setattr(models, "hub_snapshot", counted)

    responses = await asyncio.gather(
        *(client.get("/hf/tinsmith/small/resolve/main/config.json") for _ in range(8))
    )

    assert [r.status for r in responses] == [200] * 8
    assert calls == [models.SMALL]


_LOAD = """
import json, sys
from tinker.lib.public_interfaces.sampling_client import _load_tokenizer_from_model_info
from transformers import AutoTokenizer

name, directory, text = sys.argv[1:]
# What TrainingClient.get_tokenizer() does with get_info's model_name and tokenizer_id.
by_name = _load_tokenizer_from_model_info(name, name)
by_path = AutoTokenizer.from_pretrained(directory)
print(json.dumps([by_name(text)["input_ids"], by_path(text)["input_ids"], by_name.eos_token]))
"""


async def _load(url: str, hub: Path, offline: bool, directory: Path) -> list[object]:
    env = {
        **os.environ,
        "HF_ENDPOINT": url,
        "HF_HUB_CACHE": str(hub),
        "HF_HUB_OFFLINE": "1" if offline else "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    text = "User: What is 12 plus 345?<|im_end|>\nAssistant: 357!"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _LOAD,
        models.TINY,
        str(directory),
        text,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()[-3000:]
    result: list[object] = json.loads(out.decode().splitlines()[-1])
    return result


async def test_the_sdks_get_tokenizer_loads_a_built_in_model_through_the_gateway(
    client: TestClient[web.Request, web.Application], tmp_path: Path
) -> None:
    """Online against the gateway, then offline from what that left in the client's cache."""
    pytest.importorskip("transformers")
    pytest.importorskip("tinker")
    url = str(client.make_url(tokenizers.PREFIX))
    directory = models.materialize(models.TINY)

    online = await _load(url, tmp_path / "hub", offline=False, directory=directory)
    offline = await _load(url, tmp_path / "hub", offline=True, directory=directory)

    by_name, by_path, eos = online
    assert by_name == by_path and eos == "<|endoftext|>"
    assert offline == online
    assert (tmp_path / "hub" / "models--tinsmith--tiny" / "refs" / "main").read_text() == (
        TINY.commit
    )
