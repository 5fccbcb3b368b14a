"""The Tinker-compatible HTTP API: an aiohttp server on the coordinator's own event loop.

Each route becomes the coordinator message the native SDK would send, submitted through an in-process client
peer; results come back as pushes and wait in `Promises` for the client's `retrieve_future` long-poll. The
protocol (routes, shapes, ordering and retry rules) is `shared/reference/tinker-wire.md`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web

from bios import messages as m
from bios import types as t
from bios.actors.actor import ActorStopped
from bios.actors.remote import RemoteError
from bios.checkpoint_path import CheckpointPath
from bios import ids
from bios.coordinator.server import Coordinator
from bios.security.listen import InsecureListenError
from bios.exceptions import (
    AuthenticationError,
    BadRequestError,
    BiosAPIError,
    NotFoundError,
    RateLimitError,
)

from . import json_wire, proto
from .console import Console
from .futures import PROTOBUF, Promises, Reply, json_reply
from .http_errors import http_status
from .openai_api import OpenAICompat

log = logging.getLogger(__name__)

API = "/api/v1"
OWNER = web.RequestKey("owner", str)  # who a request acts for, from its X-API-Key


@dataclass(frozen=True)
class GatewayConfig:
    poll_s: float = 30.0  # a retrieve_future waits this long before answering try_again (the SDK gives up at 45 s)
    max_pending: int = 10_000  # unfinished requests beyond which new ones get 429 + Retry-After
    keep_served_s: float = 300.0  # a served result stays this long for a client that polls it again
    keep_unclaimed_s: float = 3600.0  # a result nobody retrieved is dropped after this long
    max_body_bytes: int = 64 << 20  # the SDK sends forward_backward chunks of up to ~5 MB

    @classmethod
    def from_env(cls) -> GatewayConfig:
        """Defaults, overridden by `BIOS_GATEWAY_POLL_S` and `BIOS_GATEWAY_MAX_PENDING`."""
        env = os.environ
        default = cls()
        return cls(
            poll_s=float(env.get("BIOS_GATEWAY_POLL_S", default.poll_s)),
            max_pending=int(env.get("BIOS_GATEWAY_MAX_PENDING", default.max_pending)),
        )


def error_response(exc: BiosAPIError) -> web.Response:
    """A JSON error body for every 4xx/5xx (a body-less 400 makes the SDK reconnect and retry)."""
    name = type(exc).__name__
    status = http_status(exc)
    headers = {}
    if isinstance(exc, RateLimitError):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    body = {"detail": exc.message, "type": name, "field": exc.field}
    return web.json_response(body, status=status, headers=headers)


def _http_error(status: int, message: str) -> web.Response:
    return web.json_response({"detail": message, "type": "HTTPError", "field": None}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_error(exc.status, exc.text or exc.reason)
    except BiosAPIError as exc:
        return error_response(exc)
    except ActorStopped:
        return _http_error(503, "the coordinator is shutting down; retry against the restarted cluster")
    except Exception as exc:
        log.exception("gateway error on %s %s", request.method, request.path)
        return _http_error(500, f"internal error in the Bios gateway: {type(exc).__name__}: {exc}")


def owner_of(api_key: str | None, authenticate: Callable[[str | None], str]) -> str:
    """The owner a request's X-API-Key stands for: the Tinker SDK sends `tml-` keys, so a Bios key arrives as
    `tml-bios_...` and the coordinator's key store decides. Without keys every `tml-` key is the local owner,
    as every native client is; a missing or malformed key is refused.
    """
    if not api_key or not api_key.startswith("tml-"):
        raise AuthenticationError("missing or malformed X-API-Key header: pass api_key='tml-...' to the Tinker "
                                  "ServiceClient or set TINKER_API_KEY=tml-...")
    return authenticate(api_key)


async def _json_body(request: web.Request) -> json_wire.Body:
    if request.content_type == PROTOBUF:
        raise web.HTTPUnsupportedMediaType(text=f"{request.path} takes a JSON body (Content-Type: application/json)")
    raw = await request.read()
    try:
        data = json.loads(raw) if raw else {}
    except ValueError as exc:
        raise BadRequestError(f"the body is not valid JSON: {exc}", field="body") from None
    return json_wire.Body(data)


def _query_int(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequestError(f"query parameter {name} must be an integer, got {raw!r}", field=name) from None
    if value < 0:
        raise BadRequestError(f"query parameter {name} must be >= 0, got {value}", field=name)
    return value


def _model_id(op: Any) -> str:
    if isinstance(op, (m.CreateModel)):
        return ids.run_id(op.session_id, op.model_seq_id)
    return op.model_id


def _request_id(op: Any) -> str:
    if isinstance(op, m.Sample):
        return ids.request_id(op.sampling_session_id, op.seq_id)
    return ids.request_id(_model_id(op), 0 if isinstance(op, m.CreateModel) else op.seq_id)


class Gateway:
    """The HTTP front end of one coordinator; `start` binds it, `stop` drains long-polls and closes it."""

    def __init__(self, coordinator: Coordinator, config: GatewayConfig | None = None) -> None:
        self.coordinator = coordinator
        self.front_door = coordinator.front_door
        self.config = config or GatewayConfig()
        self.promises = Promises(self.config.keep_served_s, self.config.keep_unclaimed_s)
        self.peer = coordinator.attach_local_client("gateway", self.promises.deliver)
        self.openai = OpenAICompat(coordinator)  # /v1/...: OpenAI-compatible inference
        self.console = Console(coordinator)  # / and /console/...: the read-only web console
        self.samplers: dict[str, list[str]] = {}  # session id -> sampling sessions opened through this gateway
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------------------------ lifecycle

    @web.middleware
    async def _authenticate(self, request: web.Request,
                            handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path.startswith(f"{API}/") and request.path != f"{API}/healthz":
            request[OWNER] = owner_of(request.headers.get("X-API-Key"), self.coordinator.authenticate)
        return await handler(request)

    def application(self) -> web.Application:
        app = web.Application(middlewares=[_errors, self._authenticate], client_max_size=self.config.max_body_bytes)
        routes = [
            web.post(f"{API}/client/config", self.client_config),
            web.post(f"{API}/client/dynamic_config", self.client_dynamic_config),
            web.post(f"{API}/create_session", self.create_session),
            web.post(f"{API}/session_heartbeat", self.session_heartbeat),
            web.post(f"{API}/telemetry", self.telemetry),
            web.post(f"{API}/sessions/{{session_id}}/finish", self.finish_session),
            web.get(f"{API}/sessions", self.list_sessions),
            web.get(f"{API}/sessions/{{session_id}}", self.get_session),
            web.get(f"{API}/healthz", self.healthz),
            web.get(f"{API}/get_server_capabilities", self.server_capabilities),
            web.post(f"{API}/create_model", self.create_model),
            web.post(f"{API}/get_info", self.get_info),
            web.post(f"{API}/forward_backward", self.forward_backward),
            web.post(f"{API}/optim_step", self.optim_step),
            web.post(f"{API}/save_weights", self.save_weights),
            web.post(f"{API}/save_weights_for_sampler", self.save_weights_for_sampler),
            web.post(f"{API}/load_weights", self.load_weights),
            web.post(f"{API}/create_sampling_session", self.create_sampling_session),
            web.get(f"{API}/samplers/{{sampler_id}}", self.get_sampler),
            web.post(f"{API}/asample", self.asample),
            web.post(f"{API}/retrieve_future", self.retrieve_future),
            web.get(f"{API}/training_runs", self.list_training_runs),
            web.get(f"{API}/training_runs/{{run_id}}", self.get_training_run),
            web.get(f"{API}/training_runs/{{run_id}}/checkpoints", self.list_checkpoints),
            web.delete(f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}", self.delete_checkpoint),
            web.get(f"{API}/checkpoints", self.list_user_checkpoints),
            web.post(f"{API}/weights_info", self.weights_info),
        ]
        app.add_routes(routes + self.openai.routes() + self.console.routes())
        return app

    async def start(self, host: str, port: int) -> str:
        """Bind and serve; returns the base URL (with the real port when `port` is 0)."""
        self._runner = web.AppRunner(self.application(), access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        bound = self._runner.addresses[0][1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{bound}"
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever(), name="gateway-sweeper")
        log.info("Tinker-compatible HTTP API on %s", self.url)
        return self.url

    async def stop(self) -> None:
        """Answer every waiting long-poll with try_again, then close the server."""
        self.promises.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._runner is not None:
            await self._runner.cleanup()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(30)
            self.promises.sweep()

    # ------------------------------------------------------------------------------------ submission

    def _check_capacity(self) -> None:
        if self.promises.pending() >= self.config.max_pending:
            raise RateLimitError(f"the gateway has {self.config.max_pending} unfinished requests; retry shortly",
                                 retry_after=1.0)

    def _check_session(self, session_id: str, owner: str) -> None:
        self.front_door.check_session(session_id, owner)

    async def _submit(self, op: Any, owner: str, render: Callable[[Any], Awaitable[Reply]]) -> str:
        """Hand an op to the coordinator now; its promise exists before any result can arrive."""
        self._check_capacity()
        request_id = _request_id(op)
        self.promises.expect(request_id, owner, render)
        try:
            await self.front_door.submit(self.peer, op, owner)
        except BaseException:
            self.promises.forget(request_id)
            raise
        return request_id

    def _consume(self, model_id: object, seq_id: object, owner: str) -> None:
        """Use up the seq_id of a request refused here, so the run's later requests do not wait for it: a
        `ReleaseSeq` stands in for it, which the coordinator refuses, moving the run's queue on."""
        if not isinstance(model_id, str) or not isinstance(seq_id, int) or isinstance(seq_id, bool) or seq_id < 1:
            return
        with contextlib.suppress(Exception):  # if even this is refused, the coordinator's gap timeout ends the wait
            stand_in = m.ReleaseSeq(model_id, seq_id, "the gateway could not parse its request")
            self.front_door.submit(self.peer, stand_in, owner).add_done_callback(
                lambda f: f.cancelled() or f.exception())

    async def _ordered(self, request: web.Request, body: json_wire.Body,
                       parse: Callable[[json_wire.Body], tuple[Any, Any]]) -> web.Response:
        """Parse and submit a run's JSON request; one refused here still uses up its seq_id. Requests go to the
        coordinator as they come: it runs a run's requests in seq_id order, however they arrive."""
        owner = request[OWNER]
        try:
            op, render = parse(body)
        except BadRequestError:
            self._consume(body.data.get("model_id"), body.data.get("seq_id"), owner)
            raise
        request_id = await self._submit(op, owner, render)
        return web.json_response({"request_id": request_id, "model_id": op.model_id})

    # ------------------------------------------------------------------------------------ session routes

    async def client_config(self, request: web.Request) -> web.Response:
        return web.json_response({
            "pjwt_auth_enabled": False,
            "parallel_fwdbwd_chunks": True,
            "proto_compress_fwdbwd": False,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
        })

    async def client_dynamic_config(self, request: web.Request) -> web.Response:
        return web.json_response({"refresh_interval_sec": 300, "sample_cancel_enabled": False})

    async def create_session(self, request: web.Request) -> web.Response:
        await _json_body(request)
        session_id = self.front_door.open_session(request[OWNER])
        self.samplers[session_id] = []
        return web.json_response({"type": "create_session", "session_id": session_id})

    async def session_heartbeat(self, request: web.Request) -> web.Response:
        session_id = (await _json_body(request)).text("session_id")
        if not self.front_door.heartbeat(session_id, request[OWNER]):
            return _http_error(410, f"session {session_id} is finished")
        return web.json_response({"type": "session_heartbeat"})

    async def telemetry(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "accepted"})

    async def finish_session(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        self.front_door.close_session(session_id, request[OWNER])
        return web.json_response({})

    async def list_sessions(self, request: web.Request) -> web.Response:
        """Sessions that own runs, and those opened through this gateway since it started."""
        owner = request[OWNER]
        opened = [s for s in self.samplers if self.front_door.owns_session(s, owner)]
        listed = list(dict.fromkeys(self.front_door.sessions(owner) + opened))
        offset, limit = _query_int(request, "offset", 0), _query_int(request, "limit", 20)
        return web.json_response({"sessions": listed[offset: offset + limit]})

    async def get_session(self, request: web.Request) -> web.Response:
        session_id, owner = request.match_info["session_id"], request[OWNER]
        runs = self.front_door.runs_of_session(session_id, owner)
        return web.json_response({"training_run_ids": runs, "sampler_ids": self.samplers.get(session_id, [])})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def server_capabilities(self, request: web.Request) -> web.Response:
        return web.json_response(json_wire.capabilities(await self.front_door.query(m.GetServerCapabilities())))

    # ------------------------------------------------------------------------------------ training routes

    async def create_model(self, request: web.Request) -> web.Response:
        op, owner = json_wire.create_model(await _json_body(request)), request[OWNER]
        self._check_session(op.session_id, owner)
        model_id = _model_id(op)
        request_id = await self._submit(op, owner, self._render_created)
        return web.json_response({"request_id": request_id, "model_id": model_id})

    async def get_info(self, request: web.Request) -> web.Response:
        model_id = (await _json_body(request)).text("model_id")
        info = await self.front_door.query(m.GetInfo(model_id), request[OWNER])
        return web.json_response(json_wire.get_info(info))

    async def forward_backward(self, request: web.Request) -> web.Response:
        if request.content_type != PROTOBUF:
            raise web.HTTPUnsupportedMediaType(
                text=f"forward_backward takes a tinker_public.ForwardBackwardRequest protobuf body with Content-Type: "
                     f"{PROTOBUF}, got {request.content_type!r}")
        msg = proto.decode_forward_backward(await request.read())
        try:
            op = proto.forward_backward_op(msg)
        except BadRequestError:
            self._consume(msg.model_id, msg.seq_id, request[OWNER])
            raise
        request_id = await self._submit(op, request[OWNER], self._render_forward_backward)
        return web.json_response({"request_id": request_id, "model_id": op.model_id})

    async def optim_step(self, request: web.Request) -> web.Response:
        return await self._ordered(request, await _json_body(request),
                                   lambda body: (json_wire.optim_step(body), self._render_optim_step))

    async def save_weights(self, request: web.Request) -> web.Response:
        return await self._ordered(request, await _json_body(request),
                                   lambda body: (json_wire.save_weights(body), self._render_saved))

    async def save_weights_for_sampler(self, request: web.Request) -> web.Response:
        def parse(body: json_wire.Body) -> tuple[m.SaveWeights, Callable[[Any], Awaitable[Reply]]]:
            op, sampling_seq = json_wire.save_weights_for_sampler(body)
            if sampling_seq is None:
                return op, self._render_sampler_saved
            return op, partial(self._render_sampling_session, request[OWNER], ids.session_of(op.model_id),
                               sampling_seq)

        return await self._ordered(request, await _json_body(request), parse)

    async def load_weights(self, request: web.Request) -> web.Response:
        body, owner = await _json_body(request), request[OWNER]
        if body.data.get("session_id") is None:
            return await self._ordered(request, body, lambda b: (json_wire.load_weights(b), self._render_loaded))
        op = json_wire.load_weights(body)
        self._check_session(op.session_id, owner)
        model_id = _model_id(op)
        request_id = await self._submit(op, owner, partial(self._render_created_from, op.from_path))
        return web.json_response({"request_id": request_id, "model_id": model_id})

    # ------------------------------------------------------------------------------------ sampling routes

    async def create_sampling_session(self, request: web.Request) -> web.Response:
        query, owner = json_wire.create_sampling_session(await _json_body(request)), request[OWNER]
        self._check_session(query.session_id, owner)
        session = await self.front_door.query(query, owner)
        self.samplers.setdefault(query.session_id, []).append(session.sampling_session_id)
        return web.json_response({"type": "create_sampling_session",
                                  "sampling_session_id": session.sampling_session_id})

    async def get_sampler(self, request: web.Request) -> web.Response:
        query = m.GetSamplingSession(request.match_info["sampler_id"])
        return web.json_response(json_wire.sampler(await self.front_door.query(query, request[OWNER])))

    async def asample(self, request: web.Request) -> web.Response:
        op, last_n = json_wire.sample(await _json_body(request))
        request_id = await self._submit(op, request[OWNER], partial(self._render_sample, last_n))
        return web.json_response({"request_id": request_id,
                                  "sample_sequence_ids": [f"{request_id}:{i}" for i in range(op.num_samples)]})

    async def retrieve_future(self, request: web.Request) -> web.Response:
        request_id = (await _json_body(request)).text("request_id")
        if not self.promises.knows(request_id):
            await self._recover_promise(request_id, request[OWNER])
        try:
            reply = await self.promises.wait(request_id, request[OWNER], self.config.poll_s)
        except KeyError:
            raise NotFoundError(f"no request {request_id!r} was submitted through this gateway (or its result "
                                "expired)", field="request_id") from None
        if reply is None:
            waiting = {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            if reason := self.promises.waiting_reason(request_id):
                waiting |= {"queue_state": "paused_capacity", "queue_state_reason": reason}
            return web.json_response(waiting)
        return web.Response(body=reply.body, content_type=reply.content_type)

    # ------------------------------------------------------------------------------------ REST routes

    async def list_training_runs(self, request: web.Request) -> web.Response:
        query = m.ListTrainingRuns(_query_int(request, "limit", 20), _query_int(request, "offset", 0))
        return web.json_response(json_wire.training_runs(await self.front_door.query(query, request[OWNER])))

    async def get_training_run(self, request: web.Request) -> web.Response:
        run = await self.front_door.query(m.GetTrainingRun(request.match_info["run_id"]), request[OWNER])
        return web.json_response(json_wire.training_run(run))

    async def list_checkpoints(self, request: web.Request) -> web.Response:
        listing = await self.front_door.query(m.ListCheckpoints(request.match_info["run_id"]), request[OWNER])
        return web.json_response({"checkpoints": [json_wire.checkpoint(c) for c in listing.checkpoints]})

    async def delete_checkpoint(self, request: web.Request) -> web.Response:
        info = request.match_info
        path = json_wire.checkpoint_path(info["run_id"], f"{info['kind']}/{info['name']}")
        await self.front_door.query(m.DeleteCheckpoint(path), request[OWNER])
        return web.json_response({})

    async def list_user_checkpoints(self, request: web.Request) -> web.Response:
        owner, limit, offset = request[OWNER], _query_int(request, "limit", 100), _query_int(request, "offset", 0)
        checkpoints: list[t.Checkpoint] = []
        for run_id in self.front_door.run_ids(owner):
            listing = await self.front_door.query(m.ListCheckpoints(run_id), owner)
            checkpoints.extend(listing.checkpoints)
        checkpoints.sort(key=lambda c: c.time, reverse=True)
        page = [json_wire.checkpoint(c) for c in checkpoints[offset: offset + limit]]
        cursor = {"offset": offset, "limit": limit, "total_count": len(checkpoints)}
        return web.json_response({"checkpoints": page, "cursor": cursor})

    async def weights_info(self, request: web.Request) -> web.Response:
        owner = request[OWNER]
        path = CheckpointPath.parse((await _json_body(request)).text("tinker_path"), field="tinker_path")
        listing = await self.front_door.query(m.ListCheckpoints(path.run_id), owner)
        if not any(c.bios_path == str(path) for c in listing.checkpoints):
            raise NotFoundError(f"no checkpoint at {json_wire.tinker_path(str(path))}", field="tinker_path")
        run = await self.front_door.query(m.GetTrainingRun(path.run_id), owner)
        return web.json_response(json_wire.weights_info(run))

    # ------------------------------------------------------------------------------------ results

    async def _recover_promise(self, request_id: str, owner: str) -> None:
        """A request sent before the coordinator (and this gateway) restarted: its promise comes back from the
        request log, so the client's poll is answered, not refused."""
        self.promises.expect(request_id, owner, self._render_any)
        try:
            await self.front_door.watch(self.peer, request_id, owner)
        except (NotFoundError, BadRequestError):
            self.promises.forget(request_id)
        except BiosAPIError as exc:  # it was refused when it was sent: that is its answer
            self.promises.fail(request_id, RemoteError.from_exception(exc))

    async def _render_any(self, result: Any) -> Reply:
        """A result rendered by its type alone (for promises recovered after a restart)."""
        renders: dict[type, Callable[[Any], Awaitable[Reply]]] = {
            m.ModelCreated: self._render_created,
            t.ForwardBackwardOutput: self._render_forward_backward,
            t.OptimStepResponse: self._render_optim_step,
            t.SaveWeightsResponse: self._render_saved,
            t.SaveWeightsForSamplerResponse: self._render_sampler_saved,
            t.LoadWeightsResponse: self._render_loaded,
            t.SampleResponse: partial(self._render_sample, None),
        }
        return await renders[type(result)](result)

    async def _render_created(self, created: m.ModelCreated) -> Reply:
        return json_reply({"model_id": created.model_id, "type": "create_model"})

    async def _render_created_from(self, path: str, created: m.ModelCreated) -> Reply:
        return json_reply({"model_id": created.model_id, "path": json_wire.tinker_path(path), "type": "load_weights"})

    async def _render_forward_backward(self, out: t.ForwardBackwardOutput) -> Reply:
        return Reply(proto.forward_backward_output(out, json_wire.tinker_metrics(out.metrics)), PROTOBUF)

    async def _render_optim_step(self, out: t.OptimStepResponse) -> Reply:
        return json_reply({"metrics": json_wire.tinker_metrics(out.metrics)})

    async def _render_saved(self, out: t.SaveWeightsResponse) -> Reply:
        return json_reply({"path": json_wire.tinker_path(out.path), "type": "save_weights"})

    async def _render_sampler_saved(self, out: t.SaveWeightsForSamplerResponse) -> Reply:
        return json_reply({"path": json_wire.tinker_path(out.path), "type": "save_weights_for_sampler"})

    async def _render_sampling_session(self, owner: str, session_id: str, sampling_seq: int,
                                       out: t.SaveWeightsForSamplerResponse) -> Reply:
        """An unnamed save's result is a sampling session on its checkpoint: save_weights_and_get_sampling_client."""
        query = m.CreateSamplingSession(session_id, sampling_seq, None, out.path)
        session = await self.front_door.query(query, owner)
        self.samplers.setdefault(session_id, []).append(session.sampling_session_id)
        return json_reply({"path": json_wire.tinker_path(out.path), "sampling_session_id": session.sampling_session_id,
                           "type": "save_weights_for_sampler"})

    async def _render_loaded(self, out: t.LoadWeightsResponse) -> Reply:
        return json_reply({"path": json_wire.tinker_path(out.path), "model_id": out.model_id, "type": "load_weights"})

    async def _render_sample(self, last_n: int | None, out: t.SampleResponse) -> Reply:
        return Reply(proto.sample_response(out, last_n), PROTOBUF)


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"HTTP address must be HOST:PORT (port 0 picks a free one), got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def start_gateway(coordinator: Coordinator, address: str, config: GatewayConfig | None = None) -> Gateway:
    """Serve the Tinker HTTP API for `coordinator` at `address` ("HOST:PORT"); `.url` says where, `stop()` ends it.

    Until API keys exist any `tml-` key is accepted, so only a loopback address may be bound. With keys, a
    public bind is allowed; put TLS in front of it, since keys travel in a header.
    """
    host, port = _split_address(address)
    if not _is_loopback(host) and not coordinator.keys_required:
        raise InsecureListenError(f"refusing to serve the HTTP API on {host}: without API keys configured it "
                                  "accepts any key, so it binds loopback only (e.g. --http 127.0.0.1:8000); "
                                  "run `bios keys init --state-dir DIR` first to serve beyond loopback")
    gateway = Gateway(coordinator, config or GatewayConfig.from_env())
    await gateway.start(host, port)
    return gateway
