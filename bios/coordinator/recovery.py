"""What a restarted coordinator knows again: its live runs, sampling sessions and accepted requests, from SQLite.

A run's queue is rebuilt in seq_id order: requests that ran stay answered from the log, accepted ones are queued
again (prepared again, so a save keeps its name and a load its checkpoint), refused ones keep their seq_id used
up. A request that can no longer be prepared (its checkpoint was deleted meanwhile) fails alone.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from bios import messages as m
from bios import types as t
from bios.exceptions import BiosAPIError, RemoteError
from bios.transport.codec import Codec

from .admission import Admission, Sampler
from .runs import Queued, Run, from_stored_config
from .store import Store

log = logging.getLogger(__name__)


@dataclass
class Restored:
    runs: dict[str, Run] = field(default_factory=dict)
    samplers: dict[str, Sampler] = field(default_factory=dict)
    samples: list[Queued] = field(default_factory=list)
    steps: dict[str, int] = field(default_factory=dict)
    infos: dict[str, t.BaseModelInfo] = field(default_factory=dict)
    failed: list[tuple[str, m.Request, RemoteError]] = field(default_factory=list)  # request id, op, why


def restore(store: Store, codec: Codec, admission: Admission) -> Restored:
    state = Restored()
    for stored in store.live_runs():
        info = t.BaseModelInfo(**stored.info) if stored.info else None
        lora, optimizer = from_stored_config(stored.lora_config)
        run = Run(stored.model_id, stored.session_id, stored.owner, stored.base_model, lora, status=stored.status,
                  info=info, optimizer=optimizer)
        run.next_seq = store.last_run_seq(run.model_id) + 1
        for seq_id, request_id in store.rejected_seqs(run.model_id).items():
            if seq_id >= run.next_seq:
                run.enqueue(seq_id, Queued(request_id, None, rejected=True))
        state.runs[run.model_id] = run
        state.steps[run.model_id] = store.optimizer_steps(run.model_id)
        if info is not None:
            state.infos[run.base_model] = info
    for sampling_session_id, owner, base_model, model_path in store.sampling_sessions():
        state.samplers[sampling_session_id] = Sampler(owner, base_model, model_path)
    for pending in store.pending_requests():
        op = codec.decode(pending.payload).body
        try:
            queued = Queued(pending.request_id, _prepare(op, pending.target, state, admission))
        except BiosAPIError as exc:
            state.failed.append((pending.request_id, op, RemoteError.from_exception(exc)))
            continue
        if isinstance(op, m.Sample):
            state.samples.append(queued)
        else:
            state.runs[pending.target].enqueue(pending.seq_id, queued)
    if state.runs:
        log.info("restored %d run(s), %d sampling session(s) and %d accepted request(s) from the state dir",
                 len(state.runs), len(state.samplers),
                 sum(len(r.queue) for r in state.runs.values()) + len(state.samples))
    return state


def _prepare(op: m.Request, target: str, state: Restored, admission: Admission) -> m.Request:
    if isinstance(op, m.Sample):
        sampler = state.samplers[target]
        return dataclasses.replace(op, base_model=sampler.base_model, adapter_path=sampler.model_path,
                                   adapter_state=None)
    run = state.runs.get(target)
    if run is None:
        raise BiosAPIError(f"training run {target} is no longer live", field="model_id")
    if isinstance(op, m.CreateModel):  # the stored run has the seed chosen at creation
        loaded = admission.load_starting_state(op, run.owner) if op.from_path is not None else op
        return dataclasses.replace(loaded, base_model=run.base_model, lora=run.lora, optimizer=run.optimizer)
    return admission.prepare(op, run, run.owner, state.infos)
