"""One session with a coordinator, driven by a private event loop on a daemon thread.

Sync and async callers alike hand their requests to this loop, so requests from one client leave in call order
and results are routed back wherever the caller waits. Results arrive as `RequestDone` pushes, matched to
requests by their deterministic request ids.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import threading
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import zmq
import zmq.asyncio

import bios
from bios import exceptions
from bios import messages as m
from bios.actors import loop as event_loop
from bios.actors.remote import RemoteCallError, RemoteRef
from bios.exceptions import RemoteError
from bios.security.handshake import MECHANISM_MISMATCH, REFUSED, HandshakeWatch
from bios.security.keys import ApiKey
from bios.transport.codec import Envelope
from bios.transport.sockets import Dealer
from bios.wire import make_codec

from .address import explain_unreachable, normalize_address

log = logging.getLogger(__name__)

T = TypeVar("T")

HEARTBEAT_S = 2.0
# How long a client waits for a coordinator that went away (a restart, a stall, a network cut) before its
# requests fail; meanwhile they wait, and are resent by seq_id once it answers again.
RECONNECT_PATIENCE_S = float(os.environ.get("BIOS_RECONNECT_PATIENCE_S", "300"))
# A request refused with RateLimitError (a full queue) is resent after the server's retry_after, this many times,
# before the error reaches the caller; the seq_id stays the same, so order and exactly-once are kept.
RATE_LIMIT_RETRIES = 30


class _Reconnecting(Exception):
    """Internal: the connection is being re-established; the ask is sent again once it is."""


def to_exception(error: RemoteError, *, ran: bool = False) -> exceptions.BiosAPIError:
    """Rebuild the server's error as the matching `bios.exceptions` class."""
    cls = exceptions.ERROR_TYPES.get(error.type, exceptions.RequestFailedError)
    if ran and cls.category != "user":
        cls = exceptions.RequestFailedError
    if cls is exceptions.RateLimitError:
        return exceptions.RateLimitError(error.message, retry_after=error.retry_after or 1.0,
                                         request_id=error.request_id, field=error.field)
    return cls(error.message, request_id=error.request_id, field=error.field)


