"""The read-only web console: static pages at `/` and the JSON they read under `/console/api/`.

The pages (`console_static/`, plain HTML + JS drawing SVG; nothing to build) ask for a key and send it as a
bearer token. A key sees its own runs; the cluster's admin key (`bios keys admin-key`) sees every key's runs
(the worker token admits workers only and is refused here). Without keys (a loopback cluster) everything is
the local owner's. Workers, queue and cycle timings are the cluster's, shown to any valid key.
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from typing import Any

from aiohttp import web

from bios import messages as m
from bios.coordinator.accounts import Accounts, StoredRun
from bios.coordinator.front_door import FrontDoor
from bios.exceptions import BadRequestError, BiosAPIError

from .http_errors import bearer_token, http_status

STATIC = resources.files("bios.gateway") / "console_static"
PAGES = {"console.js": "text/javascript", "console.css": "text/css"}
CHART_POINTS = 2000  # a run page's charts get at most this many points, thinned evenly


class Console:
    def __init__(self, front_door: FrontDoor, accounts: Accounts) -> None:
        self.accounts = accounts
        self.front_door = front_door

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/", self.index),
            web.get("/console/{name}", self.static),
            web.get("/console/api/whoami", self._json(self.whoami)),
            web.get("/console/api/runs", self._json(self.runs)),
            web.get("/console/api/runs/{run_id}", self._json(self.run)),
            web.get("/console/api/cluster", self._json(self.cluster)),
        ]

    # ------------------------------------------------------------------------------------ pages

    async def index(self, request: web.Request) -> web.Response:
        return web.Response(text=(STATIC / "index.html").read_text(), content_type="text/html")

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in PAGES:
            raise web.HTTPNotFound(text=f"no console file {name!r}")
        return web.Response(text=(STATIC / name).read_text(), content_type=PAGES[name])

    # ------------------------------------------------------------------------------------ data

    def _json(self, handler: Any) -> Any:
        async def answer(request: web.Request) -> web.Response:
            try:
                return web.json_response(await handler(request, self._viewer(request)))
            except BiosAPIError as exc:
                return web.json_response({"detail": exc.message, "type": type(exc).__name__},
                                         status=http_status(exc))
        return answer

    def _viewer(self, request: web.Request) -> str | None:
        """The owner whose runs the caller sees; None for the admin (every owner's)."""
        key = bearer_token(request.headers.get("Authorization"))
        keys = self.accounts.keys
        if keys is None:
            return self.accounts.authenticate(key)
        if keys.is_admin(key):  # the admin key (`bios keys admin-key`); the worker token is refused
            return None
        return self.accounts.authenticate(key)

    async def _read(self, body: Any, viewer: str | None) -> Any:
        if viewer is None:
            return self.front_door.read_any_owner(body)
        return await self.front_door.query(body, viewer)

    async def whoami(self, request: web.Request, viewer: str | None) -> dict[str, Any]:
        return {"owner": viewer, "admin": viewer is None, "keys": self.accounts.keys_required}

    async def runs(self, request: web.Request, viewer: str | None) -> dict[str, Any]:
        limit = _int(request, "limit", 1000)
        offset = _int(request, "offset", 0)
        return dataclasses.asdict(await self._read(m.ListRunSummaries(limit, offset), viewer))

    async def run(self, request: web.Request, viewer: str | None) -> dict[str, Any]:
        """A run page's data: summary, history (each point with its loss per token), config, checkpoints."""
        run_id = request.match_info["run_id"]
        history = await self._read(m.GetTrainingRunMetrics(run_id, CHART_POINTS), viewer)  # checks the owner
        checkpoints = await self._read(m.ListCheckpoints(run_id), viewer)
        stored = self.accounts.run(run_id)
        return {
            "summary": dataclasses.asdict(history.summary),
            "points": [{**dataclasses.asdict(p), "loss_per_token": _per_token(p)} for p in history.points],
            "config": _config(stored) if stored is not None else {},
            "user_metadata": getattr(stored, "user_metadata", None),
            "checkpoints": [
                {"path": c.bios_path, "type": c.checkpoint_type, "time": c.time, "size_bytes": c.size_bytes}
                for c in checkpoints.checkpoints],
        }

    async def cluster(self, request: web.Request, viewer: str | None) -> dict[str, Any]:
        return dataclasses.asdict(await self.front_door.query(m.GetClusterStatus()))


def _per_token(point: m.MetricPoint) -> float | None:
    """`loss:sum` over the step's input tokens: the history records no count of weighted tokens, and a sum
    grows with the batch, so this is the loss that compares across batch sizes (prompt tokens included)."""
    if point.loss is None or point.tokens <= 0:
        return None
    return point.loss / point.tokens


def _config(run: StoredRun) -> dict[str, Any]:
    """How a run was set up, as its record holds it: base model, LoRA shape, optimizer."""
    info = run.info or {}
    config: dict[str, Any] = {"base model": run.base_model}
    config.update({k.replace("_", " "): info[k] for k in ("base_dtype", "arch", "num_parameters", "max_context_length")
                   if k in info})
    config.update({k if k == "optimizer" else f"lora {k.replace('_', ' ')}": v for k, v in run.lora_config.items()})
    return config


def _int(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name, str(default))
    if not raw.isdigit():
        raise BadRequestError(f"query parameter {name} must be a non-negative integer, got {raw!r}", field=name)
    return int(raw)
