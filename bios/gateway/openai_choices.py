"""Sampled sequences as OpenAI choices: decoded text, tokens, logprobs and alternatives, whole or as they stream.

Text comes from the model's tokenizer: special tokens (EOS) are not part of the text, and a stop string ends
the text before it, as OpenAI does. A token's logprob is Bios's sampled-token logprob (under the distribution
it was drawn from: the model's own at temperature 0 or 1 without filters or penalties); the alternatives
(`logprobs=k`, `top_logprobs=k`) are the k most likely tokens under the model's own log-softmax at that
position (the worker's `topk_sample_logprobs`), as vLLM reports them. `ChoiceStream` builds a choice while its
sample runs, releasing text only once it is final; `openai_responses` renders choices as OpenAI's JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bios import types as t


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
