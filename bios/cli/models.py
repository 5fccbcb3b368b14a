"""`bios models list | path NAME | pull NAME`."""

from __future__ import annotations

import argparse
import sys

from bios.models.registry import ModelEntry, list_models, pull, resolve_model_dir


def add_models_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("models", help="list, locate and pull base models")
    commands = parser.add_subparsers(dest="models_command", required=True, metavar="COMMAND")

    listing = commands.add_parser("list", help="built-in, pulled, mapped and cached models with their sizes")
    listing.set_defaults(func=run_list)

    path = commands.add_parser("path", help="print a model's local directory (writes a built-in on first use)")
    path.add_argument("name", help="a model name, alias, mapped name or local directory")
    path.set_defaults(func=run_path)

    pulling = commands.add_parser("pull", help="download and convert a model into the cache (no-op if there)")
    pulling.add_argument("name", help="e.g. smollm2 (HuggingFaceTB/SmolLM2-135M-Instruct)")
    pulling.add_argument("--quiet", action="store_true", help="print only the directory")
    pulling.set_defaults(func=run_pull)
    return parser


def run_list(args: argparse.Namespace) -> int:
    try:
        entries = list_models()
    except ValueError as exc:  # a broken BIOS_MODEL_MAP
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_table(entries))
    return 0


def run_path(args: argparse.Namespace) -> int:
    try:
        print(resolve_model_dir(args.name))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def run_pull(args: argparse.Namespace) -> int:
    try:
        print(pull(args.name, progress=not args.quiet))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def format_table(entries: list[ModelEntry]) -> str:
    header = ("NAME", "KIND", "PARAMS", "SIZE", "DIR")
    rows = [
        (
            e.name,
            e.kind,
            "-" if e.num_parameters is None else _human(e.num_parameters, 1000, ["", "K", "M", "B", "T"]),
            "-" if e.size_bytes is None else _human(e.size_bytes, 1024, [" B", " KiB", " MiB", " GiB", " TiB"]),
            e.local_dir or "- (not on disk yet)",
        )
        for e in entries
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header) - 1)]
    lines = ["  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]) for row in (header, *rows)]
    return "\n".join(lines)


def _human(value: int, base: int, units: list[str]) -> str:
    amount, step = float(value), 0
    while amount >= base and step < len(units) - 1:
        amount, step = amount / base, step + 1
    return f"{amount:.0f}{units[0]}" if step == 0 else f"{amount:.1f}{units[step]}"
