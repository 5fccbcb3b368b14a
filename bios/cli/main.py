"""The `bios` command: `demo`, `up`, `down`, `logs`, `status`, `runs`, `checkpoints`, `models ...`, `keys ...`.

A command that fails says why in a line or two and exits 1 (2 for a wrong command line); `bios --debug ...`
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys

import bios
from bios.cli.cluster import add_cluster_parsers
from bios.cli.demo import add_demo_parser
from bios.cli.keys import add_keys_parser
from bios.cli.models import add_models_parser
from bios.cli.support import USAGE_EXIT, CommandError
from bios.cli.up import add_up_parsers
from bios.exceptions import BiosAPIError
from bios.sdk.address import AddressError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bios", description="Bios: self-hostable LoRA fine-tuning.")
    parser.add_argument("--version", action="version", version=f"bios {bios.__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback when a command fails")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo_parser(commands)
    add_up_parsers(commands)
    add_cluster_parsers(commands)
    add_models_parser(commands)
    add_keys_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # `bios up --detach` starts itself again with the same command line
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        code, message = explain(exc)
        print(f"bios: error: {message}", file=sys.stderr)
        return code


def explain(exc: Exception) -> tuple[int, str]:
    """Exit code and message for a failed command: ours say what to do; anything else is named as unexpected."""
    if isinstance(exc, CommandError):
        return exc.exit_code, str(exc)
    if isinstance(exc, AddressError):
        return USAGE_EXIT, str(exc)
    if isinstance(exc, BiosAPIError):
        return 1, str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return 1, f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return 1, f"unexpected {type(exc).__name__}: {exc} (`bios --debug ...` shows where)"

