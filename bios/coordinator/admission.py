"""Admission: ownership, the request spec and quotas, decided before anything changes.

`Admission.admit` returns a verdict and changes nothing; the scheduler, which owns request state, acts on it.
A request that breaks a rule of `bios.spec` is `Refused` with the `BadRequestError` naming the field, so a
tenant's bad request never reaches a worker, where it would share a batch with other tenants' requests.
Errors raised instead of returned (unknown run, reused seq_id, rate limits) leave no record at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from bios import ids, images, spec
from bios import messages as m
from bios import types as t
from bios.account import check_user_metadata
from bios.checkpoint_path import CheckpointPath, check_name
from bios.exceptions import BadRequestError, BiosAPIError, NotFoundError
from bios.models.memory_plan import model_shape
from bios.models.registry import model_vision
from bios.security.limits import QuotaLedger

from .catalog import Catalog
from .planning import PlanChoice, PoolPlanner
from .runs import Run
from .store import Store, StoredRequest


@dataclass(frozen=True)
class Submit:
    """A request as it reached the front door: who sent it, for whom, and its encoded frames (stored as is)."""

    peer: bytes
    owner: str
    op: m.Request
    frames: list[bytes]

    @property
    def nbytes(self) -> int:
        return sum(len(f) for f in self.frames)


@dataclass(frozen=True)
class Fresh:
    """Accept: store, queue and answer `op` (prepared: names filled in, checkpoints loaded)."""

    request_id: str
    target: str  # the run or sampling session
    seq_id: int
    op: m.Request
    plan: PlanChoice | None = None  # a new run's base-model plan, to adopt with it


@dataclass(frozen=True)
class Repeat:
    """A resubmitted (target, seq_id): answered from the request log, never run twice."""

    stored: StoredRequest


@dataclass(frozen=True)
class Refused:
    """Reject with `error`; the seq_id is used up (`consumes_seq`) so the run's queue moves past it."""

    request_id: str
    target: str
    seq_id: int
    op: m.Request
    error: BiosAPIError
    consumes_seq: bool


Verdict = Fresh | Repeat | Refused


@dataclass(frozen=True)
class Sampler:
    owner: str
    base_model: str
    model_path: str | None


