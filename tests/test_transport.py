"""ZeroMQ endpoints over real loopback TCP: request/reply, zero-copy tensors, and a router that survives
whatever a raw peer sends."""

from __future__ import annotations

import asyncio
import re
import struct
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import msgpack
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

from bios import messages as m
from bios.transport.codec import WIRE_VERSION, Envelope, Limits, TransportError
from bios.transport.sockets import Dealer, Router, next_message_id
from bios.wire import make_codec

T = TypeVar("T")
LIMITS = Limits(max_frames=8, max_message_bytes=1 << 20)
CODEC = make_codec(LIMITS)


async def within(awaitable: Awaitable[T], seconds: float = 10.0) -> T:
    """Guards against a hang; never a timing assertion."""
    return await asyncio.wait_for(awaitable, seconds)


class Net:
    """Sockets of one test, all closed (and the context terminated) at teardown."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self._closers: list[Any] = []

    def router(self) -> Router:
        router = Router(self.ctx, CODEC)
        self._closers.append(router)
        router.bind("tcp://127.0.0.1:0")
        return router

    def dealer(self, address: str, identity: bytes | None = None) -> Dealer:
        dealer = Dealer(self.ctx, CODEC, identity=identity)
        self._closers.append(dealer)
        dealer.connect(address)
        return dealer

    def raw(self, kind: int, address: str | None = None) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self._closers.append(sock)
        if address is not None:
            sock.connect(address)
        return sock

    def close(self) -> None:
        for endpoint in self._closers:
            endpoint.close()
        self.ctx.term()


@pytest.fixture
async def net() -> AsyncIterator[Net]:
    network = Net()
    yield network
    network.close()


def _header(kind: str, body: Any, env_id: int) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, "id": env_id, "re": None, "kind": kind, "body": body}, use_bin_type=True)


async def test_bind_reports_the_port_it_picked(net: Net) -> None:
    router = net.router()
    match = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", router.address)
    assert match is not None and int(match.group(1)) > 0


async def test_request_reply_reaches_the_right_peer(net: Net) -> None:
    router = net.router()
    alice, bob = net.dealer(router.address, b"alice"), net.dealer(router.address, b"bob")
    for dealer, payload in ((alice, 1), (bob, 2)):
        await dealer.send(Envelope(next_message_id(), m.Ping(payload)))
    for _ in range(2):
        peer, env, _frames = await within(router.recv())
        assert peer == {1: b"alice", 2: b"bob"}[env.body.payload]
        await router.send(peer, Envelope(next_message_id(), m.Pong(env.body.payload * 10), env.id))
    assert (await within(alice.recv())).body == m.Pong(10)
    assert (await within(bob.recv())).body == m.Pong(20)


async def test_reply_names_the_request_it_answers(net: Net) -> None:
    router = net.router()
    dealer = net.dealer(router.address)
    request = Envelope(next_message_id(), m.GetInfo(model_id="s:train:0"))
    await dealer.send(request)
    peer, env, _frames = await within(router.recv())
    assert env == request
    await router.send_raw(peer, CODEC.encode(Envelope(next_message_id(), m.Ack(), env.id)))  # a stored reply
    reply = await within(dealer.recv())
    assert reply is not None and reply.reply_to == request.id and reply.body == m.Ack()


async def test_large_tensors_arrive_as_views_of_the_received_frames(net: Net) -> None:
    router = net.router()
    dealer = net.dealer(router.address)
    array = np.arange(50_000, dtype=np.float32)
    tensor = torch.arange(40_000, dtype=torch.int64).reshape(200, 200)
    body = m.ItemDone(cycle_id=1, request_id="r", result={"a": array, "t": tensor})
    await dealer.send(Envelope(next_message_id(), body))
    _peer, env, frames = await within(router.recv())
    received_a, received_t = env.body.result["a"], env.body.result["t"]
    np.testing.assert_array_equal(received_a, array)
    assert torch.equal(received_t, tensor)
    assert len(frames) == 3
    assert np.shares_memory(received_a, np.frombuffer(frames[1].buffer, np.uint8))
    assert received_t.data_ptr() == np.frombuffer(frames[2].buffer, np.uint8).ctypes.data


async def test_garbage_gets_an_error_reply_and_the_router_keeps_serving(net: Net) -> None:
    router = net.router()
    serving = asyncio.ensure_future(router.recv())  # runs across all the garbage below
    raw = net.raw(zmq.DEALER, router.address)
    good = CODEC.encode(Envelope(5, m.Ping(1)))
    fields = {"model_id": "m", "seq_id": 1, "loss_fn": "x"}
    garbage: list[tuple[list[bytes], int | None]] = [
        ([b"\xc1"], None),
        ([b"not msgpack at all", b"and a second frame"], None),
        ([bytes(good[0])[:-3]], None),  # truncated
        ([b"\xc6\xff\xff\xff\xff" + b"\x00" * 16], None),  # bin32 declaring 4 GiB
        ([b"\xdd\xff\xff\xff\xff" + b"\x00" * 16], None),  # array32 declaring 4 billion items
        ([b"\xdf\xff\xff\xff\xff" + b"\x00" * 16], None),  # map32 declaring 4 billion entries
        ([_header("LaunchMissiles", {}, 77)], 77),
        ([_header("Ping", {"payload": "one"}, 78)], 78),
        ([_header("ForwardBackward", {**fields, "data": [{"__t": "Datum", "model_input": 5}]}, 79)], 79),
        ([bytes(good[0]), b"unreferenced"], 5),
        ([bytes(good[0])] + [b""] * LIMITS.max_frames, None),  # too many frames
        ([b""], None),  # one empty frame
    ]
    for frames, _ in garbage:
        await raw.send_multipart(frames)
    for frames, reply_to in garbage:
        reply = CODEC.decode(await within(raw.recv_multipart()))
        assert isinstance(reply.body, TransportError) and reply.body.message
        assert reply.reply_to == reply_to, frames
    assert not serving.done()
    dealer = net.dealer(router.address)
    await dealer.send(Envelope(6, m.Ping(2)))
    _peer, env, _frames = await within(serving)
    assert env.body == m.Ping(2)
    assert router.bad_messages == len(garbage)


def _zmtp_greeting_and_ready() -> bytes:
    """A ZMTP 3.0 NULL handshake as a DEALER would send it, written by hand."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    return greeting + b"\x04" + bytes([len(ready)]) + ready


