"""The `bios` command line: `main` parses it (`bios.cli.main`), one module per command family runs it.

This module imports nothing, so `bios-coordinator` and `bios-worker` can share `bios.cli.support` without loading
every command.
"""
