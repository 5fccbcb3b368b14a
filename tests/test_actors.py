"""The actor runtime: method calls one at a time, replies and errors to the asker, supervision by policy, and
actors across processes through a real ROUTER/DEALER pair."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import zmq
import zmq.asyncio

from bios import messages as m
from bios.actors.actor import Actor, ActorRef, ActorStopped, Failure, Policy, spawn
from bios.actors.remote import RemoteCallError, RemoteRef, serve
from bios.exceptions import BadRequestError
from bios.transport.codec import Codec, Envelope
from bios.transport.sockets import Dealer, Router, next_message_id
from bios.wire import make_codec

T = TypeVar("T")


async def within(awaitable: Awaitable[T], seconds: float = 10.0) -> T:
    """Guards against a hang; never a timing assertion."""
    return await asyncio.wait_for(awaitable, seconds)


class Counter(Actor):
    """Counts `incr` calls; `boom` fails; records its lifecycle in a shared log."""

    instances = 0

    def __init__(self, log: list[str]) -> None:
        Counter.instances += 1
        self.number = Counter.instances
        self.count = 0
        self.log = log

    async def started(self) -> None:
        self.log.append(f"started {self.number}")

    async def stopped(self) -> None:
        self.log.append(f"stopped {self.number}")

    async def incr(self) -> int:
        self.count += 1
        self.log.append(f"incr {self.count}")
        return self.count

    def boom(self) -> None:
        raise ValueError(f"boom at {self.count}")

    def bad(self) -> None:
        raise BadRequestError("seq_id must increase", field="seq_id")


@pytest.fixture
def log() -> list[str]:
    Counter.instances = 0
    return []


async def test_calls_are_processed_one_at_a_time_in_order() -> None:
    class Slow(Actor):
        def __init__(self) -> None:
            self.trace: list[tuple[str, int]] = []
            self.inside = 0

        async def double(self, message: int) -> int:
            self.inside += 1
            assert self.inside == 1, "two calls inside the actor at once"
            self.trace.append(("start", message))
            for _ in range(3):
                await asyncio.sleep(0)  # yield: a second call must still wait its turn
            self.trace.append(("end", message))
            self.inside -= 1
            return message * 2

    ref = spawn(Slow, name="slow")
    for i in range(5):
        ref.tell(Slow.double, i)
    replies = await within(asyncio.gather(*(ref.ask(Slow.double, i) for i in range(5, 10))))
    assert replies == [10, 12, 14, 16, 18]
    assert ref.actor.trace == [(edge, i) for i in range(10) for edge in ("start", "end")]
    await ref.stop()


async def test_ask_returns_the_value_and_ask_future_keeps_call_order(log: list[str]) -> None:
    ref = spawn(lambda: Counter(log), name="counter")
    futures = [ref.ask_future(Counter.incr) for _ in range(3)]
    assert await within(ref.ask(Counter.incr)) == 4
    assert [f.result() for f in futures] == [1, 2, 3]
    await ref.stop()


async def test_a_handler_error_reaches_the_asker_and_the_actor_resumes_with_its_state(log: list[str]) -> None:
    failures: list[Failure] = []
    ref = spawn(lambda: Counter(log), name="counter", on_failure=failures.append)
    first = ref.actor
    assert await within(ref.ask(Counter.incr)) == 1
    with pytest.raises(ValueError, match="boom at 1"):
        await within(ref.ask(Counter.boom))
    assert await within(ref.ask(Counter.incr)) == 2
    assert ref.actor is first and ref.running
    assert [(f.actor, type(f.error), f.action) for f in failures] == [("counter", ValueError, Policy.RESUME)]
    assert log[:1] == ["started 1"] and "stopped 1" not in log
    await ref.stop()


async def test_restart_builds_a_fresh_actor_from_the_factory(log: list[str]) -> None:
    failures: list[Failure] = []
    ref = spawn(lambda: Counter(log), name="counter", policy=Policy.RESTART, on_failure=failures.append)
    for _ in range(3):
        ref.tell(Counter.incr)
    with pytest.raises(ValueError, match="boom at 3"):
        await within(ref.ask(Counter.boom))
    assert await within(ref.ask(Counter.incr)) == 1  # fresh state
    assert ref.actor.number == 2
    assert log == ["started 1", "incr 1", "incr 2", "incr 3", "stopped 1", "started 2", "incr 1"]
    assert len(failures) == 1 and failures[0].action is Policy.RESTART and str(failures[0].error) == "boom at 3"
    await ref.stop()
    assert log[-1] == "stopped 2"


async def test_stop_policy_fails_queued_and_later_asks(log: list[str]) -> None:
    failures: list[Failure] = []
    ref = spawn(lambda: Counter(log), name="counter", policy=Policy.STOP, on_failure=failures.append)
    crash = ref.ask_future(Counter.boom)
    queued = ref.ask_future(Counter.incr)  # behind the failing message
    with pytest.raises(ValueError):
        await within(crash)
    with pytest.raises(ActorStopped):
        await within(queued)
    with pytest.raises(ActorStopped):
        await ref.ask(Counter.incr)
    with pytest.raises(ActorStopped):
        ref.tell(Counter.incr)
    assert not ref.running
    assert log == ["started 1", "stopped 1"]
    assert [f.action for f in failures] == [Policy.STOP]
    await ref.stop()  # stopping a stopped actor is harmless


async def test_supervisor_is_told_of_expected_errors_too(log: list[str]) -> None:
    failures: list[Failure] = []
    ref = spawn(lambda: Counter(log), name="counter", on_failure=failures.append)
    with pytest.raises(BadRequestError) as info:
        await within(ref.ask(Counter.bad))
    assert info.value.field == "seq_id"
    assert failures == [Failure("counter", info.value, Policy.RESUME)]
    await ref.stop()


async def test_stop_processes_what_is_queued_first(log: list[str]) -> None:
    ref = spawn(lambda: Counter(log), name="counter")
    futures = [ref.ask_future(Counter.incr) for _ in range(3)]
    ref.tell(Counter.incr)
    await within(ref.stop())
    assert [f.result() for f in futures] == [1, 2, 3]
    assert log == ["started 1", "incr 1", "incr 2", "incr 3", "incr 4", "stopped 1"]
    assert not ref.running
    with pytest.raises(ActorStopped):
        await ref.ask(Counter.incr)


async def test_ask_timeout_leaves_the_actor_serving() -> None:
    release = asyncio.Event()

    class Gate(Actor):
        async def echo(self, message: str) -> str:
            if message == "wait":
                await release.wait()
            return message

    ref = spawn(Gate, name="gate")
    with pytest.raises(TimeoutError):
        await ref.ask(Gate.echo, "wait", timeout=0.05)  # the event is only set below: this cannot finish in time
    release.set()
    assert await within(ref.ask(Gate.echo, "next")) == "next"
    await ref.stop()


@pytest.mark.parametrize("policy", [Policy.RESUME, Policy.RESTART])
async def test_a_failing_start_stops_the_actor_instead_of_hanging_its_askers(policy: Policy) -> None:
    starts = 0

    class Fragile(Actor):
        async def started(self) -> None:
            nonlocal starts
            starts += 1
            if starts == (1 if policy is Policy.RESUME else 2):  # the first start, or the restart
                raise RuntimeError("cannot load the model")

        def fail(self, message: str) -> str:
            raise ValueError(message)

    failures: list[Failure] = []
    ref = spawn(Fragile, name="fragile", policy=policy, on_failure=failures.append)
    asks = [ref.ask_future(Fragile.fail, "x"), ref.ask_future(Fragile.fail, "y")]
    outcomes = await within(asyncio.gather(*asks, return_exceptions=True))
    assert type(outcomes[-1]) is ActorStopped
    assert failures[-1].action is Policy.STOP and "cannot load the model" in str(failures[-1].error)
    with pytest.raises(ActorStopped):
        await ref.ask(Fragile.fail, "z")


async def test_an_unstarted_ref_stops_at_once(log: list[str]) -> None:
    ref = ActorRef(lambda: Counter(log), name="idle")
    assert not ref.running
    await ref.stop()
    with pytest.raises(ActorStopped):
        ref.tell(Counter.incr)


# ------------------------------------------------------------------------------------------- remote refs


@dataclass(frozen=True)
class Unregistered:
    """A reply the server's codec cannot encode."""


