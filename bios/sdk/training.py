"""`TrainingClient`: one LoRA training run. Every method returns at once; results come through `APIFuture`s.

Request order is fixed when a method is *called*: each call takes the next `seq_id`, and the coordinator runs
a run's requests strictly in that order, however they travel.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bios import messages as m
from bios import types as t

from .futures import APIFuture

if TYPE_CHECKING:
    from .connection import Connection


class TrainingClient:
    def __init__(self, connection: Connection, created: m.ModelCreated, base_model: str) -> None:
        self._conn = connection
        self.model_id = created.model_id
        self.base_model = base_model
        self._created = created
        self._seq = itertools.count(1)
        self._seq_lock = threading.Lock()
        self._tokenizer: Any = None

    def _request(self, build: Any) -> APIFuture[Any]:
        with self._seq_lock:
            seq_id = next(self._seq)
            op = build(seq_id)
            accepted, result = self._conn.submit(op, f"{self.model_id}#{seq_id}")
        return APIFuture(result, accepted, f"{self.model_id}#{seq_id}")

    async def _accepted(self, future: APIFuture[Any]) -> APIFuture[Any]:
        await future.accepted_async()
        return future

    # ------------------------------------------------------------------------------------ training

    def forward(
        self, data: Sequence[t.Datum], loss_fn: str = "cross_entropy", loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture[t.ForwardBackwardOutput]:
        """Log-probabilities and loss without gradients."""
        return self._forward(data, loss_fn, loss_fn_config, forward_only=True)

    def forward_backward(
        self, data: Sequence[t.Datum], loss_fn: str = "cross_entropy", loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture[t.ForwardBackwardOutput]:
        """Accumulate the gradient of the summed loss over `data`; applied by the next `optim_step`."""
        return self._forward(data, loss_fn, loss_fn_config, forward_only=False)

    def _forward(
        self, data: Sequence[t.Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None, *, forward_only: bool
    ) -> APIFuture[t.ForwardBackwardOutput]:
        batch = list(data)
        config = dict(loss_fn_config) if loss_fn_config is not None else None
        return self._request(
            lambda seq: m.ForwardBackward(self.model_id, seq, batch, loss_fn, config, forward_only)
        )

    def optim_step(self, adam_params: t.AdamParams | None = None) -> APIFuture[t.OptimStepResponse]:
        """Apply the accumulated gradient with AdamW (defaults: `AdamParams()`), then clear it."""
        params = adam_params if adam_params is not None else t.AdamParams()
        return self._request(lambda seq: m.OptimStep(self.model_id, seq, params))

    async def forward_async(
        self, data: Sequence[t.Datum], loss_fn: str = "cross_entropy", loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture[t.ForwardBackwardOutput]:
        return await self._accepted(self.forward(data, loss_fn, loss_fn_config))

    async def forward_backward_async(
        self, data: Sequence[t.Datum], loss_fn: str = "cross_entropy", loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture[t.ForwardBackwardOutput]:
        """First await: accepted and ordered. Await the returned future for the result."""
        return await self._accepted(self.forward_backward(data, loss_fn, loss_fn_config))

    async def optim_step_async(self, adam_params: t.AdamParams | None = None) -> APIFuture[t.OptimStepResponse]:
        return await self._accepted(self.optim_step(adam_params))

    # ------------------------------------------------------------------------------------ info

    def get_info(self) -> t.GetInfoResponse:
        return self._conn.query(m.GetInfo(self.model_id))

    async def get_info_async(self) -> t.GetInfoResponse:
        return await self._conn.query_async(m.GetInfo(self.model_id))

    @property
    def base_model_info(self) -> t.BaseModelInfo:
        return self._created.info

    def get_tokenizer(self) -> Any:
        """The base model's Hugging Face tokenizer, loaded from the model's local directory."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            local_dir = self._created.info.local_dir
            if not os.path.isdir(local_dir):
                raise FileNotFoundError(
                    f"the tokenizer of {self.base_model} lives in {local_dir} on the workers, which is not on this "
                    f"machine; run `bios models path {self.base_model}` here to create or pull it"
                )
            self._tokenizer = AutoTokenizer.from_pretrained(local_dir)
        return self._tokenizer

    async def get_tokenizer_async(self) -> Any:
        return self.get_tokenizer()

    def __repr__(self) -> str:
        return f"<TrainingClient {self.model_id} on {self.base_model}>"
