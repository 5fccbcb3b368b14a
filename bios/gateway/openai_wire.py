"""The OpenAI completions wire: request bodies into typed requests, sampled tokens into OpenAI's JSON shapes.

Fields follow the OpenAI API reference for `/v1/completions` and `/v1/chat/completions`; a missing or mistyped
field is a BadRequestError naming it. Text comes from the model's tokenizer: special tokens (EOS) are not part of
the text, and a stop string ends the text before it, as OpenAI does.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from bios import types as t
from bios.exceptions import BadRequestError

from .json_wire import Body

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the model's context


@dataclass(frozen=True)
class CompletionRequest:
    """One request of either endpoint. `prompts` are text (completions) or token ids; `messages` (chat) are
    rendered by the tokenizer's chat template."""

    model: str
    chat: bool
    prompts: list[str | list[int]]
    messages: list[dict[str, str]]
    n: int
    params: t.SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives asked for (only the sampled token is known); None: no logprobs

    @property
    def stops(self) -> list[str]:
        stop = self.params.stop
        return [stop] if isinstance(stop, str) else [s for s in stop or [] if isinstance(s, str)]


@dataclass(frozen=True)
class Choice:
    """One sampled sequence, decoded: its text (cut before a stop string), its tokens and their logprobs."""

    index: int
    text: str
    tokens: list[int]
    token_texts: list[str]
    logprobs: list[float] | None
    finish_reason: str  # stop | length


def parse(data: Any, *, chat: bool) -> CompletionRequest:
    body = Body(data)
    model = body.text("model")
    n = body.integer("n", 1)
    if n < 1:
        raise BadRequestError(f"n must be at least 1, got {n}", field="n")
    stop = body.data.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                             and all(isinstance(s, str) and s for s in stop))):
        raise BadRequestError("stop must be a string or a list of non-empty strings", field="stop")
    default_max = None if chat else COMPLETIONS_MAX_TOKENS
    max_tokens = body.integer("max_completion_tokens", None) if chat else None
    max_tokens = max_tokens if max_tokens is not None else body.integer("max_tokens", default_max)
    if max_tokens is not None and max_tokens < 1:
        raise BadRequestError(f"max_tokens must be at least 1, got {max_tokens}", field="max_tokens")
    params = t.SamplingParams(
        max_tokens=max_tokens,
        seed=body.integer("seed", None),
        stop=stop,
        temperature=body.number("temperature", 1.0),
        top_p=body.number("top_p", 1.0),
        presence_penalty=body.number("presence_penalty", 0.0),
        frequency_penalty=body.number("frequency_penalty", 0.0),
        # vLLM's extensions of the OpenAI request, with vLLM's meanings (as Bios's own sampling params)
        top_k=body.integer("top_k", -1),
        min_p=body.number("min_p", 0.0),
        repetition_penalty=body.number("repetition_penalty", 1.0),
    )
    options = body.child("stream_options", None)
    if chat:
        messages = _messages(body)
        prompts: list[str | list[int]] = []
        logprobs = body.integer("top_logprobs", 0) if body.flag("logprobs", False) else None
    else:
        messages = []
        prompts = _prompts(body)
        logprobs = body.integer("logprobs", None)
    return CompletionRequest(model, chat, prompts, messages, n, params, body.flag("stream", False),
                             options is not None and options.flag("include_usage", False), logprobs)


