"""`ServiceClient`: the entry point. Connects to a cluster, or starts an embedded one when given no address."""

from __future__ import annotations

import atexit
import itertools
import os
import threading
import time
import weakref
from types import TracebackType

from bios import messages as m
from bios import types as t

from .connection import Connection
from .futures import APIFuture
from .local_cluster import LocalCluster
from .training import TrainingClient

DEFAULT_BASE_MODEL = "bios/tiny-llama"


class ServiceClient:
    """`ServiceClient()` starts a local cluster; `ServiceClient(address="tcp://host:7600", api_key=...)` joins one.

    The address may also come from `BIOS_ADDRESS`, the key from `BIOS_API_KEY`.
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
        try:
            self._conn = Connection(address, api_key or os.environ.get("BIOS_API_KEY"),
                                    connect_timeout_s=connect_timeout_s)
        except BaseException:
            if self._cluster is not None:
                self._cluster.stop()
            raise
        self._model_seq = itertools.count(0)
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
        timeout: float | None = None,
    ) -> TrainingClient:
        """Create a LoRA run on `base_model`; blocks until its adapter exists on the workers."""
        future = self._create(base_model, t.LoraConfig(rank, seed, train_unembed, train_mlp, train_attn))
        return TrainingClient(self._conn, future.result(timeout), base_model)

    async def create_lora_training_client_async(
        self,
        base_model: str = DEFAULT_BASE_MODEL,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        *,
        timeout: float | None = None,
    ) -> TrainingClient:
        future = self._create(base_model, t.LoraConfig(rank, seed, train_unembed, train_mlp, train_attn))
        return TrainingClient(self._conn, await future.result_async(timeout), base_model)

    def _create(self, base_model: str, lora: t.LoraConfig) -> APIFuture[m.ModelCreated]:
        with self._model_seq_lock:
            model_seq_id = next(self._model_seq)
            op = m.CreateModel(self.session_id, model_seq_id, base_model, lora)
            request_id = f"{self.session_id}:train:{model_seq_id}#0"
            accepted, result = self._conn.submit(op, request_id)
        return APIFuture(result, accepted, request_id)

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
