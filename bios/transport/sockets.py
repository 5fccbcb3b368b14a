"""asyncio ZeroMQ endpoints: a ROUTER that serves many peers and a DEALER that talks to one.

Both speak `Envelope`s through a `Codec`. A peer that sends something undecodable gets a `TransportError`
reply (when it can be addressed) and a log line; the endpoint keeps serving.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from .codec import Codec, DecodeError, Envelope, TransportError

log = logging.getLogger(__name__)

_ids = itertools.count(1)


def next_message_id() -> int:
    """Process-wide increasing message ids; replies are matched on them."""
    return next(_ids)


@dataclass(frozen=True)
class Security:
    """CurveZMQ settings: a server holds its secret key; clients know the server's public key."""

    public_key: bytes
    secret_key: bytes
    server_public_key: bytes | None = None


def _apply_socket_options(sock: zmq.asyncio.Socket, max_message_bytes: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


class Router:
    """Server side: receives from many DEALER peers and replies by peer identity."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        codec: Codec,
        *,
        security: Security | None = None,
        zap_domain: str | None = None,
    ) -> None:
        self.codec = codec
        self.sock = ctx.socket(zmq.ROUTER)
        _apply_socket_options(self.sock, codec.limits.max_message_bytes)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if security is not None:
            self.sock.curve_server = True
            self.sock.curve_publickey = security.public_key
            self.sock.curve_secretkey = security.secret_key
        if zap_domain is not None:
            self.sock.zap_domain = zap_domain.encode()
        self.address = ""
        self.bad_messages = 0

    def bind(self, address: str) -> str:
        """Bind; `tcp://HOST:0` picks a free port. Returns the address actually bound."""
        if address.startswith("tcp://") and address.endswith(":0"):
            address = address[:-2] + ":*"
        self.sock.bind(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.address

    async def recv(self) -> tuple[bytes, Envelope, list[Any]]:
        """Next well-formed message as (peer, envelope, raw frames); bad ones are answered and skipped."""
        while True:
            parts = await self.sock.recv_multipart(copy=False)
            if len(parts) < 2:
                self.bad_messages += 1
                log.warning("dropped a message with no peer identity")
                continue
            peer = parts[0].bytes
            frames = parts[1:]
            try:
                return peer, self.codec.decode(frames), frames
            except DecodeError as exc:
                self.bad_messages += 1
                log.warning("rejected a message from peer %s: %s", peer.hex(), exc)
                await self._send_error(peer, str(exc), exc.envelope_id)

    async def _send_error(self, peer: bytes, message: str, reply_to: int | None) -> None:
        try:
            await self.send(peer, Envelope(next_message_id(), TransportError(message), reply_to))
        except zmq.ZMQError as exc:
            log.debug("could not answer peer %s: %s", peer.hex(), exc)

    async def send(self, peer: bytes, envelope: Envelope) -> None:
        await self.sock.send_multipart([peer, *self.codec.encode(envelope)], copy=False)

    async def send_raw(self, peer: bytes, frames: list[Any]) -> None:
        """Forward already-encoded frames (e.g. a stored result) without decoding them."""
        await self.sock.send_multipart([peer, *frames], copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)


class Dealer:
    """Client side: one connection to a ROUTER."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        codec: Codec,
        *,
        identity: bytes | None = None,
        security: Security | None = None,
        plain_credentials: tuple[str, str] | None = None,
    ) -> None:
        self.codec = codec
        self.sock = ctx.socket(zmq.DEALER)
        _apply_socket_options(self.sock, codec.limits.max_message_bytes)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        if security is not None:
            self.sock.curve_publickey = security.public_key
            self.sock.curve_secretkey = security.secret_key
            self.sock.curve_serverkey = security.server_public_key
        if plain_credentials is not None:
            self.sock.plain_username = plain_credentials[0].encode()
            self.sock.plain_password = plain_credentials[1].encode()

    def connect(self, address: str) -> None:
        self.sock.connect(address)

    async def send(self, envelope: Envelope) -> None:
        await self.sock.send_multipart(self.codec.encode(envelope), copy=False)

    async def recv(self) -> Envelope | None:
        """Next message, or None for one that could not be decoded (logged)."""
        frames = await self.sock.recv_multipart(copy=False)
        try:
            return self.codec.decode(frames)
        except DecodeError as exc:
            log.warning("dropped an undecodable message: %s", exc)
            return None

    def close(self) -> None:
        self.sock.close(linger=0)
