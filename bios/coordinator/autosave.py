"""Checkpoints the coordinator writes: automatic ones every N optimizer steps of a run, and every save's files.

An automatic checkpoint runs in the same cycle as the step it covers, and the scheduler answers a cycle's
requests only when the cycle is over, so with `--checkpoint-every 1` no acknowledged step can be rolled back even
by losing every process at once (the README states the guarantee per setting).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from bios import ids
from bios import messages as m
from bios import types as t
from bios.checkpoint_path import CheckpointPath
from bios.exceptions import RemoteError

from .catalog import Catalog

log = logging.getLogger(__name__)


@dataclass
class AutoSave:
    catalog: Catalog
    every: int = 0  # automatic checkpoint every N optimizer steps of a run (0 = off)
    keep: int = 2  # automatic checkpoints kept per run
    steps: dict[str, int] = field(default_factory=dict)  # run -> optimizer steps selected so far

    def after_step(self, model_id: str) -> list[m.WorkItem]:
        """A cycle ends a run's share with an optimizer step: its automatic checkpoint, if one is due."""
        step = self.steps[model_id] = self.steps.get(model_id, 0) + 1
        if self.every <= 0 or step % self.every:
            return []
        return [m.WorkItem(ids.automatic_request_id(model_id, step), automatic_save(model_id, step))]

    def write(self, op: m.SaveWeights, saved: m.SavedState, request_id: str, owner: str) -> tuple[Any, Any]:
        """Store a save's tensors; (response, None), or (None, error) if they could not be written."""
        path = CheckpointPath.parse(op.path)
        automatic = ids.is_automatic(request_id)
        try:
            self.catalog.save(path, saved.state, owner=owner, automatic=automatic, user_metadata=op.user_metadata)
        except Exception as exc:  # any failure to write fails this save alone, with its cause
            log.exception("could not write checkpoint %s", path)
            return None, RemoteError("RequestFailedError", f"could not write checkpoint {path}: {exc}",
                                     request_id=request_id)
        if automatic:
            self.catalog.prune_automatic(op.model_id, self.keep)
        if op.kind == "weights":
            return t.SaveWeightsResponse(str(path)), None
        return t.SaveWeightsForSamplerResponse(str(path)), None


def automatic_save(model_id: str, step: int) -> m.SaveWeights:
    path = CheckpointPath(model_id, "weights", f"auto-{step:06d}")
    return m.SaveWeights(model_id, -1, path.name, "weights", overwrite=True, path=str(path))
