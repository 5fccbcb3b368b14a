"""The OpenAI completions wire: request bodies into typed requests, sampled tokens into OpenAI's JSON shapes.

Fields follow the OpenAI API reference for `/v1/completions` and `/v1/chat/completions` (with vLLM's `top_k`,
`min_p` and `repetition_penalty`); a missing or mistyped field is a BadRequestError naming it, and so is a
parameter Bios does not implement (tools, response_format, logit_bias...) unless its value asks for nothing
(`tool_choice: "none"`, an empty `logit_bias`): nothing is silently ignored but bookkeeping fields (`user`,
`metadata`, `store`...). Text comes from the model's tokenizer: special tokens (EOS) are not part of the text,
and a stop string ends the text before it, as OpenAI does.

Logprobs: `token_logprobs` / `logprob` of a sampled token is Bios's sampled-token logprob (under the
distribution it was drawn from: the model's own at temperature 0 or 1 without filters or penalties); the
alternatives (`logprobs=k`, `top_logprobs=k`) are the k most likely tokens under the model's own log-softmax at
that position (the worker's `topk_sample_logprobs`), as vLLM reports them. A completion's `top_logprobs` also
holds the sampled token when it is not among the k (OpenAI's "up to logprobs + 1").
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
MAX_LOGPROBS = 20  # alternatives per position: OpenAI's top_logprobs range [0, 20] (vLLM's default cap)

_COMMON_FIELDS = frozenset({"model", "n", "stop", "max_tokens", "seed", "temperature", "top_p", "presence_penalty",
                            "frequency_penalty", "stream", "stream_options", "logprobs",
                            "top_k", "min_p", "repetition_penalty"})  # the last three: vLLM's extensions
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "best_of"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
# documented fields that change nothing about the text: bookkeeping on OpenAI's side
_BOOKKEEPING = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                          "parallel_tool_calls"})  # (without tools, which are refused)
# unimplemented parameters whose value asks for nothing: what some clients send by default
_INERT = {
    "logit_bias": lambda v: v == {},
    "suffix": lambda v: v == "",
    "tools": lambda v: v == [],
    "functions": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "function_call": lambda v: v == "none",
    "response_format": lambda v: v == {"type": "text"},
    "modalities": lambda v: v == ["text"],
}


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
    logprobs: int | None  # alternatives asked for per position (0: the sampled token's only); None: no logprobs
    echo: bool = False  # completions: the prompt (and its logprobs) before the completion
    best_of: int | None = None  # completions: sample this many per prompt, return the n of highest logprob
    generate: bool = True  # False: max_tokens=0 with echo, the prompt scored and nothing generated

    @property
    def samples(self) -> int:
        """Sequences sampled per prompt."""
        return self.best_of or self.n

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
    top: list[list[tuple[str, float]]] | None = None  # per token: the k most likely (text, model logprob)
    echo: Echo | None = None  # completions with echo: the prompt, before `text`


@dataclass(frozen=True)
class Echo:
    """The prompt of a choice with `echo`: its text and tokens, their logprobs and alternatives (None at the
    first position, which has no context)."""

    text: str
    token_texts: list[str]
    logprobs: list[float | None] | None
    top: list[list[tuple[str, float]] | None] | None


def _refuse_unimplemented(data: dict[str, Any], *, chat: bool) -> None:
    known = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    for name, value in data.items():
        if value is None or name in known or name in _BOOKKEEPING:
            continue
        if name in _INERT and _INERT[name](value):
            continue
        route = "/v1/chat/completions" if chat else "/v1/completions"
        raise BadRequestError(f"{name} is not implemented by Bios's {route}; leave it out (Bios never ignores a "
                              "parameter that would change the answer)", field=name)


def parse(data: Any, *, chat: bool) -> CompletionRequest:
    body = Body(data)
    _refuse_unimplemented(body.data, chat=chat)
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
    echo = False if chat else body.flag("echo", False)
    generate = not (echo and max_tokens == 0)  # vLLM's way to score a prompt: echo with max_tokens 0
    if max_tokens is not None and max_tokens < 1 and generate:
        raise BadRequestError(f"max_tokens must be at least 1 (0 only with echo), got {max_tokens}",
                              field="max_tokens")
    params = t.SamplingParams(
        max_tokens=max_tokens if generate else 1,
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
    stream = body.flag("stream", False)
    best_of = None
    if chat:
        messages = _messages(body)
        prompts: list[str | list[int]] = []
        wants = body.flag("logprobs", False)
        top = body.integer("top_logprobs", None)
        if top is not None and not wants:
            raise BadRequestError("top_logprobs needs logprobs: true", field="top_logprobs")
        logprobs = (top or 0) if wants else None
        where = "top_logprobs"
    else:
        messages = []
        prompts = _prompts(body)
        logprobs = body.integer("logprobs", None)
        where = "logprobs"
        best_of = body.integer("best_of", None)
        if best_of is not None and best_of < n:
            raise BadRequestError(f"best_of must be at least n ({n}), got {best_of}", field="best_of")
        if best_of is not None and best_of > 1 and stream:
            raise BadRequestError("best_of cannot be streamed (the best are known only at the end)", field="best_of")
        best_of = best_of if best_of is not None and best_of > n else None
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise BadRequestError(f"{where} must be between 0 and {MAX_LOGPROBS}, got {logprobs}", field=where)
    return CompletionRequest(model, chat, prompts, messages, n, params, stream,
                             options is not None and options.flag("include_usage", False), logprobs, echo, best_of,
                             generate)


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


def _alternatives(tokenizer: Any, topk: t.TopkLogprobs | None, length: int, k: int | None
                  ) -> list[list[tuple[str, float]] | None] | None:
    """The first `k` (text, logprob) of each of `length` rows of `topk` (None for a sentinel row)."""
    if not k or topk is None:
        return None
    ids, values = topk.token_ids.to_numpy(), topk.logprobs.to_numpy()
    out: list[list[tuple[str, float]] | None] = []
    for row in range(length):
        if values[row, 0] == t.TOPK_MASK_LOGPROB:
            out.append(None)
        else:
            out.append([(tokenizer.decode([int(i)]), float(v)) for i, v in zip(ids[row, :k], values[row, :k])])
    return out


def choice(tokenizer: Any, index: int, sequence: t.SampledSequence, stops: list[str], k: int | None = None,
           echo: Echo | None = None) -> Choice:
    text = tokenizer.decode(sequence.tokens, skip_special_tokens=True)
    finish = "stop" if sequence.stop_reason == "stop" else "length"
    cuts = [text.find(s) for s in stops if s in text]
    if cuts:
        text, finish = text[: min(cuts)], "stop"
    token_texts = [tokenizer.decode([tok]) for tok in sequence.tokens]
    top = _alternatives(tokenizer, sequence.topk_logprobs, len(sequence.tokens), k)
    return Choice(index, text, list(sequence.tokens), token_texts, sequence.logprobs, finish, top, echo)


def echo(tokenizer: Any, prompt: list[int], response: t.SampleResponse, k: int | None, logprobs: bool) -> Echo:
    """A completion's prompt for `echo`, with its logprobs (and `k` alternatives) when asked."""
    return Echo(tokenizer.decode(prompt, skip_special_tokens=True), [tokenizer.decode([tok]) for tok in prompt],
                response.prompt_logprobs if logprobs else None,
                _alternatives(tokenizer, response.topk_prompt_logprobs, len(prompt), k))


