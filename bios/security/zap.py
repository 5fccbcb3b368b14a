"""The coordinator's ZAP handler (ZeroMQ's authentication protocol, RFC 27): who may finish a CurveZMQ handshake.

Any client may reach the client socket, encrypted: its API key is checked in `Hello`, where a refusal can
say why. Only the holder of the worker token (whose CurveZMQ key pair derives from it) reaches the worker
socket: anyone else cannot even connect. A small handler of our own rather than `zmq.auth`: its lifetime is
exactly the coordinator's, and several coordinators can live in one process (tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

import zmq
import zmq.asyncio
from zmq.utils import z85

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
CLIENT_DOMAIN = "bios-clients"
WORKER_DOMAIN = "bios-workers"


class ZapHandler:
    def __init__(self, ctx: zmq.asyncio.Context, worker_public_key: bytes) -> None:
        self.ctx = ctx
        self.worker_public_key = worker_public_key  # Z85
        self.sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.denied = 0

    def start(self) -> None:
        """Bind before any secured socket binds, so no handshake slips through unchecked."""
        self.sock = self.ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="zap")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.sock is not None:
            self.sock.close(linger=0)

    async def _serve(self) -> None:
        assert self.sock is not None
        while True:
            request = await self.sock.recv_multipart()
            await self.sock.send_multipart(self._answer(request))

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6:
            return [b"1.0", request[1] if len(request) > 1 else b"", b"400", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism, *credentials = request
        if mechanism == b"CURVE" and len(credentials) == 1 and len(credentials[0]) == 32:
            client_key = z85.encode(credentials[0])
            if domain == CLIENT_DOMAIN.encode() or (
                domain == WORKER_DOMAIN.encode() and hmac.compare_digest(client_key, self.worker_public_key)
            ):
                return [version, request_id, b"200", b"OK", client_key, b""]
        self.denied += 1
        if self.denied & (self.denied - 1) == 0:  # 1st, 2nd, 4th...: a refused peer retries many times a second
            log.warning("refused a %s connection from %s to %s (%d refusals so far): not this cluster's worker key",
                        mechanism.decode(errors="replace"), address.decode(errors="replace"),
                        domain.decode(errors="replace"), self.denied)
        return [version, request_id, b"400", b"not allowed", b"", b""]
