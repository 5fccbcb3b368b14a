"""What every Bios command shares: one help style, the error that ends a command with one line of advice, and
the arguments several commands take (a state dir, a memory size)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bios import cluster_defaults

USAGE_EXIT = 2  # as argparse: the command line itself is wrong


class CommandError(Exception):
    """A failure the user can act on: `bios` prints the message (no traceback) and exits with `exit_code`."""

    def __init__(self, message: str, *, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`(default: X)` after each option's help, but not for options that are off or unset by default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == "":
            return action.help
        return super()._get_help_string(action)


def add_state_dir(parser: argparse.ArgumentParser, what: str) -> None:
    """`--state-dir`, defaulting to $BIOS_STATE_DIR or ./bios-state, as the coordinator's own."""
    parser.add_argument("--state-dir", type=Path, default=Path(os.environ.get("BIOS_STATE_DIR", "bios-state")),
                        help=f"{what} ($BIOS_STATE_DIR)")


def add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    """`--checkpoint-every` and `--keep-checkpoints`, with the defaults `bios-coordinator` and `bios up` share."""
    parser.add_argument("--checkpoint-every", type=int, default=cluster_defaults.CHECKPOINT_EVERY,
                        help="automatic checkpoint of each run every N optimizer steps (0 = off; 1 = no "
                             "acknowledged step is ever rolled back)")
    parser.add_argument("--keep-checkpoints", type=int, default=cluster_defaults.KEEP_CHECKPOINTS,
                        help="automatic checkpoints kept per run")


_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
               "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """`2GiB`, `512MiB`, `1.5GB`, `3000000000` -> bytes."""
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number):].lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if value <= 0 or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size: write e.g. 2GiB, 512MiB or 1500000000")
    return int(value * _SIZE_UNITS[unit])
