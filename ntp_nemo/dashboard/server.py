"""The dashboard's HTTP server (aiohttp): the page, its static files and one JSON state endpoint.

Every path starts with the random token (`/TOKEN/`, `/TOKEN/api/state`, `/TOKEN/static/NAME`); a
request without it gets 403, an unknown path 404, another method 405, a malformed request aiohttp's
400: a status and one line, never a traceback.  Nothing here changes the job: the server only reads.

The state of a directory is computed in a worker thread at most once per `REFRESH_S` however many
clients poll (one shared result, a lock per directory), so a thousand pages, or a thousand idle or
malformed connections, cost the training processes nothing: they never talk to this process.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import secrets
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web

from ntp_nemo.dashboard.page_state import RunReader, classify, job_dir, sweep_state
from ntp_nemo.errors import ConfigError

REFRESH_S = 0.5  # a state is recomputed at most this often per directory
STATIC = {  # name -> content type: the only files served
    "index.html": "text/html",
    "app.js": "application/javascript",
    "style.css": "text/css",
    "vendor/uPlot.iife.min.js": "application/javascript",
    "vendor/uPlot.min.css": "text/css",
}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # the token stays out of any Referer
    "Cache-Control": "no-store",
}


def new_token() -> str:
    return secrets.token_urlsafe(18)


def _finite(value: Any) -> Any:
    """JSON for browsers: NaN and infinities (a diverged loss) become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


@dataclass
class Dashboard:
    """The served directory (a run, a sweep or an empty directory) and the per-directory caches."""

    root: Path
    token: str
    allow_missing: bool = False  # started beside a run: the directory comes a moment later
    readers: dict[Path, RunReader] = field(default_factory=dict)
    cached: dict[Path, tuple[float, bytes]] = field(default_factory=dict)
    locks: dict[Path, asyncio.Lock] = field(default_factory=dict)

    def _compute(self, path: Path, kind: str) -> bytes:
        if kind == "sweep":
            doc = sweep_state(path)
        else:
            reader = self.readers.setdefault(path, RunReader(path))
            doc = reader.state()
        return json.dumps(_finite(doc), allow_nan=False).encode()

    async def state(self, path: Path, kind: str) -> bytes:
        hit = self.cached.get(path)
        if hit and time.monotonic() - hit[0] < REFRESH_S:
            return hit[1]
        lock = self.locks.setdefault(path, asyncio.Lock())
        async with lock:
            hit = self.cached.get(path)
            if hit and time.monotonic() - hit[0] < REFRESH_S:
                return hit[1]
            body = await asyncio.get_running_loop().run_in_executor(None, self._compute, path, kind)
            self.cached[path] = (time.monotonic(), body)
            return body


DASHBOARD = web.AppKey("dashboard", Dashboard)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=SECURITY_HEADERS)


@web.middleware
async def _guard(request: web.Request, handler: Any) -> web.StreamResponse:
    """The token first (403 without it), then the route; any failure is a status and one line."""
    dash: Dashboard = request.app[DASHBOARD]
    first = request.path.lstrip("/").split("/", 1)[0]
    if not hmac.compare_digest(first.encode(), dash.token.encode()):
        return _error(403, "forbidden: open the URL with the token that ntp-dashboard printed")
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason)
    except ConfigError as err:  # the directory is gone, or no longer a run
        return _error(404, str(err))
    except Exception as exc:  # a file that vanished mid-read, say: a status, never a traceback
        return _error(500, f"could not read the run: {type(exc).__name__}")


async def _page(request: web.Request) -> web.StreamResponse:
    if request.path.endswith(f"/{request.app[DASHBOARD].token}"):
        raise web.HTTPFound(request.path + "/")  # relative URLs of the page need the trailing slash
    return _static_response("index.html")


def _static_response(name: str) -> web.Response:
    data = resources.files("ntp_nemo.dashboard").joinpath("static", *name.split("/")).read_bytes()
    return web.Response(body=data, content_type=STATIC[name], headers=SECURITY_HEADERS)


async def _static(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    if name not in STATIC:
        raise web.HTTPNotFound(reason="no such file")
    return _static_response(name)


async def _api_state(request: web.Request) -> web.StreamResponse:
    dash: Dashboard = request.app[DASHBOARD]
    unknown = set(request.query) - {"job"}
    if unknown:
        raise web.HTTPBadRequest(reason=f"unknown query parameter {sorted(unknown)[0]!r} (only 'job')")
    kind = "empty" if dash.allow_missing and not dash.root.exists() else classify(dash.root)
    path = dash.root
    job = request.query.get("job")
    if job is not None:
        if kind != "sweep":
            raise web.HTTPBadRequest(reason="'job' is only for a sweep directory")
        if len(job) > 200 or (found := job_dir(dash.root, job)) is None:
            raise web.HTTPNotFound(reason=f"no job {job[:200]!r} in this sweep")
        path, kind = found, "run"
    body = await dash.state(path, "run" if kind == "empty" else kind)
    return web.Response(body=body, content_type="application/json", headers=SECURITY_HEADERS)


def make_app(root: Path, token: str, allow_missing: bool = False) -> web.Application:
    """The application serving `root` behind `token` (checked with `classify` by the caller)."""
    app = web.Application(middlewares=[_guard], client_max_size=1024)
    app[DASHBOARD] = Dashboard(Path(root), token, allow_missing)
    app.router.add_get(f"/{token}", _page)
    app.router.add_get(f"/{token}/", _page)
    app.router.add_get(f"/{token}/api/state", _api_state)
    app.router.add_get(f"/{token}/static/{{name:.+}}", _static)
    return app


async def serve(root: Path, token: str, host: str, port: int,
                allow_missing: bool = False) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (for `cleanup`) and the port bound (`port` 0: a free one)."""
    runner = web.AppRunner(make_app(root, token, allow_missing), access_log=None, handle_signals=False,
                           keepalive_timeout=15)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=2048, reuse_address=True)
    await site.start()
    return runner, int(runner.addresses[0][1])
