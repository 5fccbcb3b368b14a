"""Messages between the coordinator and its workers: registration, heartbeats, generations, cycles and their
reports. A cycle carries `WorkItem`s: the clients' requests (`bios.messages.client.Request`) with their ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bios import cluster_defaults
from bios import types as t
from bios.exceptions import RemoteError

from .client import CheckpointState, Request


@dataclass(frozen=True)
class RegisterWorker:
    worker_id: str
    host: str
    pid: int
    device: str
    memory_bytes: int
    token: str | None = None
    models: list[str] = field(default_factory=list)
    store_host: str = "127.0.0.1"
    store_port: int = 0
    runtime_bytes: int = 0  # the worker process's own footprint before any model (measured; 0: unknown)
    holdings: dict[str, float] = field(default_factory=dict)  # adapters it still holds (registering again): checksums
    last_cycle: HeldCycle | None = None  # the last cycle it committed, for a coordinator that never heard its end


@dataclass(frozen=True)
class HeldCycle:
    """What a worker keeps of the last cycle it committed: each adapter's checksum before it, and the results it
    reported. A restarted coordinator whose log stops just before this cycle records these results instead of
    running the cycle again."""

    cycle_id: int
    before: dict[str, float]
    results: list[ItemDone]


@dataclass(frozen=True)
class WorkerAccepted:
    heartbeat_interval_s: float


@dataclass(frozen=True)
class WorkerHeartbeat:
    worker_id: str


@dataclass(frozen=True)
class WorkItem:
    """A request of a cycle. `part` (rows before these, rows in all): the op holds only some rows of a forward
    request cut over several cycles (`bios.coordinator.cycle_share`); until its last part the gradient stays
    pending on the workers (nothing is summed or committed) and nothing is reported, and the last part reports the
    whole request's output."""

    request_id: str
    op: Request
    part: tuple[int, int] | None = None

    @property
    def last_part(self) -> bool:
        """Whether this item ends its request (always, unless it is a part that more cycles continue)."""
        return self.part is None or self.part[0] + len(self.op.data) >= self.part[1]


@dataclass(frozen=True)
class RunCycle:
    """One cycle's work. Every member gets the same training items (each takes its own data shard and runs
    the replicated ops); sample items are dealt out, so each member gets its own."""

    cycle_id: int
    generation: int
    items: list[WorkItem]


@dataclass(frozen=True)
class AdapterSpec:
    model_id: str
    base_model: str
    lora: t.LoraConfig
    optimizer: t.OptimizerName = "adamw"


@dataclass(frozen=True)
class ModelPlan:
    """How workers hold one base model: its memory plan (bios.models.memory_plan.Plan) as plain data."""

    base_model: str
    activation_checkpointing: bool = False
    tokens_per_pass: int = 16384  # the per-pass token budget the plan was sized for


@dataclass(frozen=True)
class Reconfigure:
    """Form generation `generation`: rebuild the collective group, then take every adapter's state from rank 0
    by broadcast (newcomers create the adapters first). Adapters in `restore` come from a checkpoint instead:
    the pool that held them is gone.

    With `tp` > 1 the members form `world // tp` replicas of `tp` tensor-parallel shard holders (rank r is shard
    r % tp of replica r // tp) and every base model is split that way. `source_tp` is how the state's holders
    hold it: 1, whole on rank 0 (broadcast to everyone, each member keeps its slice); equal to `tp`, shard j on
    rank j (broadcast to the other replicas' rank-j members); another size k, shard j on rank j < k (put together
    on rank 0, then as for 1). An adapter in `sources` comes whole from that
    replica instead: a member that held it in another group (its base model moved here with that member)."""

    generation: int
    rank: int
    world: int
    master_host: str
    master_port: int
    timeout_s: float
    adapters: list[AdapterSpec]
    restore: dict[str, CheckpointState] = field(default_factory=dict)
    tp: int = 1
    source_tp: int = 1
    plans: list[ModelPlan] = field(default_factory=list)
    epoch: str = ""  # the coordinator's incarnation: its generations' rendezvous keys are its own
    # How long a collective may wait for a peer that is alive but busier (`timeout_s` bounds joining only).
    collective_timeout_s: float = cluster_defaults.COLLECTIVE_TIMEOUT_S
    sources: dict[str, int] = field(default_factory=dict)  # adapter -> the replica it comes from (else replica 0)


@dataclass(frozen=True)
class Reconfigured:
    generation: int
    worker_id: str
    checksums: dict[str, float]
    error: str | None = None


@dataclass(frozen=True)
class ItemDone:
    cycle_id: int
    request_id: str
    result: Any = None
    error: RemoteError | None = None


@dataclass(frozen=True)
class CycleDone:
    """A member finished its part of a cycle. `aborted`: a collective failed, nothing uncommitted was kept."""

    cycle_id: int
    worker_id: str
    aborted: bool = False
    reason: str = ""
    checksums: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # time per phase: forward, allreduce, closing, sample


@dataclass(frozen=True)
class DiscoverWorkerEndpoint:
    """Sent by a worker to the client address it was given, to learn where workers connect."""


@dataclass(frozen=True)
class WorkerEndpoint:
    port: int


@dataclass(frozen=True)
class Leaving:
    """A worker asks to leave gracefully: it finishes its current cycle and exits when told (`Shutdown`)."""

    worker_id: str
    reason: str = ""


@dataclass(frozen=True)
class Shutdown:
    reason: str = ""


@dataclass(frozen=True)
class AbortGeneration:
    """The coordinator gave up on generation `generation` of its incarnation `epoch` (a member died, hangs or was
    cut off; another aborted): every collective of it ends now on the receiver, which reports its cycle aborted
    or its joining failed, instead of waiting out the collective timeout."""

    epoch: str
    generation: int
    reason: str = ""


@dataclass(frozen=True)
class Rejoin:
    """The coordinator does not count the sender as a member (it was declared dead, say after heartbeats went
    missing on a starved machine): the worker registers again, as a new member that receives the current state."""

    reason: str = ""


@dataclass(frozen=True)
class SavedState:
    """A worker's answer to SaveWeights: the tensors for the coordinator's checkpoint store."""

    state: CheckpointState
