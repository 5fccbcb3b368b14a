"""One help style for every Bios command: each option's default shown, unless it has none to show."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`(default: X)` after each option's help, but not for options that are off or unset by default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == "":
            return action.help
        return super()._get_help_string(action)
