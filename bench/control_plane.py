"""Control-plane round trip: an empty op SDK → coordinator → worker → SDK vs a raw pyzmq DEALER/ROUTER echo.

    python bench/control_plane.py [--calls 2000]

The reference is an echo server in its own process (a plain ROUTER that sends every message back) and a plain
DEALER client: the floor for one loopback round trip in Python. Bios's path has two hops (the coordinator
forwards to a worker) plus the SDK's hand-off to its I/O thread, so the bench also times the floor of any
relayed path: a blocking pyzmq relay process (no asyncio, no codec, no logic) between the same client and an
echoing DEALER "worker", i.e. the four one-way transfers Bios's path makes where the echo makes two.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import platform
import statistics
import time

import zmq

import bios


def _echo_server(address_queue: multiprocessing.Queue) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    address_queue.put(f"tcp://127.0.0.1:{port}")
    while True:
        frames = sock.recv_multipart()
        if frames[1] == b"stop":
            break
        sock.send_multipart(frames)
    sock.close()
    ctx.term()


def _echo_worker(address: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    sock.send(b"ready")
    while True:
        frames = sock.recv_multipart()
        if frames[-1] == b"stop":
            break
        sock.send_multipart(frames)
    sock.close()
    ctx.term()


def _relay(address_queue: multiprocessing.Queue) -> None:
    """ROUTER for clients, ROUTER for one worker; forwards each way with blocking calls."""
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    front_port = front.bind_to_random_port("tcp://127.0.0.1")
    back_port = back.bind_to_random_port("tcp://127.0.0.1")
    address_queue.put(f"tcp://127.0.0.1:{back_port}")
    worker_id = back.recv_multipart()[0]
    address_queue.put(f"tcp://127.0.0.1:{front_port}")
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll():
            if sock is front:
                peer, body = front.recv_multipart()
                back.send_multipart([worker_id, peer, body])
                if body == b"stop":
                    return
            else:
                _, peer, body = back.recv_multipart()
                front.send_multipart([peer, body])


def raw_echo(calls: int) -> list[float]:
    queue: multiprocessing.Queue = multiprocessing.Queue()
    server = multiprocessing.Process(target=_echo_server, args=(queue,), daemon=True)
    server.start()
    times = _round_trips(queue.get(timeout=30), calls)
    server.join(5)
    return times


def relayed_echo(calls: int) -> list[float]:
    queue: multiprocessing.Queue = multiprocessing.Queue()
    relay = multiprocessing.Process(target=_relay, args=(queue,), daemon=True)
    relay.start()
    worker = multiprocessing.Process(target=_echo_worker, args=(queue.get(timeout=30),), daemon=True)
    worker.start()
    times = _round_trips(queue.get(timeout=30), calls)
    relay.join(5)
    worker.join(5)
    return times


def _round_trips(address: str, calls: int) -> list[float]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    payload = b"\x85\xa1v\x01\xa2id\x01\xa2re\xc0\xa4kind\xa4Ping\xa4body\x81\xa7payload\x00"
    times = []
    for i in range(calls + 200):
        started = time.perf_counter()
        sock.send(payload)
        sock.recv()
        if i >= 200:
            times.append(time.perf_counter() - started)
    sock.send(b"stop")
    sock.close()
    ctx.term()
    return times


def bios_ping(service: bios.ServiceClient, calls: int) -> list[float]:
    for _ in range(200):
        service.ping()
    return [service.ping() for _ in range(calls)]


async def _bios_ping_async(service: bios.ServiceClient, calls: int) -> list[float]:
    for _ in range(200):
        await service.ping_async()
    return [await service.ping_async() for _ in range(calls)]


def summarize(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return statistics.median(ordered), ordered[int(len(ordered) * 0.99) - 1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    ref = summarize(raw_echo(args.calls))
    relay = summarize(relayed_echo(args.calls))
    with bios.ServiceClient() as service:
        service.create_lora_training_client("bios/tiny-llama", rank=8)  # the worker is up and warm
        sync = summarize(bios_ping(service, args.calls))
        asyn = summarize(asyncio.run(_bios_ping_async(service, args.calls)))
    print(f"machine: {platform.processor() or platform.machine()}, {multiprocessing.cpu_count()} cores, "
          f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}")
    print(f"{'path':<44} {'p50 µs':>8} {'p99 µs':>8} {'p50 ratio':>10}")
    print(f"{'raw pyzmq DEALER/ROUTER echo (reference)':<44} {ref[0]*1e6:8.0f} {ref[1]*1e6:8.0f} {1.0:10.2f}")
    print(f"{'blocking pyzmq relay + echo worker (floor)':<44} {relay[0]*1e6:8.0f} {relay[1]*1e6:8.0f} "
          f"{relay[0] / ref[0]:10.2f}")
    for name, (p50, p99) in (("bios ping, sync SDK", sync), ("bios ping, async SDK", asyn)):
        print(f"{name + ' (SDK→coord→worker→SDK)':<44} {p50*1e6:8.0f} {p99*1e6:8.0f} {p50 / ref[0]:10.2f}")


if __name__ == "__main__":
    main()
