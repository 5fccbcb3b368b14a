"""Ids of training runs, sampling sessions and requests: built and parsed here, nowhere else.

On the wire they are strings in Tinker's formats: a training run is `{session_id}:train:{n}`, a sampling
session `{session_id}:sample:{n}`, a request `{run or sampling session}#{seq_id}`. The coordinator's own
automatic checkpoints are `{run}#auto-{step}`: no client can send that id, so it never collides with theirs.
Ids are deterministic so a client knows its request's id before sending it, and a resubmission maps to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from bios.exceptions import BadRequestError


class Addressed(Protocol):
    """What a request id is built from (every `bios.messages.Request` has both)."""

    @property
    def target(self) -> str: ...

    @property
    def seq(self) -> int: ...

_KINDS = ("train", "sample")
_AUTO = "auto-"


@dataclass(frozen=True)
class ModelId:
    """A training run (`kind="train"`) or a sampling session (`kind="sample"`) of a client session."""

    session_id: str
    seq: int
    kind: str = "train"

    def __str__(self) -> str:
        return f"{self.session_id}:{self.kind}:{self.seq}"

    @classmethod
    def parse(cls, text: str, field: str = "model_id") -> ModelId:
        session_id, _, rest = text.rpartition(":")
        session_id, _, kind = session_id.rpartition(":")
        if not session_id or kind not in _KINDS or not rest.isdigit():
            raise BadRequestError(f"{text!r} is not a run or sampling session id "
                                  "('<session>:train:<n>' or '<session>:sample:<n>')", field=field)
        return cls(session_id, int(rest), kind)


def run_id(session_id: str, model_seq_id: int) -> str:
    return str(ModelId(session_id, model_seq_id, "train"))


def sampler_id(session_id: str, sampling_seq_id: int) -> str:
    return str(ModelId(session_id, sampling_seq_id, "sample"))


def session_of(model_id: str) -> str:
    """The client session that created a run or sampling session."""
    return ModelId.parse(model_id).session_id


@dataclass(frozen=True)
class RequestId:
    """Request `seq` of a run or sampling session (`target`); `automatic` for the coordinator's checkpoints."""

    target: str
    seq: int
    automatic: bool = False

    def __str__(self) -> str:
        return f"{self.target}#{_AUTO if self.automatic else ''}{self.seq}"

    @classmethod
    def parse(cls, text: str) -> RequestId:
        target, sep, seq = text.rpartition("#")
        automatic = seq.startswith(_AUTO)
        number = seq[len(_AUTO):] if automatic else seq
        if not sep or not target or not number.isdigit():
            raise BadRequestError(f"{text!r} is not a request id ('<run>#<seq_id>')", field="request_id")
        return cls(target, int(number), automatic)


def request_id(target: str, seq: int) -> str:
    return str(RequestId(target, seq))


def request_id_of(request: Addressed) -> str:
    """The id of a request a client submits: request `seq` of its `target` (a `CreateModel` is request 0 of the
    run it creates, a `Sample` a request of its sampling session)."""
    return request_id(request.target, request.seq)


def automatic_request_id(run: str, step: int) -> str:
    return str(RequestId(run, step, automatic=True))


def is_automatic(request: str) -> bool:
    return RequestId.parse(request).automatic


def target_of(request: str) -> str:
    """The run or sampling session a request belongs to."""
    return RequestId.parse(request).target
