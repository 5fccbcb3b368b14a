"""Checkpoint paths: `bios://<run_id>/weights/<name>` (adapter + optimizer), `.../sampler_weights/<name>` (the
adapter, for sampling) and `.../external_weights/<name>` (the adapter, for download: Tinker's save_weights_external).

`tinker://` paths of the same shape are accepted too, so Tinker code and the HTTP gateway can pass theirs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from bios.exceptions import BadRequestError

Kind = Literal["weights", "sampler_weights", "external_weights"]
KINDS = ("weights", "sampler_weights", "external_weights")
SCHEMES = ("bios", "tinker")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class CheckpointPath:
    run_id: str
    kind: Kind
    name: str

    @classmethod
    def parse(cls, path: str, *, field: str = "path") -> CheckpointPath:
        scheme, sep, rest = path.partition("://")
        parts = rest.split("/")
        if not sep or scheme not in SCHEMES or len(parts) != 3 or not all(parts):
            raise BadRequestError(
                f"malformed checkpoint path {path!r}; expected bios://<run_id>/<kind>/<name> with kind "
                f"{', '.join(KINDS)}",
                field=field,
            )
        run_id, kind, name = parts
        if kind not in KINDS:
            raise BadRequestError(f"checkpoint kind {kind!r} in {path!r} is not one of {', '.join(KINDS)}", field=field)
        check_name(name, field=field)
        return cls(run_id, kind, name)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"bios://{self.run_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"


def check_name(name: str, *, field: str = "name") -> None:
    if not _NAME.match(name):
        raise BadRequestError(
            f"checkpoint name {name!r} must be 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
            field=field,
        )
