"""`TrainingClient`: one LoRA training run. Every method returns at once; results come through `APIFuture`s.

Request order is fixed when a method is *called*: each call takes the next `seq_id`, and the coordinator runs
a run's requests strictly in that order, however they travel.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bios import ids
from bios import messages as m
from bios import types as t
from bios.account import check_user_metadata

from .futures import APIFuture

if TYPE_CHECKING:
    from .connection import Connection
    from .sampling import SamplingClient

CustomLoss = Callable[[list[t.Datum], list[Any]], tuple[Any, dict[str, float]]]
_CUSTOM_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="bios-custom-loss")


def _targets_only(datum: t.Datum) -> t.Datum:
    """What the forward pass of a custom loss needs: the tokens, the targets, and (zero) weights."""
    targets = datum.loss_fn_inputs["target_tokens"]
    weights = t.TensorData([0.0] * len(targets), "float32")
    return t.Datum(datum.model_input, {"target_tokens": targets, "weights": weights})


class TrainingClient:
    def __init__(self, connection: Connection, created: m.ModelCreated, base_model: str,
                 sampler_factory: Callable[[str], SamplingClient]) -> None:
        self._conn = connection
        self._sampler_factory = sampler_factory
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
            request_id = ids.request_id_of(op)
            accepted, result = self._conn.submit(op, request_id)
        return APIFuture(result, accepted, request_id)

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
        self, data: Sequence[t.Datum], loss_fn: str = "cross_entropy", loss_fn_config: Mapping[str, float] | None = None,
        *, custom_loss: t.CustomLoss | None = None,
    ) -> APIFuture[t.ForwardBackwardOutput]:
        """Accumulate the gradient of the summed loss over `data`; applied by the next `optim_step`.
        `loss_fn="custom"` runs `custom_loss` (a traced graph, see `bios.custom_loss`) on the workers."""
        return self._forward(data, loss_fn, loss_fn_config, forward_only=False, custom_loss=custom_loss)

    def _forward(
        self, data: Sequence[t.Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None, *, forward_only: bool,
        custom_loss: t.CustomLoss | None = None,
    ) -> APIFuture[t.ForwardBackwardOutput]:
        batch = list(data)
        config = dict(loss_fn_config) if loss_fn_config is not None else None
        return self._request(
            lambda seq: m.ForwardBackward(self.model_id, seq, batch, loss_fn, config, forward_only, custom_loss)
        )

    def optim_step(
        self, adam_params: t.AdamParams | t.DimuonParams | None = None
    ) -> APIFuture[t.OptimStepResponse]:
        """Apply the accumulated gradient with the run's optimizer, then clear it: `AdamParams` (default
        `AdamParams()`) for AdamW, `DimuonParams` for a run created with `DimuonOptimizerConfig`."""
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

    async def optim_step_async(
        self, adam_params: t.AdamParams | t.DimuonParams | None = None
    ) -> APIFuture[t.OptimStepResponse]:
        return await self._accepted(self.optim_step(adam_params))

    def forward_backward_custom(
        self, data: Sequence[t.Datum], loss_fn: CustomLoss
    ) -> APIFuture[t.ForwardBackwardOutput]:
        """Train on any differentiable function of the per-token logprobs, computed here on the client.

        `loss_fn(data, logprobs) -> (loss, metrics)` gets one torch tensor of logprobs per datum. Bios runs a
        forward pass, evaluates `loss_fn` and its gradient here, then a cross-entropy backward whose weights are
        -dloss/dlogprobs, which gives the gradient of `loss`. Metrics: the custom `loss:sum`, the server's
        surrogate as `surrogate_loss:sum`, and the user's own.
        """
        batch = list(data)
        stripped = [_targets_only(d) for d in batch]
        with self._seq_lock:
            first = next(self._seq)
            second = next(self._seq)
            fwd_op = m.ForwardBackward(self.model_id, first, stripped, "cross_entropy", None, True)
            accepted, forward = self._conn.submit(fwd_op, ids.request_id_of(fwd_op))
        result: concurrent.futures.Future[t.ForwardBackwardOutput] = concurrent.futures.Future()
        forward.add_done_callback(lambda f: _CUSTOM_POOL.submit(self._custom_backward, f, batch, stripped,
                                                                loss_fn, second, result))
        return APIFuture(result, accepted, ids.request_id(self.model_id, second))

    def _custom_backward(self, forward: concurrent.futures.Future[t.ForwardBackwardOutput], batch: list[t.Datum],
                         stripped: list[t.Datum], loss_fn: CustomLoss, seq_id: int,
                         result: concurrent.futures.Future[t.ForwardBackwardOutput]) -> None:
        request_id = ids.request_id(self.model_id, seq_id)
        try:
            import torch

            logprobs = [r["logprobs"].to_torch().clone().requires_grad_(True)
                        for r in forward.result().loss_fn_outputs]
            loss, metrics = loss_fn(batch, logprobs)
            loss.backward()
            weighted = [
                t.Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"],
                                        "weights": t.TensorData.from_torch(-lp.grad if lp.grad is not None
                                                                           else torch.zeros_like(lp))})
                for d, lp in zip(stripped, logprobs, strict=True)
            ]
            op = m.ForwardBackward(self.model_id, seq_id, weighted, "cross_entropy", None, False)
        except BaseException as exc:
            # Keep the run's order moving: the reserved seq_id is given up.
            accepted, _ = self._conn.submit(m.ReleaseSeq(self.model_id, seq_id, f"the custom loss raised {exc!r}"),
                                            request_id)
            accepted.add_done_callback(lambda f: f.exception())  # refused by design: that uses the seq_id up
            result.set_exception(exc)
            return
        _, backward = self._conn.submit(op, request_id)
        try:
            out = backward.result()
        except BaseException as exc:
            result.set_exception(exc)
            return
        combined = {k: float(v) for k, v in (metrics or {}).items()}
        combined["surrogate_loss:sum"] = out.metrics["loss:sum"]
        combined["loss:sum"] = float(loss.detach())
        if "grad_norm:max" in out.metrics:
            combined["grad_norm:max"] = out.metrics["grad_norm:max"]
        result.set_result(t.ForwardBackwardOutput(out.loss_fn_output_type, forward.result().loss_fn_outputs,
                                                  combined))

    async def forward_backward_custom_async(
        self, data: Sequence[t.Datum], loss_fn: CustomLoss
    ) -> APIFuture[t.ForwardBackwardOutput]:
        return await self._accepted(self.forward_backward_custom(data, loss_fn))

    # ------------------------------------------------------------------------------------ checkpoints

    def save_state(self, name: str | None = None, *, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None) -> APIFuture[t.SaveWeightsResponse]:
        """Adapter and optimizer state at `bios://<run>/weights/<name>`; resumable exactly. `user_metadata` (string
        values) is kept with the checkpoint and listed with it."""
        metadata = check_user_metadata(user_metadata)
        return self._request(lambda seq: m.SaveWeights(self.model_id, seq, name, "weights", overwrite,
                                                       user_metadata=metadata))

    async def save_state_async(self, name: str | None = None, *, overwrite: bool = False,
                               user_metadata: dict[str, str] | None = None) -> APIFuture[t.SaveWeightsResponse]:
        return await self._accepted(self.save_state(name, overwrite=overwrite, user_metadata=user_metadata))

    def save_weights_for_sampler(self, name: str | None = None, *, user_metadata: dict[str, str] | None = None
                                 ) -> APIFuture[t.SaveWeightsForSamplerResponse]:
        """The adapter alone at `bios://<run>/sampler_weights/<name>`, for SamplingClients and export.
        `user_metadata` (string values) is kept with the checkpoint and listed with it."""
        metadata = check_user_metadata(user_metadata)
        return self._request(lambda seq: m.SaveWeights(self.model_id, seq, name, "sampler_weights",
                                                       user_metadata=metadata))

    async def save_weights_for_sampler_async(self, name: str | None = None, *,
                                             user_metadata: dict[str, str] | None = None
                                             ) -> APIFuture[t.SaveWeightsForSamplerResponse]:
        return await self._accepted(self.save_weights_for_sampler(name, user_metadata=user_metadata))

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplingClient:
        """Snapshot the current adapter and return a SamplingClient on it."""
        return self._sampler_factory(self.save_weights_for_sampler(name).result().path)

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None) -> SamplingClient:
        saved = await self.save_weights_for_sampler(name)
        return self._sampler_factory(saved.path)

    def create_sampling_client(self, model_path: str) -> SamplingClient:
        return self._sampler_factory(model_path)

    def load_state(self, path: str) -> APIFuture[t.LoadWeightsResponse]:
        """Load a checkpoint's adapter weights; the optimizer starts afresh (Adam moments zero, step 0)."""
        return self._request(lambda seq: m.LoadWeights(self.model_id, seq, path, optimizer=False))

    async def load_state_async(self, path: str) -> APIFuture[t.LoadWeightsResponse]:
        return await self._accepted(self.load_state(path))

    def load_state_with_optimizer(self, path: str) -> APIFuture[t.LoadWeightsResponse]:
        """Load adapter and optimizer state: training continues exactly as if never interrupted."""
        return self._request(lambda seq: m.LoadWeights(self.model_id, seq, path, optimizer=True))

    async def load_state_with_optimizer_async(self, path: str) -> APIFuture[t.LoadWeightsResponse]:
        return await self._accepted(self.load_state_with_optimizer(path))

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