class Admission:
    def __init__(self, store: Store, catalog: Catalog, ledger: QuotaLedger, planner: PoolPlanner) -> None:
        self.store = store
        self.catalog = catalog
        self.ledger = ledger
        self.planner = planner

    def admit(self, sub: Submit, runs: Mapping[str, Run], samplers: Mapping[str, Sampler],
              infos: Mapping[str, t.BaseModelInfo]) -> Verdict:
        if isinstance(sub.op, m.Sample):
            return self._admit_sample(sub, samplers, infos)
        op = sub.op
        create = isinstance(op, m.CreateModel)
        model_id, seq_id, request_id = op.target, op.seq, ids.request_id_of(op)
        self._check_owner(model_id, sub.owner, runs)
        stored = self.store.get_request(request_id)
        if stored is not None:
            return Repeat(stored)
        if create:
            self.ledger.check(sub.owner, nbytes=sub.nbytes, sampling=False)
            try:
                op, plan = self._prepare_run(model_id, op, sub.owner, runs)
            except BadRequestError as exc:
                return Refused(request_id, model_id, seq_id, op, exc, consumes_seq=False)
            return Fresh(request_id, model_id, seq_id, op, plan)
        run = run_for(runs, model_id, sub.owner)
        if seq_id < run.next_seq or seq_id in run.queue:
            raise BadRequestError(f"seq_id {seq_id} of {model_id} was already used; the next free one is "
                                  f"{max([run.next_seq, *run.queue]) + 1}", field="seq_id")
        if seq_id != run.next_seq:  # a run's next request always gets in: later ones, accepted while it was
            self.ledger.check(sub.owner, nbytes=sub.nbytes, sampling=False)  # refused, must not keep it out
        try:
            op = self.prepare(op, run, sub.owner, infos)
        except BiosAPIError as exc:
            return Refused(request_id, model_id, seq_id, op, exc, consumes_seq=True)
        return Fresh(request_id, model_id, seq_id, op)

    # ------------------------------------------------------------------------------------ sampling

    def _admit_sample(self, sub: Submit, samplers: Mapping[str, Sampler],
                      infos: Mapping[str, t.BaseModelInfo]) -> Verdict:
        op: m.Sample = sub.op
        request_id = ids.request_id_of(op)
        sampler = samplers.get(op.sampling_session_id)
        known = (sampler.owner,) if sampler is not None else self.store.get_sampling_session(op.sampling_session_id)
        if known is not None and known[0] != sub.owner:
            raise _no_sampler(op.sampling_session_id)
        stored = self.store.get_request(request_id)
        if stored is not None:
            return Repeat(stored)
        if sampler is None or sampler.owner != sub.owner:
            raise _no_sampler(op.sampling_session_id)
        self.ledger.check(sub.owner, nbytes=sub.nbytes, sampling=True)
        try:
            op = dataclasses.replace(op, prompt=_read_images(op.prompt, "prompt"))
            limits = self.limits(sampler.base_model, infos)
            spec.check_sample(op.prompt, op.num_samples, op.sampling_params, limits,
                              topk_prompt_logprobs=op.topk_prompt_logprobs,
                              prompt_alt_tokens_k=op.prompt_alt_tokens_k,
                              topk_sample_logprobs=op.topk_sample_logprobs,
                              target_prompt_logprobs=op.target_prompt_logprobs)
            positions = sample_positions(op, limits)
            self.planner.check_sample(sampler.base_model, op.prompt.length, positions - op.prompt.length,
                                      op.num_samples)
            max_tokens = op.sampling_params.max_tokens or 1
            self.ledger.check_tokens(op.num_samples * (op.prompt.length + max_tokens), "sampling_params.max_tokens")
        except BiosAPIError as exc:
            return Refused(request_id, op.sampling_session_id, op.seq_id, op, exc, consumes_seq=False)
        # only the coordinator names the weights a sample uses: a client's adapter_state never reaches a worker
        op = dataclasses.replace(op, base_model=sampler.base_model, adapter_path=sampler.model_path,
                                 adapter_state=None)
        return Fresh(request_id, op.sampling_session_id, op.seq_id, op)

    # ------------------------------------------------------------------------------------ runs

    def _check_owner(self, model_id: str, owner: str, runs: Mapping[str, Run]) -> None:
        """NotFoundError for a run of another key, before anything (even a stored result) is revealed about it."""
        run = runs.get(model_id)
        if run is not None:
            stored_owner = run.owner
        else:
            stored = self.store.get_run(model_id)
            stored_owner = stored.owner if stored is not None else self._session_owner(model_id, owner)
        if stored_owner != owner:
            raise _no_run(model_id)

    def _session_owner(self, model_id: str, default: str) -> str:
        """Who may see the log of a run id with no run (a creation that was refused): its session's owner."""
        try:
            session_id = ids.session_of(model_id)
        except BadRequestError:
            return default
        return self.store.session_owner(session_id) or default

    def _prepare_run(self, model_id: str, op: m.CreateModel, owner: str,
                     runs: Mapping[str, Run]) -> tuple[m.CreateModel, PlanChoice]:
        if self.store.session_owner(op.session_id) != owner:
            raise NotFoundError(f"no session {op.session_id!r}: create runs through a ServiceClient",
                                field="session_id")
        if model_id in runs:
            raise BadRequestError(f"model {model_id} already exists", field="model_seq_id")
        op = self.load_starting_state(op, owner)
        check_user_metadata(op.user_metadata)
        spec.check_lora(op.lora)
        spec.check_optimizer(op.optimizer)
        if not isinstance(op.base_model, str) or not op.base_model:
            raise BadRequestError("base_model is empty: name a model (see `bios models list`)", field="base_model")
        if op.lora.seed is None:  # one seed for every replica, so they agree from the first step
            op = dataclasses.replace(op, lora=dataclasses.replace(op.lora, seed=secrets.randbits(63)))
        same_base = sum(1 for run in runs.values() if run.base_model == op.base_model)
        return op, self.planner.choose(op.base_model, op.lora, adapters=same_base)

    def load_starting_state(self, op: m.CreateModel, owner: str) -> m.CreateModel:
        """A run created from a checkpoint takes its weights, LoRA shape and base model from it; starting
        weights come from the caller's own checkpoints only."""
        if op.from_path is None:
            return op if op.state is None else dataclasses.replace(op, state=None)
        state = self.catalog.load(op.from_path, owner, field="path")
        meta = state.metadata
        lora = t.LoraConfig(rank=int(meta["rank"]), seed=meta.get("seed"),
                            train_unembed=bool(meta.get("train_unembed", True)),
                            train_mlp=bool(meta.get("train_mlp", True)),
                            train_attn=bool(meta.get("train_attn", True)),
                            train_vision=bool(meta.get("train_vision", False)))
        optimizer = meta.get("optimizer", "adamw") if op.with_optimizer else op.optimizer  # its state decides
        return dataclasses.replace(op, base_model=op.base_model or str(meta["base_model"]), lora=lora, state=state,
                                   optimizer=optimizer)

    def prepare(self, op: m.Request, run: Run, owner: str, infos: Mapping[str, t.BaseModelInfo]) -> m.Request:
        """Check a request against the spec and its run; fill in what only the coordinator knows (the same
        way every time: a restarted coordinator prepares its accepted requests again)."""
        if isinstance(op, m.ReleaseSeq):  # the one way to use up a seq_id without running anything
            raise BadRequestError(f"seq_id {op.seq_id} of {run.model_id} was given up: {op.reason}", field="seq_id")
        if isinstance(op, m.ForwardBackward):
            data = [dataclasses.replace(datum, model_input=_read_images(datum.model_input, f"data[{i}].model_input"))
                    for i, datum in enumerate(op.data)]
            spec.check_forward(data, op.loss_fn, op.loss_fn_config, run.info or self.limits(run.base_model, infos),
                               op.custom_loss)
            op = dataclasses.replace(op, data=data)
            self.planner.check_rows(run.base_model, op)
            self.ledger.check_tokens(sum(datum.model_input.length for datum in data), "data")
            return op
        elif isinstance(op, m.OptimStep):
            spec.check_optim_params(op.adam_params, run.optimizer)
        elif isinstance(op, m.SaveWeights):
            name = op.name if op.name is not None else f"{op.seq_id:06d}-{_digest(run.model_id)}"
            check_name(name)
            check_user_metadata(op.user_metadata)
            path = CheckpointPath(run.model_id, op.kind, name)
            self.catalog.check_free(path, overwrite=op.overwrite or op.kind == "sampler_weights")
            return dataclasses.replace(op, name=name, path=str(path))
        elif isinstance(op, m.LoadWeights):
            state = self.catalog.load(op.path, owner)
            if state.metadata.get("base_model") != run.base_model:
                raise BadRequestError(f"checkpoint {op.path} is for base model {state.metadata.get('base_model')}, "
                                      f"but run {run.model_id} trains {run.base_model}", field="path")
            if op.optimizer and state.optimizer is None:
                raise BadRequestError(f"{op.path} holds no optimizer state (it is a sampler checkpoint); "
                                      "use load_state instead", field="path")
            if op.optimizer and state.metadata.get("optimizer", "adamw") != run.optimizer:
                raise BadRequestError(f"{op.path} holds {state.metadata.get('optimizer', 'adamw')} optimizer state, "
                                      f"but run {run.model_id} trains with {run.optimizer}: use load_state",
                                      field="path")
            return dataclasses.replace(op, state=state)
        return op

    def limits(self, base_model: str, infos: Mapping[str, t.BaseModelInfo]) -> spec.ModelLimits | None:
        """A base model's vocabulary and context: as a worker reported them, else from its config.json here."""
        return infos.get(base_model) or _config_limits(base_model)