class Service(Actor):
    """The server side of the remote tests: answers pings, fails on request, remembers what it was told."""

    def __init__(self) -> None:
        self.told: list[m.Shutdown] = []

    async def handle(self, message: Any) -> Any:
        if isinstance(message, m.Ping):
            if message.payload == -1:
                raise BadRequestError("payload must be positive", field="payload")
            if message.payload == -2:
                raise KeyError("lost")
            if message.payload == -3:
                return Unregistered()
            return m.Pong(message.payload)
        if isinstance(message, m.GetClusterStatus):
            return m.Shutdown(",".join(told.reason for told in self.told))
        self.told.append(message)
        return None


class Remote:
    """A server (`serve` over a ROUTER feeding a `Service` actor) and a `RemoteRef` client over loopback TCP."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.codec = make_codec()
        self.router = Router(self.ctx, self.codec)
        self.router.bind("tcp://127.0.0.1:0")
        self.service = spawn(Service, name="service")
        self.peers: list[bytes] = []
        self.server = asyncio.ensure_future(serve(self.router, self._dispatch))
        self.pushed: asyncio.Queue[Envelope] = asyncio.Queue()

    def _dispatch(self, peer: bytes, env: Envelope, frames: list[Any]) -> Any:
        self.peers.append(peer)
        if isinstance(env.body, m.Shutdown):  # a tell: no reply
            self.service.tell(Service.handle, env.body)
            return None
        return self.service.ask_future(Service.handle, env.body)

    def client(self, codec: Codec | None = None) -> RemoteRef:
        dealer = Dealer(self.ctx, codec or self.codec)
        dealer.connect(self.router.address)
        return RemoteRef(dealer, on_message=self.pushed.put_nowait).start()

    async def close(self, *clients: RemoteRef) -> None:
        for client in clients:
            await client.close()
        self.server.cancel()
        await asyncio.gather(self.server, return_exceptions=True)
        await self.service.stop()
        self.router.close()
        self.ctx.term()


@pytest.fixture
async def remote() -> AsyncIterator[Remote]:
    pair = Remote()
    yield pair
    await pair.close()


async def test_remote_ask_and_tell_keep_order(remote: Remote) -> None:
    client = remote.client()
    try:
        assert await within(client.ask(m.Ping(7))) == m.Pong(7)
        await client.tell(m.Shutdown("first"))
        await client.tell(m.Shutdown("second"))
        assert await within(client.ask(m.GetClusterStatus(), timeout=10)) == m.Shutdown("first,second")
        replies = await within(asyncio.gather(*(client.ask(m.Ping(i)) for i in range(20))))
        assert replies == [m.Pong(i) for i in range(20)]
    finally:
        await client.close()


async def test_a_remote_handler_error_arrives_with_its_type_message_and_field(remote: Remote) -> None:
    client = remote.client()
    try:
        with pytest.raises(RemoteCallError) as info:
            await within(client.ask(m.Ping(-1)))
        assert (info.value.error.type, info.value.error.message) == ("BadRequestError", "payload must be positive")
        assert info.value.error.field == "payload"
        with pytest.raises(RemoteCallError) as info:
            await within(client.ask(m.Ping(-2)))
        assert info.value.error.type == "InternalServerError" and "KeyError" in info.value.error.message
        assert await within(client.ask(m.Ping(1))) == m.Pong(1)  # the server is still serving
    finally:
        await client.close()


async def test_a_reply_the_server_cannot_encode_still_answers_the_asker(remote: Remote) -> None:
    client = remote.client()
    try:
        with pytest.raises(RemoteCallError) as info:
            await within(client.ask(m.Ping(-3)))
        assert info.value.error.type == "InternalServerError" and "Unregistered" in info.value.error.message
    finally:
        await client.close()


async def test_a_message_the_server_cannot_decode_fails_the_right_ask(remote: Remote) -> None:
    client_codec = make_codec()
    client_codec.register(Unregistered)  # known here, unknown to the server
    client = remote.client(client_codec)
    try:
        with pytest.raises(RemoteCallError) as info:
            await within(client.ask(Unregistered()))
        assert info.value.error.type == "BadRequestError" and "Unregistered" in info.value.error.message
        with pytest.raises(TypeError):
            await client.ask(object())  # cannot even be encoded: fails here, leaves no reply slot behind
        await asyncio.sleep(0)  # done-callbacks run on the next loop turn
        assert client._pending == {}
        assert await within(client.ask(m.Ping(2))) == m.Pong(2)
    finally:
        await client.close()


async def test_unsolicited_pushes_reach_on_message(remote: Remote) -> None:
    client = remote.client()
    try:
        await within(client.ask(m.Ping(0)))  # the server learns our identity
        peer = remote.peers[-1]
        done = m.RequestDone(request_id="r1", result=m.Pong(1), cycle_id=4)
        await remote.router.send(peer, Envelope(next_message_id(), done))
        await remote.router.send(peer, Envelope(next_message_id(), m.Shutdown("bye"), reply_to=123456))  # no such ask
        first, second = await within(remote.pushed.get()), await within(remote.pushed.get())
        assert first.body == done
        assert second.body == m.Shutdown("bye")
    finally:
        await client.close()


async def test_close_fails_asks_still_waiting(remote: Remote) -> None:
    client = remote.client()
    future, send = client.ask_future(m.Ping(5))
    send.close()  # never sent: the reply can only come from close()
    await client.close()
    with pytest.raises(ConnectionError):
        await within(future)
