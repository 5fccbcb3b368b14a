"""Where Bios keeps what it makes once and reuses: models (`bios.models.cache`) and built kernels
(`bios.kernels.row_gemm`)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The Bios cache: `$BIOS_CACHE_DIR`, else `~/.cache/bios`. Not created here."""
    configured = os.environ.get("BIOS_CACHE_DIR", "").strip()
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "bios"
