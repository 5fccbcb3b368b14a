"""tinker-cookbook 0.6.1 recipes, unmodified, against a Bios cluster through the HTTP gateway.

Needs the `cookbook` extra plus the cookbook itself, which pip cannot resolve with its dependencies (it
requires an unpublished `tml-renderers`): `pip install -e '.[cookbook]' && pip install --no-deps
tinker-cookbook==0.6.1`. No Hugging Face access: the recipes' Hub datasets are replaced by local rows, their
model name `Qwen/Qwen3-8B-Base` is mapped to the built-in tiny model on the session's cluster (`BIOS_MODEL_MAP`,
conftest's `mapped`) and to its tokenizer on the client (`register_tokenizer`).
"""

from __future__ import annotations

import json
import subprocess
import sys

import datasets
import pytest
import tinker
from conftest import COOKBOOK_MODEL as MODEL_NAME
from tinker_cookbook import tokenizer_utils
from tinker_cookbook.recipes import rl_loop, sl_loop
from transformers import AutoTokenizer

pytestmark = pytest.mark.e2e

KEY = "tml-cookbook"


@pytest.fixture(scope="module")
def model_dir(mapped) -> str:
    return mapped[MODEL_NAME]


@pytest.fixture
def recipe_env(monkeypatch, model_dir):
    """What a user's shell and wrapper would set: the key, no telemetry, no Hub, the local tokenizer."""
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer_utils.register_tokenizer(MODEL_NAME, lambda: AutoTokenizer.from_pretrained(model_dir))


def _local_dataset(monkeypatch, rows: list[dict]) -> None:
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows)}))


def _logged_steps(log_path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def _final_checkpoint(log_path) -> dict:
    return json.loads((log_path / "checkpoints.jsonl").read_text().splitlines()[-1])


def test_math_rl_arithmetic_runs_two_steps_from_the_cli(cluster, model_dir, tmp_path):
    log_path = tmp_path / "math_rl"
    command = [
        sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", "renderer_name=role_colon",
        f"model_name={model_dir}", f"base_url={cluster.http_url}", f"log_path={log_path}", "groups_per_batch=2",
        "group_size=4", "max_tokens=5", "max_steps=2", "eval_every=0", "save_every=0", "lora_rank=8",
    ]  # the default loss, stable_reinforce
    env = {**cluster.env, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Training completed successfully" in done.stderr
    trained = [step for step in _logged_steps(log_path) if "optim/lr" in step]
    assert len(trained) == 2 and all(step["step:max"] >= 1 for step in trained)
    assert _final_checkpoint(log_path)["state_path"].startswith("tinker://")


CONVERSATIONS = [
    [{"role": "user", "content": f"Say {word}."}, {"role": "assistant", "content": f"{word}, as asked."}]
    for word in ("red", "green", "blue", "amber")
]


def test_sl_loop_runs_to_completion(cluster, recipe_env, monkeypatch, tmp_path):
    _local_dataset(monkeypatch, [{"messages": conversation} for conversation in CONVERSATIONS])
    log_path = tmp_path / "sl_loop"
    sl_loop.main(sl_loop.Config(base_url=cluster.http_url, log_path=str(log_path), model_name=MODEL_NAME,
                                batch_size=2, learning_rate=1e-3, lora_rank=8))
    steps = _logged_steps(log_path)
    assert [s["step"] for s in steps] == [0, 1]
    assert all(s["train_mean_nll"] > 0 and s["learning_rate:mean"] > 0 for s in steps)
    final = _final_checkpoint(log_path)
    assert final["state_path"].endswith("/weights/final") and final["sampler_path"].endswith("/sampler_weights/final")


class _SeededSamplingParams(tinker.types.SamplingParams):
    seed: int | None = 20250101


def test_rl_loop_runs_to_completion(cluster, recipe_env, monkeypatch, tmp_path):
    rows = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))]
    _local_dataset(monkeypatch, rows)
    # An untrained tiny model never writes \boxed{...}, so every reward would be 0 and every step skipped;
    # a reward that varies with the sampled text makes each step train.
    monkeypatch.setattr(rl_loop, "get_reward", lambda response, answer: float(len(response) % 2))
    # The recipe samples without a seed; give its SamplingParams one, so the rewards (and whether a step has
    # a non-constant group to train on) are the same on every run.
    monkeypatch.setattr(rl_loop.tinker.types, "SamplingParams", _SeededSamplingParams)
    log_path = tmp_path / "rl_loop"
    rl_loop.main(rl_loop.Config(base_url=cluster.http_url, log_path=str(log_path), model_name=MODEL_NAME,
                                batch_size=2, group_size=4, max_tokens=16, learning_rate=1e-4, lora_rank=8))
    steps = _logged_steps(log_path)
    assert [s["step"] for s in steps] == [0, 1]
    assert all("step:max" in s for s in steps)  # both steps trained (stable_reinforce, the default)
    assert _final_checkpoint(log_path)["sampler_path"].endswith("/sampler_weights/final")
