"""`bios-worker`: join a coordinator and run its cycles until told to stop (SIGTERM = leave gracefully).

torch and the daemon are imported only once a worker really starts, so `--help` and argument errors are instant.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import logging
import os
import signal
import subprocess
import sys

from bios.cli.support import HelpFormatter, parse_size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bios-worker", description="Run a Bios worker (one per GPU, or one per CPU host).",
                                formatter_class=HelpFormatter)
    p.add_argument("--coordinator", default=os.environ.get("BIOS_COORDINATOR", "tcp://127.0.0.1:7600"),
                   help="the coordinator's client address ($BIOS_COORDINATOR)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--gpus", default=None, metavar="all|N",
                   help="fork one worker process per GPU (all visible ones, or the first N)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the cores this process may use: its affinity mask capped by "
                        "its cgroup CPU quota)")
    p.add_argument("--worker-id", default="", help="stable id for this worker (default: host-pid-random)")
    p.add_argument("--token", default=None,
                   help="the cluster's worker token, from `bios keys worker-token` (default: $BIOS_WORKER_TOKEN)")
    p.add_argument("--model-map", default=None, metavar="FILE",
                   help="JSON map of model names to local directories (same as BIOS_MODEL_MAP)")
    p.add_argument("--memory-limit", type=parse_size, default=None, metavar="SIZE",
                   help="memory budget to plan with instead of the device's (e.g. 2GiB, 512MiB); the coordinator "
                        "splits a model that does not fit over several workers (tensor parallelism)")
    p.add_argument("--log-level", default=os.environ.get("BIOS_LOG_LEVEL", "INFO"), help="($BIOS_LOG_LEVEL)")
    return p.parse_args(argv)


async def run(args: argparse.Namespace) -> None:
    import torch

    from bios.worker.daemon import WorkerConfig, WorkerDaemon, default_device

    if args.model_map:
        os.environ["BIOS_MODEL_MAP"] = args.model_map  # bios.models reads names through this
    device = torch.device(args.device) if args.device else default_device()
    token = args.token or os.environ.get("BIOS_WORKER_TOKEN")  # not an argparse default: --help would print it
    daemon = WorkerDaemon(WorkerConfig(coordinator=args.coordinator, device=device,
                                       worker_id=args.worker_id, token=token, memory_limit=args.memory_limit))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(daemon.leave("SIGTERM")))
    await daemon.run()


def fork_per_gpu(argv: list[str], gpus: str) -> int:
    """`--gpus all`: one child worker per device (`--device cuda:i`), stopped together on SIGTERM/SIGINT."""
    import torch

    available = torch.cuda.device_count()
    wanted = available if gpus == "all" else int(gpus)
    if available == 0 or not 1 <= wanted <= available:
        print(f"bios-worker: --gpus {gpus} asks for {wanted} GPU(s) but {available} are visible; "
              "run without --gpus to use the CPU", file=sys.stderr)
        return 2
    base = [a for i, a in enumerate(argv) if a != "--gpus" and (i == 0 or argv[i - 1] != "--gpus")]
    children = [subprocess.Popen([sys.executable, "-m", "bios.cli.worker", *base, "--device", f"cuda:{i}"])
                for i in range(wanted)]

    def forward(signum: int, frame: object) -> None:
        for child in children:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return max(child.wait() for child in children)


def _import_the_worker() -> None:
    """Import torch, Transformers and the daemon with the garbage collector off, then freeze what they made.

    Imports create hundreds of thousands of long-lived objects; collecting while they are made, and walking
    them all again when the process exits, took ~0.7 s of a worker's start and ~1 s of its exit (py-spy), time
    every elastic replacement and every cluster stop waits for.
    """
    gc.disable()
    try:
        from bios.worker import daemon  # noqa: F401  (torch, Transformers and the engine)
    finally:
        gc.freeze()
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.gpus is not None:
        return fork_per_gpu(argv, args.gpus)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s worker %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # `kill -USR1 <pid>` writes every thread's Python stack to the log: where a stuck worker waits
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _import_the_worker()
    import torch

    from bios.cpu_cores import usable_cores

    torch.set_num_threads(args.threads or usable_cores())
    logging.getLogger(__name__).info("%d torch CPU threads", torch.get_num_threads())
    from bios.actors import loop as event_loop
    from bios.exceptions import AuthenticationError

    try:
        event_loop.run(run(args))
    except AuthenticationError as exc:
        logging.getLogger(__name__).error("cannot join: %s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
