"""The vocabulary between the SDK, the coordinator and the workers: plain data, the only thing those processes
share. It imports nothing of the plumbing (`bios.transport`, `bios.actors`); the codec over it is `bios.wire`.

- `client`: sessions, requests (`Request`) and their answers, between a client (SDK, gateway) and the coordinator;
- `queries`: plain asks with a direct reply (runs, checkpoints, metrics, the cluster's status);
- `worker`: registration, generations, cycles and their reports, between the coordinator and its workers.

Everyone writes `from bios import messages as m; m.ForwardBackward(...)`: every public name is re-exported here.
"""

from bios.exceptions import RemoteError

from .client import (
    PROTOCOL_VERSION, Hello, Welcome, SessionHeartbeat, CloseSession, Ack, CheckpointState, CreateModel,
    ForwardBackward, OptimStep, SaveWeights, LoadWeights, Sample, ReleaseSeq, Request, REQUEST_TYPES,
    FORWARD_TYPES, Accepted, RequestDone, Notice, SampleProgress, ModelCreated,
)
from .queries import (
    GetInfo, GetServerCapabilities, CreateSamplingSession, SamplingSession, GetSamplingSession, ListTrainingRuns,
    GetTrainingRun, ListCheckpoints, DeleteCheckpoint, FetchCheckpoint, GetTrainingRunMetrics, ListRunSummaries,
    MetricPoint, RunSummary, RunSummaries, TrainingRunMetrics, GetRunTrace, TracedRequest, RunTrace, Ping, Pong,
    GetClusterStatus, WorkerStatus, GroupStatus, ClusterStatus, StateDirSpace,
)
from .worker import (
    RegisterWorker, HeldCycle, WorkerAccepted, WorkerHeartbeat, WorkItem, RunCycle, AdapterSpec, ModelPlan,
    Reconfigure, Reconfigured, ItemDone, CycleDone, DiscoverWorkerEndpoint, WorkerEndpoint, Leaving, Shutdown,
    AbortGeneration, Rejoin, SavedState,
)

__all__ = [
    "PROTOCOL_VERSION", "Hello", "Welcome", "SessionHeartbeat", "CloseSession", "Ack", "CheckpointState",
    "CreateModel", "ForwardBackward", "OptimStep", "SaveWeights", "LoadWeights", "Sample", "ReleaseSeq", "Request",
    "REQUEST_TYPES", "FORWARD_TYPES", "Accepted", "RequestDone", "Notice", "SampleProgress", "ModelCreated",
    "GetInfo", "GetServerCapabilities", "CreateSamplingSession", "SamplingSession", "GetSamplingSession",
    "ListTrainingRuns", "GetTrainingRun", "ListCheckpoints", "DeleteCheckpoint", "FetchCheckpoint",
    "GetTrainingRunMetrics", "ListRunSummaries", "MetricPoint", "RunSummary", "RunSummaries", "TrainingRunMetrics",
    "GetRunTrace", "TracedRequest", "RunTrace", "Ping", "Pong", "GetClusterStatus", "WorkerStatus", "GroupStatus",
    "ClusterStatus", "StateDirSpace", "RegisterWorker", "HeldCycle", "WorkerAccepted", "WorkerHeartbeat",
    "WorkItem", "RunCycle", "AdapterSpec", "ModelPlan", "Reconfigure", "Reconfigured", "ItemDone", "CycleDone",
    "DiscoverWorkerEndpoint", "WorkerEndpoint", "Leaving", "Shutdown", "AbortGeneration", "Rejoin", "SavedState",
    "RemoteError",
]
