"""OpenAI completions requests: the bodies of `/v1/completions` and `/v1/chat/completions` into a typed
`CompletionRequest`.

Fields follow the OpenAI API reference for both endpoints (with vLLM's `top_k`, `min_p` and
`repetition_penalty`); a missing or mistyped field is a BadRequestError naming it, and so is a parameter Bios
does not implement (tools, response_format, logit_bias...) unless its value asks for nothing (`tool_choice:
"none"`, an empty `logit_bias`): nothing is silently ignored but bookkeeping fields (`user`, `metadata`,
`store`...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bios import types as t
from bios.exceptions import BadRequestError

from .json_body import Body

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
        messages = chat_messages(body)
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


def chat_messages(body: Body) -> list[dict[str, str]]:
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
