"""Fail fast when a connection's security handshake is refused.

ZeroMQ retries a refused handshake silently forever, so a client with a missing or foreign key would only
time out. Watching the socket's handshake events turns that into an immediate error that says what to fix.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

T = TypeVar("T")

_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL

MECHANISM_MISMATCH = "mechanism"  # one side uses CurveZMQ, the other does not
UNREADABLE = "unreadable"  # no detail: another server key, or a peer that hung up before saying why
REFUSED = "refused"  # the server's authenticator said no


class HandshakeWatch:
    """Create before `connect`; `guard` then runs the first exchange and raises `explain(reason)` if the
    handshake fails first."""

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self._sock = sock
        self._monitor = sock.get_monitor_socket(_EVENTS)

    async def guard(self, first_exchange: Awaitable[T], explain: Callable[[str], BaseException]) -> T:
        exchange = asyncio.ensure_future(first_exchange)
        failure = asyncio.ensure_future(self._failure())
        try:
            await asyncio.wait({exchange, failure}, return_when=asyncio.FIRST_COMPLETED)
            if exchange.done():
                return exchange.result()
            exchange.cancel()
            raise explain(failure.result())
        finally:
            for task in (exchange, failure):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            self.close()

    async def _failure(self) -> str:
        event = await recv_monitor_message(self._monitor)
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return REFUSED
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
                event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return MECHANISM_MISMATCH
        return UNREADABLE

    def close(self) -> None:
        if self._monitor.closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
