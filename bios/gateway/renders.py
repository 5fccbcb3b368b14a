"""How each result becomes the reply the tinker SDK expects from `retrieve_future`: JSON for most, protobuf for
forward/backward outputs and samples. A save with `ttl_seconds` gets its expiry as its result is rendered.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from bios import messages as m
from bios import types as t
from bios.checkpoint_path import CheckpointPath
from bios.coordinator.accounts import Accounts
from bios.coordinator.front_door import FrontDoor

from . import json_wire, proto
from .futures import PROTOBUF, Reply, json_reply


class Renders:
    def __init__(self, front_door: FrontDoor, accounts: Accounts) -> None:
        self.front_door = front_door
        self.labels = accounts.labels

    async def by_type(self, result: Any) -> Reply:
        """A result rendered by its type alone (for promises recovered after a restart)."""
        renders: dict[type, Callable[[Any], Awaitable[Reply]]] = {
            m.ModelCreated: self.created,
            t.ForwardBackwardOutput: self.forward_backward,
            t.OptimStepResponse: self.optim_step,
            t.SaveWeightsResponse: partial(self.saved, None),
            t.SaveWeightsForSamplerResponse: partial(self._adapter_saved, None),
            t.LoadWeightsResponse: self.loaded,
            t.SampleResponse: partial(self.sample, None),
        }
        return await renders[type(result)](result)

    async def created(self, created: m.ModelCreated) -> Reply:
        return json_reply({"model_id": created.model_id, "type": "create_model"})

    async def created_from(self, path: str, created: m.ModelCreated) -> Reply:
        return json_reply({"model_id": created.model_id, "path": json_wire.tinker_path(path), "type": "load_weights"})

    async def forward_backward(self, out: t.ForwardBackwardOutput) -> Reply:
        return Reply(proto.forward_backward_output(out, json_wire.tinker_metrics(out.metrics)), PROTOBUF)

    async def optim_step(self, out: t.OptimStepResponse) -> Reply:
        return json_reply({"metrics": json_wire.tinker_metrics(out.metrics)})

    def _expire(self, path: str, ttl_seconds: int | None) -> None:
        if ttl_seconds is not None:
            self.labels.set_ttl(path, ttl_seconds)

    async def saved(self, ttl_seconds: int | None, out: t.SaveWeightsResponse) -> Reply:
        self._expire(out.path, ttl_seconds)
        return json_reply({"path": json_wire.tinker_path(out.path), "type": "save_weights"})

    async def _adapter_saved(self, ttl_seconds: int | None, out: t.SaveWeightsForSamplerResponse) -> Reply:
        """An adapter-only save: for sampling, or for download (save_weights_external), by its path's kind."""
        if CheckpointPath.parse(out.path).kind == "external_weights":
            return await self.external_saved(ttl_seconds, out)
        return await self.sampler_saved(ttl_seconds, out)

    async def sampler_saved(self, ttl_seconds: int | None, out: t.SaveWeightsForSamplerResponse) -> Reply:
        self._expire(out.path, ttl_seconds)
        return json_reply({"path": json_wire.tinker_path(out.path), "type": "save_weights_for_sampler"})

    async def external_saved(self, ttl_seconds: int | None, out: t.SaveWeightsForSamplerResponse) -> Reply:
        self._expire(out.path, ttl_seconds)
        return json_reply({"path": json_wire.tinker_path(out.path), "type": "save_weights_external"})

    async def sampling_session(self, owner: str, session_id: str, sampling_seq: int,
                                       out: t.SaveWeightsForSamplerResponse) -> Reply:
        """An unnamed save's result is a sampling session on its checkpoint: save_weights_and_get_sampling_client."""
        query = m.CreateSamplingSession(session_id, sampling_seq, None, out.path)
        session = await self.front_door.query(query, owner)
        return json_reply({"path": json_wire.tinker_path(out.path), "sampling_session_id": session.sampling_session_id,
                           "type": "save_weights_for_sampler"})

    async def loaded(self, out: t.LoadWeightsResponse) -> Reply:
        return json_reply({"path": json_wire.tinker_path(out.path), "model_id": out.model_id, "type": "load_weights"})

    async def sample(self, last_n: int | None, out: t.SampleResponse) -> Reply:
        return Reply(proto.sample_response(out, last_n), PROTOBUF)
