"""Actors across processes: `RemoteRef` (tell/ask over a DEALER) and `serve` (a ROUTER feeding local actors).

An `ask` carries a fresh message id; the reply names it in `reply_to`. A handler error crosses the wire as a
`RemoteError` and is raised on the asking side as `RemoteCallError`. Messages the other side sends on its own
(result pushes, commands) go to the `on_message` callback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from bios.exceptions import RemoteError  # the wire form of an error
from bios.transport.codec import Envelope, TransportError
from bios.transport.sockets import Dealer, Router, next_message_id

log = logging.getLogger(__name__)


class RemoteCallError(Exception):
    """The remote side answered an ask with an error."""

    def __init__(self, error: RemoteError) -> None:
        super().__init__(f"{error.type}: {error.message}")
        self.error = error


class RemoteRef:
    """The client end of a connection: ask/tell the actors behind a remote `serve`."""

    def __init__(self, dealer: Dealer, on_message: Callable[[Envelope], None] | None = None) -> None:
        self._dealer = dealer
        self._on_message = on_message
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> RemoteRef:
        self._task = asyncio.get_running_loop().create_task(self._recv_loop(), name="remote-ref-recv")
        return self

    async def tell(self, body: Any) -> None:
        await self._dealer.send(Envelope(next_message_id(), body))

    async def reply(self, to: Envelope, body: Any) -> None:
        """Answer an ask the other side sent us."""
        await self._dealer.send(Envelope(next_message_id(), body, to.id))

    def ask_future(self, body: Any) -> tuple[asyncio.Future[Any], Awaitable[None]]:
        """Register the reply slot before sending, so no reply can be missed; returns (reply, send)."""
        env_id = next_message_id()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[env_id] = future
        future.add_done_callback(lambda _f, i=env_id: self._pending.pop(i, None))
        return future, self._dealer.send(Envelope(env_id, body))

    async def ask(self, body: Any, timeout: float | None = None) -> Any:
        future, send = self.ask_future(body)
        try:
            await send
        except BaseException:
            future.cancel()  # e.g. a body the codec cannot encode: drop the reply slot with it
            raise
        if timeout is None:
            return await future
        async with asyncio.timeout(timeout):  # cheaper than wait_for: no extra task per call
            return await future

    async def _recv_loop(self) -> None:
        while True:
            env = await self._dealer.recv()
            if env is None:
                continue
            future = self._pending.get(env.reply_to) if env.reply_to is not None else None
            if future is not None:
                if future.done():
                    continue
                body = env.body
                if isinstance(body, RemoteError):
                    future.set_exception(RemoteCallError(body))
                elif isinstance(body, TransportError):
                    future.set_exception(RemoteCallError(RemoteError("BadRequestError", body.message)))
                else:
                    future.set_result(body)
            elif self._on_message is not None:
                try:
                    self._on_message(env)
                except Exception:
                    log.exception("message handler failed on %s", type(env.body).__name__)

    def fail_pending(self, exc: BaseException) -> None:
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(exc)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self.fail_pending(ConnectionError("connection closed"))
        self._dealer.close()


Dispatch = Callable[[bytes, Envelope, list[Any]], "asyncio.Future[Any] | Awaitable[Any] | None"]


def answered(value: Any) -> asyncio.Future[Any]:
    """A dispatch's reply that is ready now (`serve` sends it without starting a task)."""
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


async def serve(router: Router, dispatch: Dispatch) -> None:
    """Receive forever; `dispatch` returns the reply's awaitable (or None for no reply).

    `dispatch` runs synchronously in receive order, so a handler that enqueues into an actor mailbox keeps the
    peer's order. Replies are sent as they complete; an exception becomes a `RemoteError` reply.
    """
    while True:
        peer, env, frames = await router.recv()
        try:
            pending = dispatch(peer, env, frames)
        except Exception as exc:
            await _reply(router, peer, env, error=exc)
            continue
        if isinstance(pending, asyncio.Future) and pending.done():
            await _reply_when_done(router, peer, env, pending)  # answered on the spot: no task needed
        elif pending is not None:
            asyncio.ensure_future(_reply_when_done(router, peer, env, pending))


async def _reply_when_done(router: Router, peer: bytes, env: Envelope, pending: Awaitable[Any]) -> None:
    try:
        result = await pending
    except Exception as exc:
        await _reply(router, peer, env, error=exc)
    else:
        if result is not None:
            await _reply(router, peer, env, result=result)


async def _reply(router: Router, peer: bytes, env: Envelope, *, result: Any = None, error: Exception | None = None) -> None:
    body = RemoteError.from_exception(error) if error is not None else result
    if error is not None and body.type == "InternalServerError":
        log.error("handler for %s failed", type(env.body).__name__, exc_info=error)
    try:
        await router.send(peer, Envelope(next_message_id(), body, env.id))
    except Exception as exc:
        if error is None and isinstance(exc, TypeError):  # a result the codec cannot encode: still answer
            await _reply(router, peer, env, error=exc)
        else:
            log.exception("could not reply to %s", peer.hex())