def sample_positions(op: m.Sample, limits: spec.ModelLimits | None) -> int:
    """The positions each row of a sample holds in the key/value cache: its prompt and the new tokens it may
    add (`spec.resolved_max_tokens`)."""
    context = limits.max_context_length if limits is not None else None
    return op.prompt.length + spec.resolved_max_tokens(op.prompt.length, op.sampling_params, context)


def _read_images(model_input: t.ModelInput, where: str) -> t.ModelInput:
    """Image pointers read from this host's disk, so workers receive image bytes only."""
    try:
        return images.read_pointers(model_input, where)
    except images.ImageError as exc:
        raise BadRequestError(str(exc), field=where) from None


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=4).hexdigest()


@lru_cache(maxsize=64)
def _config_limits(base_model: str) -> spec.Limits | None:
    try:
        shape = model_shape(base_model)
    except BadRequestError:  # a config the planner cannot read: the workers check it, item by item
        return None
    if shape is None or shape.max_context_length is None:
        return None
    try:
        vision = model_vision(base_model)
    except (ValueError, NotImplementedError) as exc:
        raise BadRequestError(f"base model {base_model}: {exc}", field="base_model") from None
    return spec.Limits(base_model, shape.vocab_size, int(shape.max_context_length), vision)


def run_for(runs: Mapping[str, Run], model_id: str, owner: str | None) -> Run:
    """The caller's live run `model_id`; NotFoundError for none or another key's, BadRequestError if lost."""
    run = runs.get(model_id)
    if run is None or (owner is not None and run.owner != owner):
        raise _no_run(model_id)
    if run.status == "lost":
        raise BadRequestError(f"training run {model_id} was lost: {run.lost_reason}", field="model_id")
    return run


def _no_run(model_id: str) -> NotFoundError:
    return NotFoundError(f"no training run {model_id!r}; create one with create_lora_training_client",
                         field="model_id")


def _no_sampler(sampling_session_id: str) -> NotFoundError:
    return NotFoundError(f"no sampling session {sampling_session_id!r}; create one with create_sampling_client",
                         field="sampling_session_id")
