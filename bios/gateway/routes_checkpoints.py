"""Tinker's REST routes for training runs and checkpoints: listings, weights info, delete, publish, TTL, copy and
archive downloads.

What a self-hosted cluster means by each:
- publish / unpublish sets the checkpoint's `public` flag: every key may then load it (training from its state,
  sampling, copying it) by its path; only its owner lists, publishes, downloads or deletes it.
- a TTL (here, or `ttl_seconds` on a save) makes the coordinator delete the checkpoint once it expires.
- `external_weights_urls` are links to the checkpoint's own files (adapter and optimizer safetensors,
  metadata.json), served by this gateway under `/downloads/` for an hour without an API key.
- `copy_weights` copies the files (the caller's, or a published checkpoint) into a new run in a new session of
  the caller's key (never scheduled); weights access tokens for other accounts are refused.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from bios import account as a
from bios import messages as m
from bios import types as t
from bios.account import check_ttl
from bios.checkpoint_path import CheckpointPath
from bios.coordinator.accounts import Accounts
from bios.coordinator.front_door import FrontDoor
from bios.exceptions import BadRequestError, NotFoundError

from . import json_wire
from .http_io import API, OWNER, json_body, query_int, rfc3339
from .signed_urls import PREFIX, SignedUrls

log = logging.getLogger(__name__)

CHECKPOINT = f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}"


class CheckpointRoutes:
    def __init__(self, front_door: FrontDoor, accounts: Accounts, urls: SignedUrls) -> None:
        self.accounts = accounts
        self.front_door = front_door
        self.labels = accounts.labels
        self.audit = accounts.audit
        self.urls = urls

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get(f"{API}/training_runs", self.list_training_runs),
            web.get(f"{API}/training_runs/{{run_id}}", self.get_training_run),
            web.get(f"{API}/training_runs/{{run_id}}/checkpoints", self.list_checkpoints),
            web.delete(CHECKPOINT, self.delete_checkpoint),
            web.post(f"{CHECKPOINT}/publish", self.publish),
            web.delete(f"{CHECKPOINT}/publish", self.unpublish),
            web.put(f"{CHECKPOINT}/ttl", self.set_ttl),
            web.get(f"{CHECKPOINT}/external_weights_urls", self.external_weights_urls),
            web.get(f"{API}/checkpoints", self.list_user_checkpoints),
            web.post(f"{API}/weights_info", self.weights_info),
            web.post(f"{API}/copy_weights", self.copy_weights),
            web.get(f"{PREFIX}checkpoints/{{run_id}}/{{kind}}/{{name}}/{{file}}", self.download),
        ]

    # ------------------------------------------------------------------------------------ listings

    def _checkpoint_json(self, ckpt: t.Checkpoint) -> dict[str, Any]:
        label = self.labels.checkpoint(ckpt.bios_path)
        out = json_wire.checkpoint(ckpt)
        out["public"] = label.public
        if label.expires_at is not None:
            out["expires_at"] = rfc3339(label.expires_at)
        return out

    async def list_training_runs(self, request: web.Request) -> web.Response:
        query = m.ListTrainingRuns(query_int(request, "limit", 20), query_int(request, "offset", 0),
                                   request.query.get("project_id") or None)  # runs of that project's sessions
        return web.json_response(json_wire.training_runs(await self.front_door.query(query, request[OWNER])))

    async def get_training_run(self, request: web.Request) -> web.Response:
        run = await self.front_door.query(m.GetTrainingRun(request.match_info["run_id"]), request[OWNER])
        return web.json_response(json_wire.training_run(run))

    async def list_checkpoints(self, request: web.Request) -> web.Response:
        listing = await self.front_door.query(m.ListCheckpoints(request.match_info["run_id"]), request[OWNER])
        return web.json_response({"checkpoints": [self._checkpoint_json(c) for c in listing.checkpoints]})

    async def list_user_checkpoints(self, request: web.Request) -> web.Response:
        owner, limit, offset = request[OWNER], query_int(request, "limit", 100), query_int(request, "offset", 0)
        checkpoints: list[t.Checkpoint] = []
        for run_id in self.front_door.run_ids(owner):
            listing = await self.front_door.query(m.ListCheckpoints(run_id), owner)
            checkpoints.extend(listing.checkpoints)
        checkpoints.sort(key=lambda c: c.time, reverse=True)
        page = [self._checkpoint_json(c) for c in checkpoints[offset: offset + limit]]
        cursor = {"offset": offset, "limit": limit, "total_count": len(checkpoints)}
        return web.json_response({"checkpoints": page, "cursor": cursor})

    async def weights_info(self, request: web.Request) -> web.Response:
        owner = request[OWNER]
        path = CheckpointPath.parse((await json_body(request)).text("tinker_path"), field="tinker_path")
        await self._own(str(path), owner)
        run = await self.front_door.query(m.GetTrainingRun(path.run_id), owner)
        return web.json_response(json_wire.weights_info(run))

    # ------------------------------------------------------------------------------------ one checkpoint

    async def _own(self, path: str, owner: str) -> t.Checkpoint:
        """The caller's checkpoint at `path`; NotFoundError if it is not theirs (or does not exist)."""
        run_id = CheckpointPath.parse(path).run_id
        listing = await self.front_door.query(m.ListCheckpoints(run_id), owner)
        for ckpt in listing.checkpoints:
            if ckpt.bios_path == path:
                return ckpt
        raise NotFoundError(f"no checkpoint at {json_wire.tinker_path(path)}", field="tinker_path")

    def _path(self, request: web.Request) -> str:
        info = request.match_info
        return json_wire.checkpoint_path(info["run_id"], f"{info['kind']}/{info['name']}")

    async def delete_checkpoint(self, request: web.Request) -> web.Response:
        await self.front_door.query(m.DeleteCheckpoint(self._path(request)), request[OWNER])
        return web.json_response({})

    async def publish(self, request: web.Request) -> web.Response:
        return await self._set_public(request, True)

    async def unpublish(self, request: web.Request) -> web.Response:
        return await self._set_public(request, False)

    async def _set_public(self, request: web.Request, public: bool) -> web.Response:
        await self.front_door.query(a.PublishCheckpoint(self._path(request), public), request[OWNER])
        return web.json_response({})

    async def set_ttl(self, request: web.Request) -> web.Response:
        ttl = check_ttl((await json_body(request)).data.get("ttl_seconds"))
        await self.front_door.query(a.SetCheckpointTTL(self._path(request), ttl), request[OWNER])
        return web.json_response({})

    async def external_weights_urls(self, request: web.Request) -> web.Response:
        path = self._path(request)
        await self._own(path, request[OWNER])
        parsed = CheckpointPath.parse(path)
        base = f"{request.scheme}://{request.host}"
        urls, expires = {}, 0.0
        for file in self.accounts.checkpoint_files(parsed):
            urls[file.name], expires = self.urls.sign(base, f"checkpoints/{parsed.run_id}/{parsed.kind}/"
                                                            f"{parsed.name}/{file.name}")
        return web.json_response({"urls": urls, "expires": rfc3339(expires or 0.0)})

    async def download(self, request: web.Request) -> web.StreamResponse:
        info = request.match_info
        link = f"checkpoints/{info['run_id']}/{info['kind']}/{info['name']}/{info['file']}"
        self.urls.check(link, request.query.get("expires"), request.query.get("sig"))
        path = CheckpointPath.parse(f"bios://{info['run_id']}/{info['kind']}/{info['name']}")
        for file in self.accounts.checkpoint_files(path):
            if file.name == info["file"]:
                return web.FileResponse(file)
        raise NotFoundError(f"{info['file']} is no longer in checkpoint {path} (deleted since the link was made)")

    async def copy_weights(self, request: web.Request) -> web.Response:
        body, owner = await json_body(request), request[OWNER]
        if body.data.get("weights_access_token") or request.headers.get("X-Tinker-Weights-Access-Token"):
            raise BadRequestError("Bios copies only the calling key's own checkpoints; weights access tokens for "
                                  "another account's weights are not supported", field="weights_access_token")
        source = str(CheckpointPath.parse(body.text("source_path"), field="source_path"))
        ttl = check_ttl(body.data.get("ttl_seconds"))
        session_id = self.front_door.open_session(owner)
        copy = self.accounts.copy_checkpoint(source, owner, session_id)
        self.front_door.close_session(session_id, owner)
        project = body.data.get("destination_project_id")
        if isinstance(project, str):
            self.labels.set_project(session_id, project)
        if ttl is not None:
            self.labels.set_ttl(copy, ttl)
        self.audit.record(owner, "checkpoint_copied", source=source, path=copy)
        return web.json_response({"tinker_path": json_wire.tinker_path(copy)})
