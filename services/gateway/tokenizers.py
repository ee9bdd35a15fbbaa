"""The built-in models' tokenizers, served in the layout of the Hugging Face hub.

``get_info`` names a model's tokenizer by the model's name (``tinsmith/tiny``, never a directory
of the server), and the SDK's ``TrainingClient.get_tokenizer()`` hands that name to
``AutoTokenizer.from_pretrained``. A client anywhere loads it from this gateway by pointing
huggingface_hub at it, before it is imported::

    HF_ENDPOINT=http://<gateway>/hf

The routes answer what transformers asks of the hub for a tokenizer: a file of a revision
(``HEAD`` and ``GET /hf/{org}/{model}/resolve/{revision}/{file}``, with the ``X-Repo-Commit`` and
``ETag`` headers huggingface_hub caches by), the file tree and the model's info. Each built-in
model is one repository holding its config and tokenizer files, no weights (``models.hub_snapshot``:
byte for byte the files of the model's directory); its one revision is ``main``, or the commit the
answers name. Anything else is the hub's 404, with the ``X-Error-Code`` huggingface_hub reads
(``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``). Nothing here names a server path.

Owns: these routes. Does not own: the files (tinsmith/models.py), nor the Tinker API (http.py).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from aiohttp import web

from tinsmith import models
from tinsmith.failures import TinsmithError

PREFIX = "/hf"
_Builds = dict[str, "asyncio.Future[models.HubSnapshot]"]
_SNAPSHOTS = web.AppKey("tinsmith_hub_snapshots", _Builds)


def add_routes(app: web.Application) -> None:
    """Add the hub routes under ``/hf`` to ``app``."""
    app[_SNAPSHOTS] = {}
    repo = PREFIX + "/{org}/{model}"
    api = PREFIX + "/api/models/{org}/{model}"
    app.router.add_get(repo + "/resolve/{revision}/{file:.+}", _resolve)  # HEAD too
    app.router.add_get(api, _model_info)
    app.router.add_get(api + "/revision/{revision}", _model_info)
    app.router.add_get(api + "/tree/{revision}", _tree)
    app.router.add_get(api + "/tree/{revision}/{path:.+}", _tree)


async def _resolve(request: web.Request) -> web.StreamResponse:
    snapshot = await _snapshot(request)
    if isinstance(snapshot, web.Response):
        return snapshot
    name = request.match_info["file"]
    if name not in snapshot.files:
        return _error(404, "EntryNotFound", f"{name[:200]!r} is not in {snapshot.repo_id}")
    headers = {"X-Repo-Commit": snapshot.commit, "ETag": f'"{snapshot.etag(name)}"'}
    return web.Response(
        body=snapshot.files[name], headers=headers, content_type=_content_type(name)
    )


async def _model_info(request: web.Request) -> web.StreamResponse:
    snapshot = await _snapshot(request)
    if isinstance(snapshot, web.Response):
        return snapshot
    body = {
        "_id": snapshot.commit,
        "id": snapshot.repo_id,
        "modelId": snapshot.repo_id,
        "sha": snapshot.commit,
        "private": False,
        "disabled": False,
        "gated": False,
        "tags": ["tinsmith"],
        "siblings": [{"rfilename": name} for name in snapshot.files],
    }
    return web.json_response(body, headers={"X-Repo-Commit": snapshot.commit})


async def _tree(request: web.Request) -> web.StreamResponse:
    snapshot = await _snapshot(request)
    if isinstance(snapshot, web.Response):
        return snapshot
    path = request.match_info.get("path", "").strip("/")
    if path:  # every file is at the top: a folder is never there, a file is not a folder
        return _error(404, "EntryNotFound", f"{path[:200]!r} is not a folder of {snapshot.repo_id}")
    entries: list[dict[str, Any]] = [
        {"type": "file", "path": name, "size": len(content), "oid": _git_blob_id(content)}
        for name, content in snapshot.files.items()
    ]
    return web.json_response(entries, headers={"X-Repo-Commit": snapshot.commit})


async def _snapshot(request: web.Request) -> models.HubSnapshot | web.Response:
    """The snapshot of the repository the route names, at the revision it names; the hub's
    error response when there is none."""
    repo_id = f"{request.match_info['org']}/{request.match_info['model']}"
    if repo_id not in models.builtin_names():
        return _error(404, "RepoNotFound", f"{repo_id[:200]!r} is not a model this server has")
    # Built once per process, off the event loop (reading SmolLM2's GGUF file takes seconds);
    # concurrent first requests wait for the same build, and a failed one is tried again.
    building = request.app[_SNAPSHOTS]
    build = building.get(repo_id)
    if build is None:
        build = asyncio.ensure_future(asyncio.to_thread(models.hub_snapshot, repo_id))
        building[repo_id] = build
    try:
        snapshot = await asyncio.shield(build)
    except Exception as exc:
        if building.get(repo_id) is build:
            del building[repo_id]
        if isinstance(exc, TinsmithError):  # e.g. the model's source file is not installed here
            return _error(exc.http_status, "", exc.detail)
        raise
    revision = request.match_info.get("revision", "main")
    if revision not in ("main", snapshot.commit):
        return _error(404, "RevisionNotFound", f"{repo_id} has no revision {revision[:100]!r}")
    return snapshot


def _error(status: int, code: str, message: str) -> web.Response:
    headers = {"X-Error-Message": message.encode("ascii", "backslashreplace").decode()}
    if code:
        headers["X-Error-Code"] = code
    return web.json_response({"error": message}, status=status, headers=headers)


def _content_type(name: str) -> str:
    return "application/json" if name.endswith(".json") else "application/octet-stream"


def _git_blob_id(content: bytes) -> str:
    """The id git gives a file of this content, which the hub lists as its ``oid``."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content, usedforsecurity=False).hexdigest()
