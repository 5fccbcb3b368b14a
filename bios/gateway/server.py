"""The Tinker-compatible HTTP API: an aiohttp server on the coordinator's own event loop.

Each route becomes the coordinator message the native SDK would send, submitted through an in-process client
peer; results come back as pushes and wait in `Promises` for the client's `retrieve_future` long-poll. The
protocol (routes, shapes, ordering and retry rules) is `shared/reference/tinker-wire.md`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web

from bios import ids
from bios import messages as m
from bios.account import check_ttl
from bios.coordinator.accounts import Accounts
from bios.coordinator.front_door import FrontDoor
from bios.exceptions import (
    BadRequestError,
    BiosAPIError,
    NotFoundError,
    RateLimitError,
    RemoteError,
)
from bios.security.listen import check_http

from . import json_wire, proto
from .console import Console
from .custom_losses import CustomLosses
from .futures import PROTOBUF, Promises, Reply, json_reply
from .http_io import API, CALLER, OWNER, errors, identify, json_body
from .json_body import Body
from .openai_api import OpenAICompat
from .renders import Renders
from .routes_account import AccountRoutes
from .routes_checkpoints import CheckpointRoutes
from .routes_futures import FutureRoutes
from .routes_sessions import SessionRoutes
from .signed_urls import SignedUrls
from .tokens import Tokens

log = logging.getLogger(__name__)


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


class Gateway:
    """The HTTP front end of one coordinator; `start` binds it, `stop` drains long-polls and closes it."""

    def __init__(self, front_door: FrontDoor, accounts: Accounts, config: GatewayConfig | None = None) -> None:
        self.accounts = accounts
        self.front_door = front_door
        self.config = config or GatewayConfig()
        self.promises = Promises(self.config.keep_served_s, self.config.keep_unclaimed_s)
        self.peer = front_door.attach("gateway", self.promises.deliver)
        self.openai = OpenAICompat(front_door, accounts)  # /v1/...: OpenAI-compatible inference
        self.console = Console(front_door, accounts)  # / and /console/...: the read-only web console
        urls = SignedUrls()  # download links (checkpoint archives, session traces) that need no API key
        self.tokens = Tokens()  # JWTs the tinker SDK exchanges its key for
        self.custom_losses = CustomLosses(accounts.db)  # create_custom_loss uploads, by key and loss_id
        self.sessions = SessionRoutes(front_door, accounts, urls)
        self.checkpoints = CheckpointRoutes(front_door, accounts, urls)
        self.renders = Renders(front_door, accounts)
        self.families = [self.sessions, self.checkpoints, AccountRoutes(front_door, accounts, self.tokens),
                         FutureRoutes(self.promises, self.config.poll_s), self.openai, self.console]
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------------------------ lifecycle

    @web.middleware
    async def _authenticate(self, request: web.Request,
                            handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path.startswith(f"{API}/") and request.path != f"{API}/healthz":
            caller = identify(request.headers.get("X-API-Key"), self.accounts, self.tokens)
            request[CALLER], request[OWNER] = caller, caller.owner
        return await handler(request)

    def application(self) -> web.Application:
        app = web.Application(middlewares=[errors, self._authenticate], client_max_size=self.config.max_body_bytes)
        app.add_routes([
            web.post(f"{API}/client/config", self.client_config),
            web.post(f"{API}/client/dynamic_config", self.client_dynamic_config),
            web.get(f"{API}/healthz", self.healthz),
            web.get(f"{API}/get_server_capabilities", self.server_capabilities),
            web.post(f"{API}/create_model", self.create_model),
            web.post(f"{API}/get_info", self.get_info),
            web.post(f"{API}/forward_backward", self.forward_backward),
            web.post(f"{API}/optim_step", self.optim_step),
            web.post(f"{API}/save_weights", self.save_weights),
            web.post(f"{API}/save_weights_for_sampler", self.save_weights_for_sampler),
            web.post(f"{API}/save_weights_external", self.save_weights_external),
            web.post(f"{API}/load_weights", self.load_weights),
            web.post(f"{API}/create_custom_loss", self.create_custom_loss),
            web.post(f"{API}/create_sampling_session", self.create_sampling_session),
            web.post(f"{API}/join_sampling_session", self.join_sampling_session),
            web.get(f"{API}/samplers/{{sampler_id}}", self.get_sampler),
            web.post(f"{API}/asample", self.asample),
            web.post(f"{API}/retrieve_future", self.retrieve_future),
            *(route for family in self.families for route in family.routes()),
        ])
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

    async def _submit(self, op: m.Request, owner: str, render: Callable[[Any], Awaitable[Reply]]) -> str:
        """Hand an op to the coordinator now; its promise exists before any result can arrive."""
        self._check_capacity()
        request_id = ids.request_id_of(op)
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

    async def _ordered(self, request: web.Request, body: Body,
                       parse: Callable[[Body], tuple[m.Request, Any]]) -> web.Response:
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

    # ------------------------------------------------------------------------------------ client routes

    async def client_config(self, request: web.Request) -> web.Response:
        return web.json_response({
            "pjwt_auth_enabled": True,
            "parallel_fwdbwd_chunks": True,
            "proto_compress_fwdbwd": False,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": True,
            "sample_join_sampling_session": True,
        })

    async def client_dynamic_config(self, request: web.Request) -> web.Response:
        return web.json_response({"refresh_interval_sec": 300, "sample_cancel_enabled": False})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def server_capabilities(self, request: web.Request) -> web.Response:
        return web.json_response(json_wire.capabilities(await self.front_door.query(m.GetServerCapabilities())))

    # ------------------------------------------------------------------------------------ training routes

    async def create_model(self, request: web.Request) -> web.Response:
        op, owner = json_wire.create_model(await json_body(request)), request[OWNER]
        self._check_session(op.session_id, owner)
        model_id = op.target
        request_id = await self._submit(op, owner, self.renders.created)
        return web.json_response({"request_id": request_id, "model_id": model_id})

    async def get_info(self, request: web.Request) -> web.Response:
        model_id = (await json_body(request)).text("model_id")
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
            if op.loss_fn == "custom":
                op = dataclasses.replace(op, custom_loss=self.custom_losses.get(request[OWNER],
                                                                                 proto.custom_loss_id(msg)))
        except (BadRequestError, NotFoundError):
            self._consume(msg.model_id, msg.seq_id, request[OWNER])
            raise
        request_id = await self._submit(op, request[OWNER], self.renders.forward_backward)
        return web.json_response({"request_id": request_id, "model_id": op.model_id})

    async def optim_step(self, request: web.Request) -> web.Response:
        return await self._ordered(request, await json_body(request),
                                   lambda body: (json_wire.optim_step(body), self.renders.optim_step))

    async def save_weights(self, request: web.Request) -> web.Response:
        return await self._ordered(request, await json_body(request), lambda body: (
            json_wire.save_weights(body), partial(self.renders.saved, check_ttl(body.data.get("ttl_seconds")))))

    async def save_weights_external(self, request: web.Request) -> web.Response:
        return await self._ordered(request, await json_body(request), lambda body: (
            json_wire.save_weights_external(body),
            partial(self.renders.external_saved, check_ttl(body.data.get("ttl_seconds")))))

    async def create_custom_loss(self, request: web.Request) -> web.Response:
        """Check and keep a traced loss; its promise is settled at once with the loss_id."""
        body, owner = await json_body(request), request[OWNER]
        self._check_session(body.text("session_id"), owner)
        loss_id = self.custom_losses.create(owner, body)
        request_id = ids.request_id(loss_id, 0)
        self.promises.expect(request_id, owner, self.renders.by_type)
        self.promises.settle(request_id, json_reply({"loss_id": loss_id, "type": "create_custom_loss"}))
        return web.json_response({"request_id": request_id})

    async def save_weights_for_sampler(self, request: web.Request) -> web.Response:
        def parse(body: json_wire.Body) -> tuple[m.SaveWeights, Callable[[Any], Awaitable[Reply]]]:
            op, sampling_seq = json_wire.save_weights_for_sampler(body)
            if sampling_seq is None:
                return op, partial(self.renders.sampler_saved, check_ttl(body.data.get("ttl_seconds")))
            return op, partial(self.renders.sampling_session, request[OWNER], ids.session_of(op.model_id),
                               sampling_seq)

        return await self._ordered(request, await json_body(request), parse)

    async def load_weights(self, request: web.Request) -> web.Response:
        body, owner = await json_body(request), request[OWNER]
        if body.data.get("session_id") is None:
            return await self._ordered(request, body, lambda b: (json_wire.load_weights(b), self.renders.loaded))
        op = json_wire.load_weights(body)
        self._check_session(op.session_id, owner)
        model_id = op.target
        request_id = await self._submit(op, owner, partial(self.renders.created_from, op.from_path))
        return web.json_response({"request_id": request_id, "model_id": model_id})

    # ------------------------------------------------------------------------------------ sampling routes

    async def create_sampling_session(self, request: web.Request) -> web.Response:
        query, owner = json_wire.create_sampling_session(await json_body(request)), request[OWNER]
        self._check_session(query.session_id, owner)
        session = await self.front_door.query(query, owner)
        return web.json_response({"type": "create_sampling_session",
                                  "sampling_session_id": session.sampling_session_id})

    async def join_sampling_session(self, request: web.Request) -> web.Response:
        """A client number for an unpickled SamplingClient clone, unique among the session's clients."""
        session_id = (await json_body(request)).text("sampling_session_id")
        await self.front_door.query(m.GetSamplingSession(session_id), request[OWNER])
        return web.json_response({"type": "join_sampling_session",
                                  "client_counter": self.accounts.labels.join_sampling_session(session_id)})

    async def get_sampler(self, request: web.Request) -> web.Response:
        query = m.GetSamplingSession(request.match_info["sampler_id"])
        return web.json_response(json_wire.sampler(await self.front_door.query(query, request[OWNER])))

    async def asample(self, request: web.Request) -> web.Response:
        op, last_n = json_wire.sample(await json_body(request))
        request_id = await self._submit(op, request[OWNER], partial(self.renders.sample, last_n))
        return web.json_response({"request_id": request_id,
                                  "sample_sequence_ids": [f"{request_id}:{i}" for i in range(op.num_samples)]})

    async def retrieve_future(self, request: web.Request) -> web.Response:
        request_id = (await json_body(request)).text("request_id")
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

    # ------------------------------------------------------------------------------------ results

    async def _recover_promise(self, request_id: str, owner: str) -> None:
        """A request sent before the coordinator (and this gateway) restarted: its promise comes back from the
        request log, so the client's poll is answered, not refused."""
        self.promises.expect(request_id, owner, self.renders.by_type)
        try:
            await self.front_door.watch(self.peer, request_id, owner)
        except (NotFoundError, BadRequestError):
            self.promises.forget(request_id)
        except BiosAPIError as exc:  # it was refused when it was sent: that is its answer
            self.promises.fail(request_id, RemoteError.from_exception(exc))

def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"HTTP address must be HOST:PORT (port 0 picks a free one), got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


async def start_gateway(front_door: FrontDoor, accounts: Accounts, address: str,
                        config: GatewayConfig | None = None) -> Gateway:
    """Serve the Tinker HTTP API of a coordinator (its front door and accounts) at `address` ("HOST:PORT");
    `.url` says where, `stop()` ends it.

    Until API keys exist any `tml-` key is accepted, so only a loopback address may be bound. With keys, a
    public bind is allowed; put TLS in front of it, since keys travel in a header.
    """
    host, port = _split_address(address)
    check_http(address, keys=accounts.keys_required)
    gateway = Gateway(front_door, accounts, config or GatewayConfig.from_env())
    await gateway.start(host, port)
    return gateway
