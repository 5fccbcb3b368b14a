"""`bios demo`: fine-tune a real model on a task it visibly fails, on the embedded cluster, and show the change.

The default run teaches SmolLM2-135M-Instruct ten facts about a made-up island and scores it on paraphrased
questions it never trained on; `--quick` runs the same pipeline with the tiny built-in model on a toy task.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from bios.demo.report import LOSS_PLOT, SUMMARY, print_report, write_loss_plot, write_summary
from bios.demo.run import DemoSettings, run_demo_job
from bios.demo.tasks import load_task
from bios.models import pull

# Measured on 2 shared CPU cores: the default run takes 4 minutes (7.4 under heavy load from other jobs),
# --quick 20 seconds (2 minutes under heavy load).
DEFAULT = DemoSettings(task="vellmora", base_model="HuggingFaceTB/SmolLM2-135M-Instruct", steps=14, batch_size=8,
                       learning_rate=2e-3, final_learning_rate=2e-4, rank=16, seed=0)
QUICK = DemoSettings(task="animal-sounds", base_model="bios/tiny-llama", steps=80, batch_size=8,
                     learning_rate=5e-3, final_learning_rate=2e-3, rank=16, seed=0)


def add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo", help="fine-tune SmolLM2-135M on the embedded cluster and compare it before and after",
        description="LoRA-fine-tune SmolLM2-135M-Instruct on facts about a made-up island, on an embedded local "
                    "cluster, and score it on held-out questions before and after.",
    )
    demo.add_argument("--quick", action="store_true",
                      help=f"the tiny built-in model ({QUICK.base_model}) on a toy task: a smoke test in seconds")
    demo.add_argument("--steps", type=int, default=None,
                      help=f"optimizer steps (default {DEFAULT.steps}, or {QUICK.steps} with --quick)")
    demo.add_argument("--seed", type=int, default=0, help="LoRA initialisation and data order (default 0)")
    demo.add_argument("--out", type=Path, default=Path("bios-demo"),
                      help=f"where to write {LOSS_PLOT} and {SUMMARY} (default bios-demo/)")
    demo.set_defaults(func=run_demo)


def settings_from(args: argparse.Namespace) -> DemoSettings:
    base = QUICK if args.quick else DEFAULT
    steps = base.steps if args.steps is None else args.steps
    if steps < 1:
        raise SystemExit(f"bios demo: --steps must be at least 1, got {steps}")
    return dataclasses.replace(base, steps=steps, seed=args.seed)


def run_demo(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    task = load_task(settings.task)
    print(f"task: {task.description}")
    print(f"model: {settings.base_model}; {len(task.train)} training questions, scored on {len(task.eval)} "
          f"{task.scored_on}")
    pull(settings.base_model)  # a no-op once cached; the first time, shows the download and conversion
    result = run_demo_job(settings, task)
    args.out.mkdir(parents=True, exist_ok=True)
    write_loss_plot(result, args.out / LOSS_PLOT)
    write_summary(result, args.out / SUMMARY)
    print_report(result, out_dir=args.out)
    return 0
