"""OpenAI's JSON shapes for decoded choices: a whole response, its server-sent events, and a live stream's
events one at a time.

Logprobs go out in each endpoint's shape: a completion's `logprobs` object (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`, with the echoed prompt first), whose `top_logprobs` also holds the sampled token
when it is not among the k (OpenAI's "up to logprobs + 1"), or a chat choice's `logprobs.content` entries.
"""

from __future__ import annotations

import json
import time
from typing import Any

from .openai_choices import Choice, token_pieces
from .openai_request import CompletionRequest


def usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def _top_dict(alternatives: list[tuple[str, float]] | None, sampled: tuple[str, float] | None
              ) -> dict[str, float] | None:
    """A completion position's `top_logprobs`: its alternatives, and the sampled token when not among them."""
    if alternatives is None and sampled is None:
        return None
    out: dict[str, float] = {}
    for text, lp in alternatives or []:
        out.setdefault(text, lp)
    if sampled is not None:
        out.setdefault(*sampled)
    return out


def _completion_logprobs(c: Choice, start: int = 0, end: int | None = None, offset: int = 0,
                         with_echo: bool = True) -> dict[str, Any] | None:
    """The `logprobs` object of tokens [start, end) of `c` (with its echoed prompt first when `with_echo`);
    text offsets count from `offset`."""
    if c.logprobs is None:
        return None
    end = len(c.tokens) if end is None else end
    texts: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if with_echo and c.echo is not None:
        for i, text in enumerate(c.echo.token_texts):
            lp = c.echo.logprobs[i] if c.echo.logprobs is not None else None
            texts.append(text)
            values.append(lp)
            alternatives = c.echo.top[i] if c.echo.top is not None else None
            tops.append(_top_dict(alternatives, None if lp is None else (text, lp)))
    for i in range(start, end):
        texts.append(c.token_texts[i])
        values.append(c.logprobs[i])
        tops.append(_top_dict(c.top[i] if c.top is not None else None, (c.token_texts[i], c.logprobs[i])))
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _chat_entry(text: str, lp: float) -> dict[str, Any]:
    return {"token": text, "logprob": lp, "bytes": list(text.encode())}


def _chat_logprobs(c: Choice, start: int = 0, end: int | None = None) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    end = len(c.tokens) if end is None else end
    content = []
    for i in range(start, end):
        top = c.top[i] if c.top is not None else None
        content.append({**_chat_entry(c.token_texts[i], c.logprobs[i]),
                        "top_logprobs": [_chat_entry(text, lp) for text, lp in top or []]})
    return {"content": content}


def response(request: CompletionRequest, request_id: str, choices: list[Choice], prompt_tokens: int
             ) -> dict[str, Any]:
    want = request.logprobs is not None
    if request.chat:
        rendered = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "logprobs": _chat_logprobs(c) if want else None, "finish_reason": c.finish_reason}
                    for c in choices]
    else:
        rendered = [{"index": c.index, "text": (c.echo.text if c.echo is not None else "") + c.text,
                     "logprobs": _completion_logprobs(c) if want else None,
                     "finish_reason": c.finish_reason} for c in choices]
    return {"id": request_id, "object": "chat.completion" if request.chat else "text_completion",
            "created": int(time.time()), "model": request.model, "choices": rendered,
            "usage": usage(prompt_tokens, choices)}


def stream_events(request: CompletionRequest, request_id: str, choices: list[Choice], prompt_tokens: int,
                  tokenizer: Any) -> list[bytes]:
    """The server-sent events of a streamed response: each choice's text in pieces (with the logprobs of the
    tokens each piece completes), then its finish reason."""
    base = {"id": request_id, "object": "chat.completion.chunk" if request.chat else "text_completion",
            "created": int(time.time()), "model": request.model}
    want = request.logprobs is not None
    events = []

    def chunk(c: Choice, text: str | None, finish: str | None, tokens: tuple[int, int] | None,
              first: bool = False, offset: int = 0) -> dict[str, Any]:
        if request.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            logprobs = _chat_logprobs(c, *tokens) if want and tokens is not None else None
            return {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        logprobs = None
        if want and (tokens is not None or first):
            start, end = tokens if tokens is not None else (0, 0)
            logprobs = _completion_logprobs(c, start, end, offset, with_echo=first)
        return {"index": c.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    for c in choices:
        if request.chat:
            events.append({**base, "choices": [chunk(c, None, None, None, first=True)]})
        elif c.echo is not None:
            events.append({**base, "choices": [chunk(c, c.echo.text, None, None, first=True)]})
        done, offset = 0, len(c.echo.text) if c.echo is not None else 0
        for piece, end in token_pieces(tokenizer, c.tokens, c.text):
            events.append({**base, "choices": [chunk(c, piece, None, (done, end), offset=offset)]})
            done, offset = end, offset + len(piece)
        rest = (done, len(c.tokens)) if done < len(c.tokens) else None  # tokens after a stop string's cut
        events.append({**base, "choices": [chunk(c, None, c.finish_reason, rest, offset=offset)]})
    if request.include_usage:
        events.append({**base, "choices": [], "usage": usage(prompt_tokens, choices)})
    return [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]


class StreamChunks:
    """The server-sent events of a live stream, one at a time."""

    def __init__(self, request: CompletionRequest, request_id: str) -> None:
        self.request = request
        self.base = {"id": request_id, "object": "chat.completion.chunk" if request.chat else "text_completion",
                     "created": int(time.time()), "model": request.model}
        self.offsets: dict[int, int] = {}  # completions: text sent per choice (logprobs' text_offset)
        self.started: set[int] = set()

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return f"data: {json.dumps({**self.base, 'choices': choices, **extra})}\n\n".encode()

    def _start(self, index: int) -> list[bytes]:
        if index in self.started or not self.request.chat:
            return []
        self.started.add(index)
        return [self._event([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])]

    def piece(self, c: Choice) -> list[bytes]:
        """A piece of text (and its tokens' logprobs), then the finish reason if it is the last."""
        out = self._start(c.index)
        want = self.request.logprobs is not None
        if c.text or (want and c.tokens):
            if self.request.chat:
                out.append(self._event([{"index": c.index, "delta": {"content": c.text},
                                         "logprobs": _chat_logprobs(c) if want else None, "finish_reason": None}]))
            else:
                offset = self.offsets.get(c.index, 0)
                out.append(self._event([{"index": c.index, "text": c.text, "finish_reason": None,
                                         "logprobs": _completion_logprobs(c, offset=offset) if want else None}]))
                self.offsets[c.index] = offset + len(c.text)
        if c.finish_reason:
            if self.request.chat:
                out.append(self._event([{"index": c.index, "delta": {}, "logprobs": None,
                                         "finish_reason": c.finish_reason}]))
            else:
                out.append(self._event([{"index": c.index, "text": "", "logprobs": None,
                                         "finish_reason": c.finish_reason}]))
        return out

    def usage(self, prompt_tokens: int, choices: list[Choice]) -> bytes:
        return self._event([], usage=usage(prompt_tokens, choices))

    @staticmethod
    def error(message: str, kind: str, status: int) -> bytes:
        return f"data: {json.dumps({'error': {'message': message, 'type': kind, 'code': status}})}\n\n".encode()

    DONE = b"data: [DONE]\n\n"