def best(sequences: list[t.SampledSequence], n: int) -> list[t.SampledSequence]:
    """`best_of`: the n sequences of highest total logprob, best first (ties: sampling order)."""
    ranked = sorted(range(len(sequences)), key=lambda i: -sum(sequences[i].logprobs or []))
    return [sequences[i] for i in ranked[:n]]


def token_pieces(tokenizer: Any, tokens: list[int], text: str) -> list[tuple[str, int]]:
    """`text` split where its tokens end (held back while a token ends mid-character): what a stream sends, each
    piece with the number of tokens it completes."""
    out, sent = [], 0
    for i in range(1, len(tokens) + 1):
        so_far = tokenizer.decode(tokens[:i], skip_special_tokens=True)
        if so_far.endswith("\ufffd"):
            continue
        end = min(len(so_far), len(text))
        if end > sent and text.startswith(so_far[:end]):
            out.append((text[sent:end], i))
            sent = end
    if sent < len(text):
        out.append((text[sent:], len(tokens)))
    return out


def pieces(tokenizer: Any, tokens: list[int], text: str) -> list[str]:
    return [piece for piece, _ in token_pieces(tokenizer, tokens, text)]


# ------------------------------------------------------------------------------------------ responses


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


# ------------------------------------------------------------------------------------------ live streams


