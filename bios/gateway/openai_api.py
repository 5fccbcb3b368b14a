"""OpenAI-compatible inference: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`.

So any eval harness that speaks the OpenAI API can sample a base model or a trained checkpoint: `model` is a
base model name or a `bios://` / `tinker://` sampler-weights path. Each prompt becomes a `Sample` request
submitted through the coordinator's front door, so it is batched in the same cycles as every `sample` call.
Keys are bearer tokens (`Authorization: Bearer KEY`). A stream sends the text in token-sized pieces once the
sample is done: a cycle produces a whole sequence at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from bios import ids
from bios import messages as m
from bios import types as t
from bios.checkpoint_path import SCHEMES
from bios.coordinator.server import Coordinator
from bios.exceptions import ERROR_TYPES, BadRequestError, BiosAPIError, RequestFailedError

from . import openai_wire as wire
from .http_errors import bearer_token, http_status

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class _Sampler:
    sampling_session_id: str
    base_model: str
    seqs: Iterator[int] = field(default_factory=itertools.count)


def openai_error(exc: BiosAPIError) -> web.Response:
    """An error in OpenAI's shape, so its clients raise the matching exception with the message."""
    body = {"error": {"message": exc.message, "type": type(exc).__name__, "param": exc.field, "code": None}}
    return web.json_response(body, status=http_status(exc))


class OpenAICompat:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.front_door = coordinator.front_door
        self.peer = coordinator.attach_local_client("openai", self._done)
        self.waiting: dict[str, asyncio.Future[m.RequestDone]] = {}
        self.sessions: dict[str, str] = {}  # owner -> the session its samplers are made in
        self.samplers: dict[tuple[str, str], _Sampler] = {}  # (owner, model) -> sampler
        self.tokenizers: dict[str, Any] = {}
        self._sampler_seqs = itertools.count()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/completions", self._guard(self.completions)),
            web.post("/v1/chat/completions", self._guard(self.chat_completions)),
            web.get("/v1/models", self._guard(self.models)),
        ]

    def _guard(self, handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except BiosAPIError as exc:
                return openai_error(exc)
        return guarded

    def _owner(self, request: web.Request) -> str:
        return self.coordinator.authenticate(bearer_token(request.headers.get("Authorization")))

    # ------------------------------------------------------------------------------------ routes

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def models(self, request: web.Request) -> web.Response:
        self._owner(request)
        capabilities = await self.front_door.query(m.GetServerCapabilities())
        return web.json_response({"object": "list", "data": [
            {"id": model.model_name, "object": "model", "created": 0, "owned_by": "bios"}
            for model in capabilities.supported_models]})

    async def _complete(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        owner = self._owner(request)
        try:
            data = await request.json()
        except ValueError as exc:
            raise BadRequestError(f"the body is not valid JSON: {exc}", field="body") from None
        req = wire.parse(data, chat=chat)
        sampler = await self._sampler(owner, req.model)
        tokenizer = await self._tokenizer(sampler.base_model)
        prompts = [_encode(tokenizer, p) for p in req.prompts] if not chat else [_chat_prompt(tokenizer, req.messages)]
        responses = await asyncio.gather(*(self._sample(owner, sampler, p, req) for p in prompts))
        choices = [wire.choice(tokenizer, i * req.n + j, seq, req.stops)
                   for i, resp in enumerate(responses) for j, seq in enumerate(resp.sequences)]
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        prompt_tokens = sum(len(p) for p in prompts)
        if not req.stream:
            return web.json_response(wire.response(req, request_id, choices, prompt_tokens))
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await stream.prepare(request)
        for event in wire.stream_events(req, request_id, choices, prompt_tokens, tokenizer):
            await stream.write(event)
        await stream.write_eof()
        return stream

    # ------------------------------------------------------------------------------------ sampling

    async def _sampler(self, owner: str, model: str) -> _Sampler:
        """The owner's sampling session on `model` (made once per gateway): a base model, or a checkpoint."""
        sampler = self.samplers.get((owner, model))
        if sampler is not None:
            return sampler
        if owner not in self.sessions:
            self.sessions[owner] = self.front_door.open_session(owner)
        is_path = model.partition("://")[0] in SCHEMES
        query = m.CreateSamplingSession(self.sessions[owner], next(self._sampler_seqs),
                                        None if is_path else model, model if is_path else None)
        session = await self.front_door.query(query, owner)
        sampler = self.samplers.setdefault((owner, model), _Sampler(session.sampling_session_id, session.base_model))
        return sampler

    async def _tokenizer(self, base_model: str) -> Any:
        if base_model not in self.tokenizers:
            self.tokenizers[base_model] = await asyncio.to_thread(_load_tokenizer, base_model)
        return self.tokenizers[base_model]

    async def _sample(self, owner: str, sampler: _Sampler, prompt: list[int],
                      req: wire.CompletionRequest) -> t.SampleResponse:
        seq_id = next(sampler.seqs)
        request_id = ids.request_id(sampler.sampling_session_id, seq_id)
        op = m.Sample(sampler.sampling_session_id, seq_id, t.ModelInput.from_ints(prompt), req.n, req.params)
        future = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        try:
            await self.front_door.submit(self.peer, op, owner)
            done = await future
        finally:
            self.waiting.pop(request_id, None)
        if done.error is not None:
            raise ERROR_TYPES.get(done.error.type, RequestFailedError)(done.error.message, field=done.error.field)
        return done.result

    def _done(self, done: m.RequestDone | m.Notice) -> None:
        if isinstance(done, m.Notice):
            log.info("%s: %s", done.request_id, done.message)
            return
        future = self.waiting.get(done.request_id)
        if future is not None and not future.done():
            future.set_result(done)


def _load_tokenizer(base_model: str) -> Any:
    from transformers import AutoTokenizer

    from bios.models import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(base_model)))


def _encode(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """A text prompt as the tokenizer's `encode` gives it (with its special tokens, e.g. BOS); ids as they are."""
    return list(prompt) if isinstance(prompt, list) else list(tokenizer.encode(prompt))


def _chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The conversation through the model's chat template, ending where the assistant's reply starts."""
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequestError("this model's tokenizer has no chat template; use /v1/completions", field="model")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))
