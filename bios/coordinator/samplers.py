"""Sampling sessions: who owns each and what it samples (a base model, or a run's sampler checkpoint).

Kept by the scheduler actor (admission reads them to route a `Sample`), and in the state dir."""

from __future__ import annotations

from bios import ids
from bios import messages as m
from bios.exceptions import BadRequestError, NotFoundError

from .admission import Sampler
from .catalog import Catalog
from .store import Store


class SamplerSessions:
    def __init__(self, store: Store, catalog: Catalog) -> None:
        self.store = store
        self.catalog = catalog
        self.by_id: dict[str, Sampler] = {}

    def get(self, owner: str, body: m.GetSamplingSession) -> m.SamplingSession:
        sampler = self.by_id.get(body.sampling_session_id)
        if sampler is None or sampler.owner != owner:
            raise NotFoundError(f"no sampling session {body.sampling_session_id!r}; create one with "
                                "create_sampling_client", field="sampling_session_id")
        return m.SamplingSession(body.sampling_session_id, sampler.base_model, sampler.model_path)

    def create(self, owner: str, body: m.CreateSamplingSession) -> m.SamplingSession:
        if self.store.session_owner(body.session_id) != owner:
            raise NotFoundError(f"no session {body.session_id!r}: create samplers through a ServiceClient",
                                field="session_id")
        if body.model_path is None and not body.base_model:
            raise BadRequestError("give a model_path (a sampler checkpoint) or a base_model", field="model_path")
        base_model, model_path = body.base_model, None
        if body.model_path is not None:
            record = self.catalog.find_readable(body.model_path, owner, field="model_path")
            model_path = record.path
            run = self.store.get_run(record.run_id)
            base_model = run.base_model if run is not None else base_model
        sampling_session_id = ids.sampler_id(body.session_id, body.sampling_session_seq_id)
        self.by_id[sampling_session_id] = Sampler(owner, str(base_model), model_path)
        self.store.add_sampling_session(sampling_session_id, owner, str(base_model), model_path)
        return m.SamplingSession(sampling_session_id, str(base_model), model_path)
