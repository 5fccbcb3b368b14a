"""Demo tasks: question/answer pairs shipped as JSON in `bios/demo/data/`, turned into chat-formatted data.

A task file groups questions by fact: every question of a fact has the same answer and the same `key`, the
short string that a correct answer must contain. `train` questions are trained on; `eval` questions are
held out (paraphrases of the trained ones) and only ever sampled. A task with `"held_out": false` has no
`eval` questions and is scored on its training questions: the quick smoke test, whose tiny random model can
memorise in seconds but not generalise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from bios import types

TASKS = ("vellmora", "animal-sounds")


@dataclass(frozen=True)
class Example:
    question: str
    answer: str
    key: str


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    base_model: str
    system: str | None  # None: the chat template's default
    max_tokens: int  # sampling budget of an answer: enough for the answer, small enough to be quick
    held_out: bool  # False: `eval` is the training set itself
    train: list[Example]
    eval: list[Example]

    @property
    def scored_on(self) -> str:
        """What the scored questions are, for reports."""
        return "held-out questions" if self.held_out else "trained questions"

    @property
    def keys(self) -> list[str]:
        return sorted({example.key for example in self.train + self.eval})


def load_task(name: str) -> Task:
    """A task shipped with Bios, by name (see `TASKS`)."""
    if name not in TASKS:
        raise ValueError(f"unknown demo task {name!r}; known: {', '.join(TASKS)}")
    raw = json.loads(resources.files("bios.demo").joinpath("data", f"{name}.json").read_text())
    return task_from_dict(raw)


def task_from_dict(raw: dict[str, Any]) -> Task:
    def examples(split: str) -> list[Example]:
        return [Example(q, fact["answer"], fact["key"]) for fact in raw["facts"] for q in fact[split]]

    held_out = bool(raw.get("held_out", True))
    train = examples("train")
    evaluation = examples("eval") if held_out else train
    if held_out and {e.question for e in train} & {e.question for e in evaluation}:
        raise ValueError(f"task {raw['name']!r} says its eval questions are held out, but some are trained on")
    return Task(raw["name"], raw["description"], raw["base_model"], raw.get("system"), int(raw["max_tokens"]),
                held_out, train, evaluation)


def is_correct(answer: str, example: Example, keys: list[str]) -> bool:
    """The answer names this example's key and no other fact's key (so listing every fact scores nothing)."""
    text = answer.casefold()
    return example.key.casefold() in text and not any(
        other.casefold() in text for other in keys if other != example.key
    )


class ChatFormat:
    """Prompts and training data through the tokenizer's own chat template."""

    def __init__(self, tokenizer: Any, system: str | None) -> None:
        self.tokenizer = tokenizer
        self.system = system
        self.eos_token_id = tokenizer.eos_token_id

    def _messages(self, question: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [*system, {"role": "user", "content": question}]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, question: str) -> list[int]:
        """The prompt tokens up to and including the assistant header: where an answer starts."""
        text = self.tokenizer.apply_chat_template(self._messages(question), tokenize=False, add_generation_prompt=True)
        return self._encode(text)

    def datum(self, example: Example) -> types.Datum:
        """The whole exchange; weights are 1 on the answer and its end-of-turn token, 0 on the prompt."""
        prompt = self.prompt(example.question)
        messages = [*self._messages(example.question), {"role": "assistant", "content": example.answer}]
        full = self._encode(self.tokenizer.apply_chat_template(messages, tokenize=False))
        if full[: len(prompt)] != prompt:
            raise ValueError(f"the chat template renders the prompt of {example.question!r} differently inside a "
                             "full conversation, so answer tokens cannot be told apart from prompt tokens")
        answer = full[len(prompt):]
        if self.eos_token_id not in answer:
            raise ValueError(f"the chat template ends an assistant turn without the EOS token {self.eos_token_id}; "
                             "the model would never learn to stop")
        tokens = prompt + answer[: answer.index(self.eos_token_id) + 1]
        weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(tokens) - len(prompt))
        return types.Datum(types.ModelInput.from_ints(tokens[:-1]),
                           {"target_tokens": tokens[1:], "weights": weights})

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()
