"""Tinker's batch future routes: `retrieve_futures` (which of a sampling client's requests finished) and
`cancel_future`.

`retrieve_futures` long-polls like `retrieve_future` and lists, per sampling session and clone
(`seq_id // 1_000_000_000`), the requests settled since the client's cursor; the client then fetches each
result with `retrieve_future`. `cancel_future` stops the gateway holding an unfinished request's result; the
coordinator still runs a request it accepted (Bios does not abort accepted work), so `client/dynamic_config`
keeps `sample_cancel_enabled` false and the SDK never relies on it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from aiohttp import web

from bios import ids
from bios.exceptions import BadRequestError

from .futures import Promise, Promises
from .http_io import API, OWNER, json_body

CLONE_BLOCK = 1_000_000_000  # the SDK numbers a cloned SamplingClient's requests from clone_id * this
KEEP_COMPLETIONS = 100_000  # settled requests remembered for batch polls


@dataclass(frozen=True)
class Completion:
    cursor: int
    request_id: str
    owner: str
    target: str
    clone: int
    failed: bool


class FutureRoutes:
    def __init__(self, promises: Promises, poll_s: float) -> None:
        self.promises = promises
        self.poll_s = poll_s
        self.completions: deque[Completion] = deque(maxlen=KEEP_COMPLETIONS)
        self._cursor = 0
        self._changed = asyncio.Event()
        promises.listeners.append(self._settled)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post(f"{API}/retrieve_futures", self.retrieve_futures),
            web.post(f"{API}/cancel_future", self.cancel_future),
        ]

    def _settled(self, promise: Promise) -> None:
        try:
            request = ids.RequestId.parse(promise.request_id)
        except BadRequestError:
            return
        self._cursor += 1
        self.completions.append(Completion(self._cursor, promise.request_id, promise.owner, request.target,
                                           request.seq // CLONE_BLOCK, promise.failed))
        self._changed.set()
        self._changed = asyncio.Event()

    def _since(self, owner: str, target: str, clone: int, cursor: int) -> list[Completion]:
        return [c for c in self.completions
                if c.cursor > cursor and c.owner == owner and c.target == target and c.clone == clone]

    async def retrieve_futures(self, request: web.Request) -> web.Response:
        body, owner = (await json_body(request)).data, request[OWNER]
        target = body.get("target")
        if not isinstance(target, dict) or target.get("type", "sampling_session") != "sampling_session" \
                or not isinstance(target.get("sampling_session_id"), str):
            raise BadRequestError("target must be {type: sampling_session, sampling_session_id, cloned_sampler_id}",
                                  field="target")
        session, clone = target["sampling_session_id"], int(target.get("cloned_sampler_id") or 0)
        cursor = int(body.get("prev_cursor") or 0)
        timeout = body.get("timeout")
        wait_s = self.poll_s if timeout is None else min(float(timeout), self.poll_s)
        found = self._since(owner, session, clone, cursor)
        if not found and wait_s > 0:
            try:
                async with asyncio.timeout(wait_s):
                    while not found:
                        await self._changed.wait()
                        found = self._since(owner, session, clone, cursor)
            except TimeoutError:
                pass
        completions = [{"state": "failed" if c.failed else "finished", "request_id": c.request_id} for c in found]
        return web.json_response({"completions": completions, "cursor": found[-1].cursor if found else cursor})

    async def cancel_future(self, request: web.Request) -> web.Response:
        request_id = (await json_body(request)).text("request_id")
        return web.json_response({"cancelled": self.promises.cancel(request_id, request[OWNER])})
