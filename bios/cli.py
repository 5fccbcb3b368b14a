"""The `bios` command: `demo`, `up`, `status`, `models ...`, `keys ...`."""

from __future__ import annotations

import argparse
import sys

import bios
from bios.demo.cli import add_demo_parser
from bios.models.cli import add_models_parser
from bios.sdk.cli import add_cluster_parsers
from bios.security.cli import add_keys_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bios", description="Bios: self-hostable LoRA fine-tuning.")
    parser.add_argument("--version", action="version", version=f"bios {bios.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo_parser(commands)
    add_cluster_parsers(commands)
    add_models_parser(commands)
    add_keys_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
