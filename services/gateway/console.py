"""The web console: a static app at ``/console`` that draws what the REST API answers.

The files (``console_app/``: one page, one script, one style sheet; no build step, nothing fetched
from elsewhere) hold no tenant's data, so they are served without a key. The app asks the
browser's user for a key once, keeps it in the browser's ``localStorage``, and sends it as
``X-API-Key`` on every API call, so the console sees exactly what the key's tenant sees through
the SDK, and the engines view only with an admin key.

Owns: serving the console's files, and the headers that keep them to this origin (a content
security policy that allows this origin's scripts and nothing inline). Does not own: any data;
each view reads a JSON route of the REST API (rest.py, http.py).
"""

from __future__ import annotations

import pathlib

from aiohttp import web

PREFIX = "/console"
_FILES = pathlib.Path(__file__).with_name("console_app")
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
# The console's own files and the API on this origin; images drawn inline as SVG, and the
# trace downloads the API signs, which may be another origin's (a presigned object store).
_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
)


def add_routes(app: web.Application) -> None:
    app.router.add_get(PREFIX, _to_index)
    app.router.add_get(PREFIX + "/", _index)
    app.router.add_get(PREFIX + "/{name}", _file)


def keyless(canonical: str) -> bool:
    """Whether a route is one of the console's files (served to anyone: no data in them)."""
    return canonical == PREFIX or canonical.startswith(PREFIX + "/")


async def _to_index(_: web.Request) -> web.StreamResponse:
    raise web.HTTPPermanentRedirect(PREFIX + "/")


async def _index(_: web.Request) -> web.StreamResponse:
    return _serve("index.html")


async def _file(request: web.Request) -> web.StreamResponse:
    return _serve(request.match_info["name"])


def _serve(name: str) -> web.StreamResponse:
    path = _FILES / name
    # Only the files shipped beside this module: a name is one path segment, never "..".
    if name.startswith(".") or path.suffix not in _TYPES or not path.is_file():
        raise web.HTTPNotFound(text=f"the console has no file {name[:100]!r}")
    return web.FileResponse(
        path,
        headers={
            "Content-Type": f"{_TYPES[path.suffix]}; charset=utf-8",
            "Content-Security-Policy": _POLICY,
            "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
        },
    )
