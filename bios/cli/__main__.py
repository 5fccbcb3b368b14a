"""`python -m bios.cli`: the `bios` command (how `bios up --detach` starts itself again)."""

import sys

from bios.cli.main import main

sys.exit(main())
