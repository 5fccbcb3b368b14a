"""Commands against a running cluster: `bios status`, `runs list|show|trace`, `checkpoints list`,
`checkpoint export`."""

from __future__ import annotations

import argparse
import json
import os
import time

from bios.cli.support import CommandError
from bios.sdk.address import AddressError, explain_unreachable, normalize_address
from bios.run_trace import chrome_trace
from bios.sdk.service import ServiceClient

from .run_report import run_summary, runs_table

CONNECT_TIMEOUT_S = 3.0  # with the probe and the process's start, a silent address is reported within 5 s


def add_cluster_parsers(subparsers: argparse._SubParsersAction) -> None:
    status = subparsers.add_parser("status", help="workers, generation, queue depth and cycles of a cluster")
    _connection_args(status)
    status.set_defaults(func=run_status)

    runs = subparsers.add_parser("runs", help="training runs of this key")
    runs_commands = runs.add_subparsers(dest="runs_command", required=True, metavar="COMMAND")
    listing = runs_commands.add_parser("list", help="a table of runs")
    _connection_args(listing)
    listing.add_argument("--limit", type=int, default=50)
    listing.set_defaults(func=run_runs_list)
    show = runs_commands.add_parser("show", help="a run's summary and a sparkline of its loss")
    show.add_argument("run_id")
    _connection_args(show)
    show.set_defaults(func=run_runs_show)
    trace = runs_commands.add_parser("trace", help="the run's requests as Chrome trace / Perfetto JSON, on stdout")
    trace.add_argument("run_id")
    _connection_args(trace)
    trace.set_defaults(func=run_runs_trace)

    checkpoints = subparsers.add_parser("checkpoints", help="list checkpoints of a run")
    ckpt_commands = checkpoints.add_subparsers(dest="checkpoints_command", required=True, metavar="COMMAND")
    ckpt_list = ckpt_commands.add_parser("list", help="a table of a run's checkpoints")
    ckpt_list.add_argument("run_id")
    _connection_args(ckpt_list)
    ckpt_list.set_defaults(func=run_checkpoints_list)

    checkpoint = subparsers.add_parser("checkpoint", help="export a checkpoint")
    one = checkpoint.add_subparsers(dest="checkpoint_command", required=True, metavar="COMMAND")
    export = one.add_parser("export", help="write a PEFT adapter directory (or a merged model with --merged)")
    export.add_argument("path", help="bios://<run>/sampler_weights/<name> or .../weights/<name>")
    export.add_argument("out_dir")
    export.add_argument("--merged", action="store_true", help="a full model with the adapter merged in")
    _connection_args(export)
    export.set_defaults(func=run_checkpoint_export)


def _connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", type=_address, default=os.environ.get("BIOS_ADDRESS", "tcp://127.0.0.1:7600"),
                        help="the coordinator's client address, tcp://HOST:PORT (default: $BIOS_ADDRESS, else "
                             "tcp://127.0.0.1:7600)")
    parser.add_argument("--api-key", help="your API key, from `bios keys create` (default: $BIOS_API_KEY)")


def _address(text: str) -> str:
    try:
        return normalize_address(text)
    except AddressError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _client(args: argparse.Namespace) -> ServiceClient:
    """A client of the cluster at --address, or a one-line error within a few seconds when there is none."""
    not_bios = explain_unreachable(args.address)
    if not_bios:
        raise CommandError(not_bios)
    return ServiceClient(address=args.address, api_key=args.api_key or os.environ.get("BIOS_API_KEY"),
                         connect_timeout_s=CONNECT_TIMEOUT_S)


def run_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        status = client.cluster_status()
    busy = status.busy_s / status.uptime_s if status.uptime_s else 0.0
    print(f"coordinator {args.address}: generation {status.generation}, {status.runs} run(s), "
          f"{status.queue_depth} queued request(s)")
    clock = "back to back" if status.cycle_s == 0 else f"every {status.cycle_s:g}s"
    print(f"cycles: {status.cycles_run} run, {clock} (cycle_s={status.cycle_s:g}), busy {busy:.0%} of "
          f"{status.uptime_s:.0f}s")
    print(f"{'worker':<28} {'state':<8} {'device':<8} {'memory':>9} {'pid':>7}  host  heartbeat  models")
    for w in status.workers:
        print(f"{w.worker_id:<28} {w.state:<8} {w.device:<8} {w.memory_bytes / 2**30:>5.1f} GiB {w.pid:>7}  {w.host}  "
              f"{w.last_heartbeat_age_s:.1f}s ago  {', '.join(w.models) or '-'}")
        if w.note:
            print(f"  {w.note}")
    for group in status.groups:
        formed = ", ".join(group.formed) or "none formed yet"
        print(f"group {group.group_id}: {', '.join(group.models)} on {', '.join(group.workers) or 'no worker'} "
              f"({group.replicas} replica(s) x {group.tp}; running on {formed})")
    for note in status.placement_notes:
        print(f"  placed: {note}")
    for base_model, plan in status.plans.items():
        print(f"plan {base_model}: {plan}")
    if status.state_dir is not None:
        space = status.state_dir
        print(f"state dir {space.path}: {space.free_bytes / 2**30:.1f} GiB free of {space.total_bytes / 2**30:.1f} GiB")
        if space.warning:
            print(f"warning: {space.warning}")
    return 0


def run_runs_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        summaries = client.create_rest_client().list_run_summaries(limit=args.limit).result()
    print("\n".join(runs_table(summaries)))
    return 0


def run_runs_show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        history = client.create_rest_client().get_training_run_metrics(args.run_id).result()
    print("\n".join(run_summary(history)))
    return 0


def run_runs_trace(args: argparse.Namespace) -> int:
    with _client(args) as client:
        trace = client.create_rest_client().get_run_trace(args.run_id).result()
    print(json.dumps(chrome_trace(trace)))
    return 0


def run_checkpoints_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        listing = client.create_rest_client().list_checkpoints(args.run_id).result()
    print(f"{'path':<70} {'type':<8} {'size':>10}  created")
    for ckpt in listing.checkpoints:
        print(f"{ckpt.bios_path:<70} {ckpt.checkpoint_type:<8} {ckpt.size_bytes or 0:>10}  "
              f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ckpt.time))}")
    return 0


def run_checkpoint_export(args: argparse.Namespace) -> int:
    with _client(args) as client:
        out = client.create_rest_client().export_checkpoint(args.path, args.out_dir, merged=args.merged)
    print(f"wrote {'a merged model' if args.merged else 'a PEFT adapter'} to {out}")
    return 0
