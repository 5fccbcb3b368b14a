"""OpenAI-compatible inference: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, and vLLM's
`POST /tokenize` / `/detokenize` (also under `/v1/`).

So any eval harness that speaks the OpenAI API can sample a base model or a trained checkpoint: `model` is a
base model name or a `bios://` / `tinker://` sampler-weights path (`/v1/models` lists the base models and the
caller's own sampler checkpoints). An unknown base model is a 404 naming the known ones (the registry's rule).
Each prompt becomes a `Sample` request submitted through the coordinator's front door, so it is batched in the
same cycles as every `sample` call. Keys are bearer tokens (`Authorization: Bearer KEY`).

A stream is live: its samples are submitted with `stream=True`, so the worker sends `SampleProgress` (the tokens so
far) every ~50 ms or 16 tokens while it decodes, the coordinator forwards them to this gateway, and each piece of
text goes out as soon as it is final; the finished result then sends what is left and the finish reason. (With
`echo`, the stream is sent once the sample is done.)
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
from bios.coordinator.accounts import Accounts
from bios.coordinator.front_door import FrontDoor
from bios.exceptions import (
    ERROR_TYPES,
    BadRequestError,
    BiosAPIError,
    NotFoundError,
    RequestFailedError,
)

from . import openai_choices, openai_request, openai_responses
from .http_errors import bearer_token, http_status
from .json_body import Body

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
    def __init__(self, front_door: FrontDoor, accounts: Accounts) -> None:
        self.accounts = accounts
        self.front_door = front_door
        self.peer = front_door.attach("openai", self._done)
        self.waiting: dict[str, asyncio.Future[m.RequestDone]] = {}
        self.progress: dict[str, Callable[[m.SampleProgress], None]] = {}  # request id -> its stream, while live
        self.sessions: dict[str, str] = {}  # owner -> the session its samplers are made in
        self.samplers: dict[tuple[str, str], _Sampler] = {}  # (owner, model) -> sampler
        self.tokenizers: dict[str, Any] = {}
        self._sampler_seqs = itertools.count()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/completions", self._guard(self.completions)),
            web.post("/v1/chat/completions", self._guard(self.chat_completions)),
            web.get("/v1/models", self._guard(self.models)),
            *(web.post(f"{prefix}/tokenize", self._guard(self.tokenize)) for prefix in ("", "/v1")),
            *(web.post(f"{prefix}/detokenize", self._guard(self.detokenize)) for prefix in ("", "/v1")),
        ]

    def _guard(self, handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except BiosAPIError as exc:
                return openai_error(exc)
        return guarded

    def _owner(self, request: web.Request) -> str:
        return self.accounts.authenticate(bearer_token(request.headers.get("Authorization")))

    # ------------------------------------------------------------------------------------ routes

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def models(self, request: web.Request) -> web.Response:
        """The base models, then the caller's sampler checkpoints (newest first), each usable as `model`."""
        owner = self._owner(request)
        capabilities = await self.front_door.query(m.GetServerCapabilities())
        data = [{"id": model.model_name, "object": "model", "created": 0, "owned_by": "bios", "root": model.model_name,
                 "parent": None, "max_model_len": model.max_context_length or await self._context(model.model_name)}
                for model in capabilities.supported_models]
        checkpoints = []
        for run_id in self.front_door.run_ids(owner):
            listing = await self.front_door.query(m.ListCheckpoints(run_id), owner)
            samplers = [c for c in listing.checkpoints if c.checkpoint_type == "sampler"]
            if samplers:
                run = await self.front_door.query(m.GetTrainingRun(run_id), owner)
                checkpoints.extend((c, run.base_model) for c in samplers)
        checkpoints.sort(key=lambda pair: pair[0].time, reverse=True)
        data.extend({"id": c.bios_path, "object": "model", "created": int(c.time), "owned_by": "user",
                     "root": c.bios_path, "parent": base} for c, base in checkpoints)
        return web.json_response({"object": "list", "data": data})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's `/tokenize`: `{"model", "prompt", "add_special_tokens"?}` or `{"model", "messages",
        "add_generation_prompt"?}` -> `{"tokens", "count", "max_model_len"}`, the ids a completion or chat
        request with that prompt samples from."""
        owner, body = self._owner(request), await _json_body(request)
        _known_fields(body, {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"})
        tokenizer, base_model = await self._model_tokenizer(owner, body.text("model"))
        if body.data.get("messages") is not None:
            tokens = _chat_prompt(tokenizer, openai_request.chat_messages(body),
                                  body.flag("add_generation_prompt", True))
        else:
            prompt = body.text("prompt")
            tokens = list(tokenizer.encode(prompt, add_special_tokens=body.flag("add_special_tokens", True)))
        return web.json_response({"tokens": tokens, "count": len(tokens),
                                  "max_model_len": await self._context(base_model)})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's `/detokenize`: `{"model", "tokens"}` -> `{"prompt"}` (special tokens kept, as vLLM does)."""
        owner, body = self._owner(request), await _json_body(request)
        _known_fields(body, {"model", "tokens"})
        tokenizer, _ = await self._model_tokenizer(owner, body.text("model"))
        tokens = body.array("tokens")
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(tokenizer) for i in tokens):
            raise BadRequestError(f"tokens must be token ids in [0, {len(tokenizer)})", field="tokens")
        return web.json_response({"prompt": tokenizer.decode(tokens)})

    async def _model_tokenizer(self, owner: str, model: str) -> tuple[Any, str]:
        """The tokenizer of `model` (a base model, or a checkpoint the caller may read) and its base model."""
        if model.partition("://")[0] in SCHEMES:
            base_model = (await self._sampler(owner, model)).base_model
        else:
            base_model = model
        return await self._tokenizer(base_model), base_model

    async def _context(self, base_model: str) -> int | None:
        """The model's context length from its config.json (None where this host cannot read it)."""
        from bios.models.model_shape import model_shape

        shape = await asyncio.to_thread(model_shape, base_model)
        return shape.max_context_length if shape is not None else None

    async def _complete(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        owner = self._owner(request)
        req = openai_request.parse((await _json_body(request)).data, chat=chat)
        sampler = await self._sampler(owner, req.model)
        tokenizer = await self._tokenizer(sampler.base_model)
        prompts = [_encode(tokenizer, p) for p in req.prompts] if not chat else [_chat_prompt(tokenizer, req.messages)]
        if req.stream and not req.echo:
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            return await self._live_stream(request, owner, sampler, tokenizer, prompts, req, request_id)
        responses = await asyncio.gather(*(self._sample(owner, sampler, p, req) for p in prompts))
        choices = []
        for i, (prompt, resp) in enumerate(zip(prompts, responses, strict=True)):
            echo = (openai_choices.echo(tokenizer, prompt, resp, req.logprobs, req.logprobs is not None)
                    if req.echo else None)
            sequences = resp.sequences if req.best_of is None else openai_choices.best(resp.sequences, req.n)
            if not req.generate:  # echo with max_tokens 0: the prompt alone, nothing sampled
                sequences = [t.SampledSequence("length", [], [] if s.logprobs is not None else None)
                             for s in sequences]
            choices.extend(openai_choices.choice(tokenizer, i * req.n + j, seq, req.stops, req.logprobs, echo)
                           for j, seq in enumerate(sequences))
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        prompt_tokens = sum(len(p) for p in prompts)
        if not req.stream:
            return web.json_response(openai_responses.response(req, request_id, choices, prompt_tokens))
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await stream.prepare(request)
        for event in openai_responses.stream_events(req, request_id, choices, prompt_tokens, tokenizer):
            await stream.write(event)
        await stream.write_eof()
        return stream

    async def _live_stream(self, request: web.Request, owner: str, sampler: _Sampler, tokenizer: Any,
                           prompts: list[list[int]], req: openai_request.CompletionRequest, request_id: str
                           ) -> web.StreamResponse:
        """Each prompt's samples streamed while they run (see the module docstring). Nothing is sent before the
        first piece of text, so a request refused on admission is still an HTTP error."""
        events: asyncio.Queue[tuple[str, int, Any]] = asyncio.Queue()

        def on_progress(i: int) -> Callable[[m.SampleProgress], None]:
            return lambda progress: events.put_nowait(("progress", i, progress))

        tasks = [asyncio.ensure_future(self._sample(owner, sampler, p, req, on_progress(i)))
                 for i, p in enumerate(prompts)]
        for i, task in enumerate(tasks):
            task.add_done_callback(lambda task, i=i: events.put_nowait(("done", i, task)))
        streams = {(i, j): openai_choices.ChoiceStream(tokenizer, i * req.n + j, req.stops, req.logprobs)
                   for i in range(len(prompts)) for j in range(req.n)}
        chunks = openai_responses.StreamChunks(req, request_id)
        stream: web.StreamResponse | None = None
        finished: list[openai_choices.Choice] = []
        try:
            pending = len(tasks)
            while pending:
                kind, i, payload = await events.get()
                out: list[bytes] = []
                if kind == "progress":
                    for j, (offset, sequence) in enumerate(zip(payload.offsets, payload.sequences)):
                        if (i, j) in streams:
                            streams[i, j].add(offset, sequence)
                            for piece in streams[i, j].ready():
                                out.extend(chunks.piece(piece))
                else:
                    pending -= 1
                    try:
                        response = payload.result()
                    except BiosAPIError as exc:
                        if stream is None:
                            raise
                        await stream.write(chunks.error(exc.message, type(exc).__name__, http_status(exc)))
                        break
                    try:
                        for j, sequence in enumerate(response.sequences):
                            rest, whole = streams[i, j].final(sequence)
                            out.extend(chunks.piece(rest))
                            finished.append(whole)
                    except openai_choices.StreamDiverged as exc:
                        await stream.write(chunks.error(str(exc), "RequestFailedError", 500))
                        break
                if out and stream is None:
                    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                         "Cache-Control": "no-cache"})
                    await stream.prepare(request)
                for event in out:
                    await stream.write(event)
            else:
                if req.include_usage:
                    await stream.write(chunks.usage(sum(len(p) for p in prompts), finished))
        finally:
            for task in tasks:
                task.cancel()
        await stream.write(chunks.DONE)
        await stream.write_eof()
        return stream

    # ------------------------------------------------------------------------------------ sampling

    async def _sampler(self, owner: str, model: str) -> _Sampler:
        """The owner's sampling session on `model` (made once per gateway): a base model, or a checkpoint."""
        sampler = self.samplers.get((owner, model))
        if sampler is not None:
            return sampler
        is_path = model.partition("://")[0] in SCHEMES
        if not is_path:
            await self._tokenizer(model)  # an unknown base model: a 404 naming the known ones
        if owner not in self.sessions:
            self.sessions[owner] = self.front_door.open_session(owner)
        query = m.CreateSamplingSession(self.sessions[owner], next(self._sampler_seqs),
                                        None if is_path else model, model if is_path else None)
        session = await self.front_door.query(query, owner)
        sampler = self.samplers.setdefault((owner, model), _Sampler(session.sampling_session_id, session.base_model))
        return sampler

    async def _tokenizer(self, base_model: str) -> Any:
        if base_model not in self.tokenizers:
            from bios.models import UnknownModelError

            try:
                self.tokenizers[base_model] = await asyncio.to_thread(_load_tokenizer, base_model)
            except UnknownModelError as exc:
                raise NotFoundError(str(exc), field="model") from None
        return self.tokenizers[base_model]

    async def _sample(self, owner: str, sampler: _Sampler, prompt: list[int], req: openai_request.CompletionRequest,
                      progress: Callable[[m.SampleProgress], None] | None = None) -> t.SampleResponse:
        seq_id = next(sampler.seqs)
        want = req.logprobs is not None
        op = m.Sample(sampler.sampling_session_id, seq_id, t.ModelInput.from_ints(prompt), req.samples, req.params,
                      prompt_logprobs=req.echo and want, topk_prompt_logprobs=(req.logprobs or 0) if req.echo else 0,
                      topk_sample_logprobs=req.logprobs or 0, stream=progress is not None)
        request_id = ids.request_id_of(op)
        future = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        if progress is not None:
            self.progress[request_id] = progress
        try:
            await self.front_door.submit(self.peer, op, owner)
            done = await future
        finally:
            self.waiting.pop(request_id, None)
            self.progress.pop(request_id, None)
        if done.error is not None:
            raise ERROR_TYPES.get(done.error.type, RequestFailedError)(done.error.message, field=done.error.field)
        return done.result

    def _done(self, done: m.RequestDone | m.Notice | m.SampleProgress) -> None:
        if isinstance(done, m.SampleProgress):
            on_progress = self.progress.get(done.request_id)
            if on_progress is not None:
                on_progress(done)
            return
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


def _chat_prompt(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """The conversation through the model's chat template, ending where the assistant's reply starts."""
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequestError("this model's tokenizer has no chat template; use /v1/completions", field="model")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


async def _json_body(request: web.Request) -> Body:
    try:
        data = await request.json()
    except ValueError as exc:
        raise BadRequestError(f"the body is not valid JSON: {exc}", field="body") from None
    return Body(data)


def _known_fields(body: Body, known: set[str]) -> None:
    unknown = sorted(k for k, v in body.data.items() if k not in known and v is not None)
    if unknown:
        raise BadRequestError(f"{unknown[0]} is not implemented by this route (it takes {', '.join(sorted(known))})",
                              field=unknown[0])