class Connection:
    def __init__(self, address: str, api_key: str | None, *, connect_timeout_s: float = 30.0) -> None:
        self.address = normalize_address(address)
        self._loop = event_loop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bios-sdk", daemon=True)
        self._thread.start()
        self._results: dict[str, concurrent.futures.Future[Any]] = {}
        self._early: dict[str, m.RequestDone] = {}
        self._unanswered: dict[str, m.Request] = {}  # accepted requests with no result yet: resent after a reconnect
        self._api_key = api_key or None
        self._reconnecting: asyncio.Future[None] | None = None
        self._closed = False
        self.rate_limited = 0  # requests resent after a RateLimitError, for load reports
        self.codec = make_codec()
        try:
            welcome = self.run(self._open(connect_timeout_s), timeout=connect_timeout_s + 5)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            raise
        self.cycle_s: float = welcome.cycle_s

    async def _open(self, timeout: float) -> m.Welcome:
        api_key = self._api_key
        security = None if api_key is None else ApiKey.parse(api_key).client_security()
        self._ctx = zmq.asyncio.Context()
        dealer = Dealer(self._ctx, self.codec, identity=f"client-{uuid.uuid4().hex}".encode(), security=security)
        watch = HandshakeWatch(dealer.sock)
        dealer.connect(self.address)
        self._remote = RemoteRef(dealer, on_message=self._on_message).start()
        try:
            hello = self._remote.ask(m.Hello(api_key=api_key, sdk_version=bios.__version__), timeout)
            welcome = await watch.guard(hello, lambda reason: self._refused(reason, api_key))
        except BaseException as exc:
            await self._remote.close()
            self._ctx.term()
            if isinstance(exc, asyncio.TimeoutError):
                raise exceptions.APIConnectionError(explain_unreachable(self.address) or (
                    f"no Bios coordinator answered at {self.address} within {timeout:.0f}s; is bios-coordinator "
                    "running?")) from None
            if isinstance(exc, RemoteCallError):
                raise to_exception(exc.error) from None
            raise
        self.session_id = welcome.session_id
        self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat())
        return welcome

    def _refused(self, reason: str, api_key: str | None) -> exceptions.BiosAPIError:
        """Why the coordinator refused the encrypted handshake, as something the user can fix."""
        where = f"the coordinator at {self.address}"
        not_bios = explain_unreachable(self.address) if reason != REFUSED else None
        if not_bios:  # an HTTP server hangs up on the handshake too
            return exceptions.APIConnectionError(not_bios)
        if api_key is None:  # a keyless coordinator never refuses a plain handshake
            message = (f"{where} requires an API key: set BIOS_API_KEY, or pass --api-key KEY to the bios command "
                       "(api_key=... to ServiceClient); `bios keys create NAME` on the coordinator's host makes one")
        elif reason == MECHANISM_MISMATCH:
            message = f"{where} does not use API keys (it runs without `bios keys init`): connect without a key"
        elif reason == REFUSED:
            message = f"{where} refused this connection"
        else:  # the server's reply could not be decrypted, or it hung up before saying why
            message = (f"this API key is not for {where}: it belongs to another Bios cluster, or that coordinator "
                       "runs without keys")
        return exceptions.AuthenticationError(message)

    # ------------------------------------------------------------------------------------ running things

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the connection's loop and block for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def submit(self, op: m.Request, request_id: str) -> tuple[concurrent.futures.Future[Any], concurrent.futures.Future[Any]]:
        """Send a request now; returns (accepted, result) futures."""
        if self._closed:
            raise exceptions.APIConnectionError("this ServiceClient is closed")
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()
        accepted = self.spawn(self._submit(op, request_id, result))
        return accepted, result

    async def _submit(self, op: m.Request, request_id: str, result: concurrent.futures.Future[Any]) -> m.Accepted:
        early = self._early.pop(request_id, None)
        if early is not None:
            _resolve(result, early)
        else:
            self._results[request_id] = result
        try:
            accepted = await self._ask_with_retries(op)
            if not result.done():
                self._unanswered[request_id] = op
            return accepted
        except RemoteCallError as exc:
            error = to_exception(exc.error)
            self._results.pop(request_id, None)
            if not result.done():
                result.set_exception(error)
            raise error from None
        except BaseException as exc:
            self._results.pop(request_id, None)
            if not result.done():
                result.set_exception(exc)
            raise

    async def _ask_with_retries(self, op: m.Request) -> Any:
        """Resend a request refused for backpressure: a refusal uses up nothing, so order and once-only hold."""
        resent = 0
        while True:
            try:
                return await self._ask(op)
            except RemoteCallError as exc:
                if exc.error.type != "RateLimitError" or resent >= RATE_LIMIT_RETRIES:
                    raise
                retry_after = exc.error.retry_after or 1.0
            resent += 1
            self.rate_limited += 1
            await asyncio.sleep(retry_after * random.uniform(0.5, 1.5))  # spread the resends of many clients

    async def ask(self, body: Any, timeout: float | None = None) -> Any:
        """A query with a direct reply; runs on the connection's loop."""
        try:
            return await self._ask(body, timeout)
        except RemoteCallError as exc:
            raise to_exception(exc.error) from None
        except asyncio.TimeoutError:
            raise exceptions.TimeoutError(f"no answer to {type(body).__name__} within {timeout}s") from None

    def query(self, body: Any, timeout: float | None = 60.0) -> Any:
        return self.run(self.ask(body, timeout))

    async def query_async(self, body: Any, timeout: float | None = 60.0) -> Any:
        return await asyncio.wrap_future(self.spawn(self.ask(body, timeout)))

    # ------------------------------------------------------------------------------------ incoming

    async def _ask(self, body: Any, timeout: float | None = None) -> Any:
        """Ask the coordinator; across a reconnect (it restarted, or went quiet) the same ask is sent again, which
        is safe: requests are answered by (run, seq_id), never run twice."""
        while True:
            if self._reconnecting is not None:
                await asyncio.shield(self._reconnecting)
            try:
                return await self._remote.ask(body, timeout)
            except _Reconnecting:
                continue
            except RemoteCallError as exc:
                if exc.error.type != "ReconnectRequired":
                    raise
                await self._reconnect("the coordinator restarted")

    def _on_message(self, env: Envelope) -> None:
        body = env.body
        if isinstance(body, m.Notice):
            log.warning("%s: %s", body.request_id, body.message)
            return
        if not isinstance(body, m.RequestDone):  # a late reply to an ask given up at a reconnect
            log.debug("ignored a late %s from the coordinator", type(body).__name__)
            return
        self._unanswered.pop(body.request_id, None)
        future = self._results.pop(body.request_id, None)
        if future is None:
            self._early[body.request_id] = body
        else:
            _resolve(future, body)

    async def _heartbeat(self) -> None:
        """A heartbeat that goes unanswered, or that a restarted coordinator does not know, starts a reconnect."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._ask(m.SessionHeartbeat(self.session_id), timeout=2 * HEARTBEAT_S)
                continue
            except asyncio.TimeoutError:
                why = f"no answer to a heartbeat within {2 * HEARTBEAT_S:.0f}s"
            except RemoteCallError as exc:
                self._fail_all(to_exception(exc.error))  # the session was closed, or its key revoked
                return
            except exceptions.BiosAPIError:
                return  # a reconnect ran out of patience: every request has failed with its error
            try:
                await self._reconnect(why)
            except exceptions.BiosAPIError:
                return

    async def _reconnect(self, why: str) -> None:
        """Say Hello again, resuming this session, then resend every accepted request still unanswered.

        Requests wait meanwhile; only after `RECONNECT_PATIENCE_S` without an answer do they fail."""
        if self._reconnecting is not None:
            return await asyncio.shield(self._reconnecting)
        self._reconnecting = asyncio.get_running_loop().create_future()
        log.warning("lost the coordinator at %s (%s): reconnecting for up to %.0fs; %d request(s) wait and will "
                    "be resent", self.address, why, RECONNECT_PATIENCE_S, len(self._unanswered))
        self._remote.fail_pending(_Reconnecting())
        deadline = asyncio.get_running_loop().time() + RECONNECT_PATIENCE_S
        hello = m.Hello(api_key=self._api_key, sdk_version=bios.__version__, session_id=self.session_id)
        try:
            while True:
                try:
                    await self._remote.ask(hello, timeout=HEARTBEAT_S)
                    break
                except (asyncio.TimeoutError, _Reconnecting):
                    if asyncio.get_running_loop().time() > deadline:
                        raise exceptions.APIConnectionError(
                            f"lost the coordinator at {self.address}: no answer for {RECONNECT_PATIENCE_S:.0f}s "
                            "(set BIOS_RECONNECT_PATIENCE_S to wait longer)") from None
                except RemoteCallError as exc:
                    raise to_exception(exc.error) from None
        except exceptions.BiosAPIError as exc:
            self._fail_all(exc)
            failed, self._reconnecting = self._reconnecting, None
            failed.set_exception(exc)
            failed.exception()  # marked retrieved: waiters get it through their shield
            raise
        log.warning("reconnected to %s; resending %d unanswered request(s)", self.address, len(self._unanswered))
        done, self._reconnecting = self._reconnecting, None
        done.set_result(None)
        for op in list(self._unanswered.values()):
            asyncio.ensure_future(self._resend(op))

    async def _resend(self, op: m.Request) -> None:
        try:
            await self._ask(op)
        except Exception as exc:  # its result (or error) still arrives as a push, or the patience runs out
            log.debug("resending %s: %s", type(op).__name__, exc)

    def _fail_all(self, error: Exception) -> None:
        for future in self._results.values():
            if not future.done():
                future.set_exception(error)
        self._results.clear()
        self._unanswered.clear()
        self._remote.fail_pending(error)

    # ------------------------------------------------------------------------------------ closing

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.run(self._close(), timeout=5)
        except Exception as exc:
            log.debug("closing the session: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    async def _close(self) -> None:
        self._heartbeat_task.cancel()
        try:
            await self._remote.ask(m.CloseSession(self.session_id), timeout=2)
        except Exception as exc:
            log.debug("session close not acknowledged: %s", exc)
        self._fail_all(exceptions.APIConnectionError("the ServiceClient was closed"))
        await self._remote.close()
        self._ctx.term()


def _resolve(future: concurrent.futures.Future[Any], done: m.RequestDone) -> None:
    if future.done():
        return
    if done.error is not None:
        future.set_exception(to_exception(done.error, ran=True))
    else:
        future.set_result(done.result)
