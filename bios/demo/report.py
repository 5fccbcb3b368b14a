"""What the demo leaves behind: a loss-curve PNG, a JSON summary, and a before/after table on the terminal."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .run import DemoResult

LOSS_PLOT = "loss.png"
SUMMARY = "summary.json"


def summary(result: DemoResult) -> dict[str, Any]:
    task, training = result.task, result.training
    return {
        "task": task.name,
        "description": task.description,
        "before": result.before.score,
        "after": result.after.score,
        "settings": {
            **dataclasses.asdict(result.settings),
            "train_examples": len(task.train),
            "eval_examples": len(task.eval),
            "max_tokens": task.max_tokens,
            "system_prompt": task.system,
        },
        "timings": {key: round(value, 2) for key, value in result.timings.items()},
        "training": {
            "steps": len(training.losses),
            "tokens": training.tokens,
            "tokens_per_s": round(training.tokens / training.seconds, 1) if training.seconds else None,
            "first_loss": training.losses[0] if training.losses else None,
            "final_loss": training.losses[-1] if training.losses else None,
            "losses": training.losses,
        },
        "answers": [
            {"question": example.question, "expected": example.answer,
             "before": before, "before_correct": before_ok, "after": after, "after_correct": after_ok}
            for example, before, before_ok, after, after_ok in zip(
                task.eval, result.before.answers, result.before.correct, result.after.answers, result.after.correct)
        ],
    }


def write_summary(result: DemoResult, path: Path) -> None:
    path.write_text(json.dumps(summary(result), indent=2) + "\n")


def write_loss_plot(result: DemoResult, path: Path) -> None:
    """Loss per answer token at every step, with the before/after scores in the title."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    from matplotlib import pyplot as plt

    losses = result.training.losses
    figure, axes = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    axes.plot(range(1, len(losses) + 1), losses, color="#2b6cb0", linewidth=1.8)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss per answer token (nats)")
    axes.set_yscale("log")
    axes.grid(True, which="both", alpha=0.3)
    settings = result.settings
    axes.set_title(
        f"LoRA rank {settings.rank} on {settings.base_model}, task '{result.task.name}'\n"
        f"{result.task.scored_on} correct: {result.before.score:.0%} before, {result.after.score:.0%} after "
        f"({result.timings['training_s']:.0f}s of training)",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def print_report(result: DemoResult, *, examples: int = 5, out_dir: Path | None = None) -> None:
    task = result.task
    total = len(task.eval)
    print()
    never = " never trained on" if task.held_out else ""
    print(f"{task.scored_on} answered correctly ({total} questions{never}):")
    print(f"  before fine-tuning  {sum(result.before.correct):>3}/{total}  {result.before.score:6.0%}")
    print(f"  after fine-tuning   {sum(result.after.correct):>3}/{total}  {result.after.score:6.0%}")
    print()
    for index in _sample_rows(result, examples):
        print(f"Q: {task.eval[index].question}")
        print(f"   before  {_mark(result.before.answers[index], result.before.correct[index])}")
        print(f"   after   {_mark(result.after.answers[index], result.after.correct[index])}")
    timings = result.timings
    print()
    print(f"time: {timings['total_s']:.0f}s in all (start {timings['startup_s']:.0f}s, evaluations "
          f"{timings['eval_before_s']:.0f}s + {timings['eval_after_s']:.0f}s, training {timings['training_s']:.0f}s "
          f"at {result.training.tokens / max(timings['training_s'], 1e-9):.0f} tokens/s)")
    if out_dir is not None:
        print(f"wrote {out_dir / LOSS_PLOT} and {out_dir / SUMMARY}")


def _sample_rows(result: DemoResult, count: int) -> list[int]:
    """One question per fact, spread over the facts, so the rows show different answers."""
    first_of_key: dict[str, int] = {}
    for index, example in enumerate(result.task.eval):
        first_of_key.setdefault(example.key, index)
    rows = list(first_of_key.values())
    step = max(1, len(rows) // count)
    return rows[::step][:count]


def _mark(answer: str, correct: bool) -> str:
    return f"{'✓' if correct else '✗'} {' '.join(answer.split()) or '(empty)'}"
