"""`ServiceClient`: the entry point. Connects to a cluster, or starts an embedded one when given no address."""

from __future__ import annotations

import atexit
import itertools
import os
import threading
import time
import weakref
from types import TracebackType

from bios import ids
from bios import messages as m
from bios import types as t
from bios.account import check_user_metadata

from .connection import Connection
from .futures import APIFuture
from .local_cluster import LocalCluster
from .rest import RestClient
from .sampling import SamplingClient
from .training import TrainingClient

DEFAULT_BASE_MODEL = "bios/tiny-llama"


class ServiceClient:
    """`ServiceClient()` starts a local cluster; `ServiceClient(address="tcp://host:7600", api_key=...)` joins one.

    The address may also come from `BIOS_ADDRESS`, the key from `BIOS_API_KEY`. A wrong, revoked or missing key
    raises `AuthenticationError` here. Requests refused because a queue is full (`RateLimitError`) are resent
    after the coordinator's `retry_after`, up to 30 times, before the error reaches the caller.
    """

    def __init__(
        self,
        address: str | None = None,
        api_key: str | None = None,
        *,
        connect_timeout_s: float = 30.0,
        cluster: LocalCluster | None = None,
    ) -> None:
        address = address or os.environ.get("BIOS_ADDRESS") or None
        self._cluster: LocalCluster | None = None
        if address is None:
            self._cluster = cluster or LocalCluster()
            if self._cluster.coordinator is None:
                self._cluster.start()
            address = self._cluster.address
        self.address = address
        if self._cluster is None:  # BIOS_API_KEY is for remote clusters: an embedded one has no keys
            api_key = api_key or os.environ.get("BIOS_API_KEY") or None
        try:
            self._conn = Connection(address, api_key, connect_timeout_s=connect_timeout_s)
        except BaseException:
            if self._cluster is not None:
                self._cluster.stop()
            raise
        self._model_seq = itertools.count(0)
        self._sampler_seq = itertools.count(0)
        self._model_seq_lock = threading.Lock()
        self._closed = False
        atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def session_id(self) -> str:
        return self._conn.session_id

    # ------------------------------------------------------------------------------------ training runs

    def create_lora_training_client(
        self,
        base_model: str = DEFAULT_BASE_MODEL,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        *,
        train_vision: bool = False,
        optimizer: t.AdamOptimizerConfig | t.DimuonOptimizerConfig | None = None,
        user_metadata: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> TrainingClient:
        """Create a LoRA run on `base_model`; blocks until its adapter exists on the workers. `optimizer` is fixed
        for the run's lifetime (AdamW by default; `DimuonOptimizerConfig()`: its steps take `DimuonParams`).
        `train_vision` also trains a vision-language model's image encoder (its linear layers). `user_metadata`
        (string values) is kept with the run: `RestClient.get_training_run` returns it."""
        future = self._create(base_model, t.LoraConfig(rank, seed, train_unembed, train_mlp, train_attn, train_vision),
                              optimizer=_optimizer_name(optimizer), user_metadata=user_metadata)
        return self._training_client(future.result(timeout))

    async def create_lora_training_client_async(
        self,
        base_model: str = DEFAULT_BASE_MODEL,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        *,
        train_vision: bool = False,
        optimizer: t.AdamOptimizerConfig | t.DimuonOptimizerConfig | None = None,
        user_metadata: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> TrainingClient:
        future = self._create(base_model, t.LoraConfig(rank, seed, train_unembed, train_mlp, train_attn, train_vision),
                              optimizer=_optimizer_name(optimizer), user_metadata=user_metadata)
        return self._training_client(await future.result_async(timeout))

    def create_training_client_from_state(self, path: str, *,
                                          user_metadata: dict[str, str] | None = None) -> TrainingClient:
        """A new run starting from a checkpoint's adapter weights, with a fresh optimizer."""
        return self._training_client(self._create("", t.LoraConfig(), from_path=path,
                                                  user_metadata=user_metadata).result())

    def create_training_client_from_state_with_optimizer(self, path: str, *,
                                                         user_metadata: dict[str, str] | None = None
                                                         ) -> TrainingClient:
        """A new run that continues a `save_state` checkpoint exactly: weights, optimizer (its kind and state)."""
        return self._training_client(self._create("", t.LoraConfig(), from_path=path, with_optimizer=True,
                                                  user_metadata=user_metadata).result())

    async def create_training_client_from_state_async(self, path: str, *,
                                                      user_metadata: dict[str, str] | None = None) -> TrainingClient:
        return self._training_client(await self._create("", t.LoraConfig(), from_path=path,
                                                        user_metadata=user_metadata))

    async def create_training_client_from_state_with_optimizer_async(
            self, path: str, *, user_metadata: dict[str, str] | None = None) -> TrainingClient:
        return self._training_client(await self._create("", t.LoraConfig(), from_path=path, with_optimizer=True,
                                                        user_metadata=user_metadata))

    def _create(self, base_model: str, lora: t.LoraConfig, *, from_path: str | None = None,
                with_optimizer: bool = False, optimizer: t.OptimizerName = "adamw",
                user_metadata: dict[str, str] | None = None) -> APIFuture[m.ModelCreated]:
        metadata = check_user_metadata(user_metadata)
        with self._model_seq_lock:
            model_seq_id = next(self._model_seq)
            op = m.CreateModel(self.session_id, model_seq_id, base_model, lora, from_path, with_optimizer,
                               optimizer=optimizer, user_metadata=metadata)
            request_id = ids.request_id_of(op)
            accepted, result = self._conn.submit(op, request_id)
        return APIFuture(result, accepted, request_id)

    def _training_client(self, created: m.ModelCreated) -> TrainingClient:
        return TrainingClient(self._conn, created, created.info.name, self._sampling_client_for_path)

    # ------------------------------------------------------------------------------------ sampling, history

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None) -> SamplingClient:
        """Sample from a sampler checkpoint (`model_path`) or from a base model alone."""
        return SamplingClient(self._conn, self._conn.query(self._sampling_session(model_path, base_model)))

    async def create_sampling_client_async(self, model_path: str | None = None,
                                           base_model: str | None = None) -> SamplingClient:
        session = await self._conn.query_async(self._sampling_session(model_path, base_model))
        return SamplingClient(self._conn, session)

    def _sampling_session(self, model_path: str | None, base_model: str | None) -> m.CreateSamplingSession:
        with self._model_seq_lock:
            seq = next(self._sampler_seq)
        return m.CreateSamplingSession(self.session_id, seq, base_model, model_path)

    def _sampling_client_for_path(self, path: str) -> SamplingClient:
        return self.create_sampling_client(model_path=path)

    def create_rest_client(self) -> RestClient:
        return RestClient(self._conn)

    # ------------------------------------------------------------------------------------ cluster info

    def get_server_capabilities(self) -> t.GetServerCapabilitiesResponse:
        return self._conn.query(m.GetServerCapabilities())

    async def get_server_capabilities_async(self) -> t.GetServerCapabilitiesResponse:
        return await self._conn.query_async(m.GetServerCapabilities())

    def cluster_status(self) -> m.ClusterStatus:
        """Workers, generation, queue depth and the number of cycles run so far."""
        return self._conn.query(m.GetClusterStatus())

    async def cluster_status_async(self) -> m.ClusterStatus:
        return await self._conn.query_async(m.GetClusterStatus())

    def ping(self) -> float:
        """Seconds for an empty op to go SDK → coordinator → worker → SDK."""
        started = time.perf_counter()
        self._conn.query(m.Ping())
        return time.perf_counter() - started

    async def ping_async(self) -> float:
        started = time.perf_counter()
        await self._conn.query_async(m.Ping())
        return time.perf_counter() - started

    # ------------------------------------------------------------------------------------ closing

    def close(self) -> None:
        """End the session; stops the embedded cluster if this client started it."""
        if self._closed:
            return
        self._closed = True
        self._conn.close()
        if self._cluster is not None:
            self._cluster.stop()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()


def _close_at_exit(ref: weakref.ref[ServiceClient]) -> None:
    client = ref()
    if client is not None:
        client.close()


def _optimizer_name(config: t.AdamOptimizerConfig | t.DimuonOptimizerConfig | None) -> t.OptimizerName:
    if isinstance(config, t.DimuonOptimizerConfig):
        if config.version != 1:
            raise ValueError(f"DimuonOptimizerConfig version {config.version} is not one Bios runs (1)")
        return "dimuon"
    if config is None or isinstance(config, t.AdamOptimizerConfig):
        return "adamw"
    raise TypeError(f"optimizer must be AdamOptimizerConfig or DimuonOptimizerConfig, got {type(config).__name__}")
