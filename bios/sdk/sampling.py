"""`SamplingClient`: generation from a base model, alone or with a saved adapter.

Samples queued at one tick run as one batch on the workers, rows of different adapters together, so many
concurrent `sample` calls (e.g. `asyncio.gather` over an eval set) cost little more than one.
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING, Any

from bios import ids
from bios import messages as m
from bios import types as t

from .futures import APIFuture

if TYPE_CHECKING:
    from .connection import Connection


class SamplingClient:
    def __init__(self, connection: Connection, session: m.SamplingSession) -> None:
        self._conn = connection
        self.sampling_session_id = session.sampling_session_id
        self.base_model = session.base_model
        self.model_path = session.model_path
        self._seq = itertools.count(0)
        self._lock = threading.Lock()
        self._tokenizer: Any = None

    def sample(
        self,
        prompt: t.ModelInput,
        num_samples: int = 1,
        sampling_params: t.SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        prompt_alt_tokens_k: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: t.TensorData | None = None,
    ) -> APIFuture[t.SampleResponse]:
        """`num_samples` continuations of `prompt`.

        Each sequence has `tokens`, `logprobs` and `stop_reason` ("stop" or "length"). `logprobs` are the
        log-probabilities of the sampled tokens under the distribution actually sampled from (temperature
        applied, top-k/top-p renormalised); at temperature 1 without top-k/top-p they equal the model's own
        log-probabilities, which are what `forward` reports. Greedy (temperature 0) reports the model's
        log-probability of the chosen token. Penalties and min_p (`SamplingParams`) shape that distribution too.

        `topk_prompt_logprobs=k` adds the k most likely tokens at every prompt position (`TopkLogprobs`, first
        row Tinker's sentinels); `prompt_alt_tokens_k=k` adds k draws at the request's temperature at every
        prompt position after the first (`PromptAltTokens`). `topk_sample_logprobs=k` gives every sequence
        `topk_logprobs`: the k most likely tokens at each sampled position under the model's own log-softmax
        (before penalties, temperature and filters). `target_prompt_logprobs` (int64 `[len(prompt) - 1, K]`, -1 for
        none) asks the logprobs of chosen ids at each prompt position after the first (the response's
        `target_prompt_logprobs`, 0.0 where -1).
        """
        params = sampling_params if sampling_params is not None else t.SamplingParams()
        with self._lock:
            seq_id = next(self._seq)
            op = m.Sample(self.sampling_session_id, seq_id, prompt, num_samples, params, include_prompt_logprobs,
                          topk_prompt_logprobs=topk_prompt_logprobs, prompt_alt_tokens_k=prompt_alt_tokens_k,
                          topk_sample_logprobs=topk_sample_logprobs, target_prompt_logprobs=target_prompt_logprobs)
            request_id = ids.request_id_of(op)
            accepted, result = self._conn.submit(op, request_id)
        return APIFuture(result, accepted, request_id)

    async def sample_async(
        self,
        prompt: t.ModelInput,
        num_samples: int = 1,
        sampling_params: t.SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        prompt_alt_tokens_k: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: t.TensorData | None = None,
    ) -> t.SampleResponse:
        """Like `sample`, awaited once (as in the Tinker SDK): returns the response."""
        return await self.sample(prompt, num_samples, sampling_params, include_prompt_logprobs,
                                 topk_prompt_logprobs, prompt_alt_tokens_k, topk_sample_logprobs,
                                 target_prompt_logprobs)

    def compute_logprobs(self, prompt: t.ModelInput) -> APIFuture[list[float | None]]:
        """log p(prompt[i] | prompt[:i]) for every position (None for the first)."""
        future = self.sample(prompt, 1, t.SamplingParams(max_tokens=1), include_prompt_logprobs=True)
        return APIFuture(_then(future.future(), lambda r: list(r.prompt_logprobs or [])), None, future.request_id)

    async def compute_logprobs_async(self, prompt: t.ModelInput) -> list[float | None]:
        return await self.compute_logprobs(prompt)

    def get_base_model(self) -> str:
        return self.base_model

    def get_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from bios.models import resolve_model_dir

            self._tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(self.base_model)))
        return self._tokenizer

    def __repr__(self) -> str:
        return f"<SamplingClient {self.sampling_session_id} on {self.model_path or self.base_model}>"


def _then(future: Any, fn: Any) -> Any:
    """A concurrent future of `fn(result)`."""
    import concurrent.futures

    out: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def done(f: Any) -> None:
        if f.exception() is not None:
            out.set_exception(f.exception())
        else:
            try:
                out.set_result(fn(f.result()))
            except Exception as exc:
                out.set_exception(exc)

    future.add_done_callback(done)
    return out