async def _open_tcp(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def _until_hang_up(reader: asyncio.StreamReader) -> None:
    """Read until the server closes the connection (a reset counts); a server that waits instead fails the test."""
    try:
        while await within(reader.read(4096)):
            pass
    except ConnectionResetError:
        pass


async def _zmtp_handshake(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect as a hand-written ZMTP peer and complete the handshake, so what follows reaches the decoder."""
    reader, writer = await _open_tcp(address)
    writer.write(_zmtp_greeting_and_ready())
    assert (await within(reader.readexactly(64)))[:1] == b"\xff"
    flags, size = await within(reader.readexactly(2))
    assert flags == 0x04 and (await within(reader.readexactly(size))).startswith(b"\x05READY")
    return reader, writer


@pytest.mark.parametrize("declared", [2**62, LIMITS.max_message_bytes + 1], ids=["2**62", "limit+1"])
async def test_a_frame_declaring_too_many_bytes_is_cut_off(net: Net, declared: int) -> None:
    router = net.router()
    serving = asyncio.ensure_future(router.recv())
    reader, writer = await _zmtp_handshake(router.address)
    writer.write(b"\x02" + struct.pack(">Q", declared) + b"x" * 64)
    await _until_hang_up(reader)  # without the size limit the router would wait for the rest of the bytes
    writer.close()
    dealer = net.dealer(router.address)
    await dealer.send(Envelope(9, m.Ping(3)))
    _peer, env, _frames = await within(serving)
    assert env.body == m.Ping(3)
    assert router.bad_messages == 0  # nothing reached the codec


async def test_non_zmtp_bytes_and_oversized_messages_do_not_stop_the_router(net: Net) -> None:
    router = net.router()
    serving = asyncio.ensure_future(router.recv())
    for junk in (bytes(range(256)) * 8, b"\xff" * 4096, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"):
        _reader, writer = await _open_tcp(router.address)
        writer.write(junk)
        await writer.drain()
        writer.close()
    raw = net.raw(zmq.DEALER, router.address)
    await raw.send(b"\x00" * (LIMITS.max_message_bytes + 1))  # zmq cuts this peer off
    dealer = net.dealer(router.address)
    await dealer.send(Envelope(9, m.Ping(3)))
    _peer, env, _frames = await within(serving)
    assert env.body == m.Ping(3)


async def test_dealer_drops_an_undecodable_message_and_reads_the_next(net: Net) -> None:
    raw = net.raw(zmq.ROUTER)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    dealer = net.dealer(f"tcp://127.0.0.1:{port}", b"me")
    await dealer.send(Envelope(1, m.Hello()))
    peer, *_ = await within(raw.recv_multipart())
    await raw.send_multipart([peer, b"\xc1garbage"])
    welcome = m.Welcome(session_id="s", server_version="1", cycle_s=0.0)
    await raw.send_multipart([peer, *CODEC.encode(Envelope(2, welcome, 1))])
    assert await within(dealer.recv()) is None
    reply = await within(dealer.recv())
    assert reply is not None and reply.body == welcome and reply.reply_to == 1