def _prompts(body: Body) -> list[str | list[int]]:
    prompt = body.data.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(
            isinstance(i, int) and not isinstance(i, bool) for i in p) for p in prompt):
        return [list(p) for p in prompt]
    raise BadRequestError("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                          "token ids", field="prompt")


def _messages(body: Body) -> list[dict[str, str]]:
    messages = body.array("messages")
    if not messages:
        raise BadRequestError("messages must hold at least one message", field="messages")
    out = []
    for i, raw in enumerate(messages):
        message = Body(raw, f"messages[{i}]")
        content = message.data.get("content")
        if isinstance(content, list):  # content parts: only text parts are understood
            parts = [Body(p, f"messages[{i}].content[{j}]") for j, p in enumerate(content)]
            if any(p.text("type") != "text" for p in parts):
                raise BadRequestError("only text content parts are supported", field=f"messages[{i}].content")
            content = "".join(p.text("text") for p in parts)
        if not isinstance(content, str):
            raise BadRequestError(f"messages[{i}].content must be a string or a list of text parts",
                                  field=f"messages[{i}].content")
        out.append({"role": message.text("role"), "content": content})
    return out


# ------------------------------------------------------------------------------------------ decoding


def choice(tokenizer: Any, index: int, sequence: t.SampledSequence, stops: list[str]) -> Choice:
    text = tokenizer.decode(sequence.tokens, skip_special_tokens=True)
    finish = "stop" if sequence.stop_reason == "stop" else "length"
    cuts = [text.find(s) for s in stops if s in text]
    if cuts:
        text, finish = text[: min(cuts)], "stop"
    token_texts = [tokenizer.decode([tok]) for tok in sequence.tokens]
    return Choice(index, text, list(sequence.tokens), token_texts, sequence.logprobs, finish)


def pieces(tokenizer: Any, tokens: list[int], text: str) -> list[str]:
    """`text` split where its tokens end (held back while a token ends mid-character): what a stream sends."""
    out, sent = [], 0
    for i in range(1, len(tokens) + 1):
        so_far = tokenizer.decode(tokens[:i], skip_special_tokens=True)
        if so_far.endswith("\ufffd"):
            continue
        end = min(len(so_far), len(text))
        if end > sent and text.startswith(so_far[:end]):
            out.append(text[sent:end])
            sent = end
    if sent < len(text):
        out.append(text[sent:])
    return out


# ------------------------------------------------------------------------------------------ responses


def usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def _completion_logprobs(c: Choice) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    offsets, at = [], 0
    for text in c.token_texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": c.token_texts, "token_logprobs": c.logprobs,
            "top_logprobs": [{text: lp} for text, lp in zip(c.token_texts, c.logprobs, strict=True)],
            "text_offset": offsets}


def _chat_logprobs(c: Choice) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    content = []
    for text, lp in zip(c.token_texts, c.logprobs, strict=True):
        entry = {"token": text, "logprob": lp, "bytes": list(text.encode())}
        content.append({**entry, "top_logprobs": [entry]})
    return {"content": content}


def response(request: CompletionRequest, request_id: str, choices: list[Choice], prompt_tokens: int
             ) -> dict[str, Any]:
    want = request.logprobs is not None
    if request.chat:
        rendered = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "logprobs": _chat_logprobs(c) if want else None, "finish_reason": c.finish_reason}
                    for c in choices]
    else:
        rendered = [{"index": c.index, "text": c.text, "logprobs": _completion_logprobs(c) if want else None,
                     "finish_reason": c.finish_reason} for c in choices]
    return {"id": request_id, "object": "chat.completion" if request.chat else "text_completion",
            "created": int(time.time()), "model": request.model, "choices": rendered,
            "usage": usage(prompt_tokens, choices)}


def stream_events(request: CompletionRequest, request_id: str, choices: list[Choice], prompt_tokens: int,
                  tokenizer: Any) -> list[bytes]:
    """The server-sent events of a streamed response: each choice's text in pieces, then its finish reason."""
    base = {"id": request_id, "object": "chat.completion.chunk" if request.chat else "text_completion",
            "created": int(time.time()), "model": request.model}
    events = []

    def chunk(index: int, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if request.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}

    for c in choices:
        if request.chat:
            events.append({**base, "choices": [chunk(c.index, None, None, first=True)]})
        for piece in pieces(tokenizer, c.tokens, c.text):
            events.append({**base, "choices": [chunk(c.index, piece, None)]})
        events.append({**base, "choices": [chunk(c.index, None, c.finish_reason)]})
    if request.include_usage:
        events.append({**base, "choices": [], "usage": usage(prompt_tokens, choices)})
    return [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]