class StreamDiverged(Exception):
    """The sample's result does not continue the text already streamed: its cycle was aborted after progress was
    sent (a worker died) and the sample ran again, drawing other tokens."""


class ChoiceStream:
    """One choice of a stream while its sample runs: tokens come in the worker's progress messages, and text goes
    out as soon as it is final (not mid-character, not what may be the start of a stop string)."""

    def __init__(self, tokenizer: Any, index: int, stops: list[str], k: int | None) -> None:
        self.tokenizer, self.index, self.stops, self.k = tokenizer, index, stops, k
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[str, float]] | None] = []
        self.sent_text, self.sent_tokens = "", 0
        self.finished = False

    def add(self, offset: int, sequence: t.SampledSequence) -> None:
        """Tokens from position `offset` on (a repeat is skipped; after a gap the final result fills in)."""
        if self.finished or offset > len(self.tokens):
            return
        skip = len(self.tokens) - offset
        self.tokens += sequence.tokens[skip:]
        self.logprobs += (sequence.logprobs or [])[skip:]
        self.top += (_alternatives(self.tokenizer, sequence.topk_logprobs, len(sequence.tokens), self.k) or [])[skip:]

    def ready(self) -> list[Choice]:
        """The text that became final since the last call, a piece per token that completes some (as `pieces`
        splits a finished text), each with the tokens since the previous piece."""
        out: list[Choice] = []
        for end in range(self.sent_tokens + 1, len(self.tokens) + 1 if not self.finished else 0):
            text = self._final_text(self.tokenizer.decode(self.tokens[:end], skip_special_tokens=True))
            if len(text) > len(self.sent_text) and text.startswith(self.sent_text):
                out.append(self._piece(text[len(self.sent_text):], end, self.logprobs, self.top or None, ""))
        return out

    def _final_text(self, text: str) -> str:
        """`text` up to a stop string, or without what may still change: an incomplete character at the end, or an
        end that may be the start of a stop string."""
        cuts = [text.find(s) for s in self.stops if s in text]
        if cuts:
            return text[: min(cuts)]
        text = text.rstrip("\ufffd")
        hold = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        return text[: len(text) - hold]

    def final(self, sequence: t.SampledSequence) -> tuple[Choice, Choice]:
        """(what is left to send, the whole choice) once the sample is done."""
        whole = choice(self.tokenizer, self.index, sequence, self.stops, self.k)
        self.finished = True
        if not whole.text.startswith(self.sent_text):
            raise StreamDiverged("this sample ran again after a worker failed and drew other tokens than those "
                                 "already streamed; send the request again (a seed makes samples repeatable)")
        rest = whole.text[len(self.sent_text):]
        self.tokens = whole.tokens
        return self._piece(rest, len(whole.tokens), whole.logprobs, whole.top, whole.finish_reason), whole

    def _piece(self, text: str, end: int, logprobs: list[float] | None,
               top: list[list[tuple[str, float]] | None] | None, finish: str) -> Choice:
        start, self.sent_tokens = self.sent_tokens, end
        self.sent_text += text
        tokens = self.tokens[start:end]
        return Choice(self.index, text, tokens, [self.tokenizer.decode([tok]) for tok in tokens],
                      logprobs[start:end] if logprobs is not None else None, finish,
                      top[start:end] if top is not None else None)


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
