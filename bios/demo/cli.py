"""`bios demo`: teach a model a sentence on the embedded cluster and show the loss fall."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from bios import types
from bios.sdk.service import ServiceClient

TEXT = "Bios trains LoRA adapters for many users on one shared base model, one cycle at a time."


def add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser("demo", help="fine-tune a model on the embedded cluster and report the result")
    demo.add_argument("--quick", action="store_true", help="use bios/tiny-llama and a short run")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", type=Path, default=Path("bios-demo"))
    demo.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    tokens = list(TEXT.encode())
    datum = types.Datum(
        types.ModelInput.from_ints(tokens[:-1]),
        {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    started = time.monotonic()
    print("starting an embedded Bios cluster (coordinator + 1 worker)...", flush=True)
    with ServiceClient() as service:
        tc = service.create_lora_training_client("bios/tiny-llama", rank=16, seed=args.seed)
        before = tc.forward([datum]).result().loss / len(datum.model_input.to_ints())
        bar = tqdm(range(args.steps), desc="training", unit="step")
        for _ in bar:
            fwd = tc.forward_backward([datum])
            tc.optim_step(types.AdamParams(learning_rate=1e-2))
            bar.set_postfix(loss=f"{fwd.result().loss / len(tokens):.3f}")
        after = tc.forward([datum]).result().loss / len(datum.model_input.to_ints())
    summary = {"before": before, "after": after, "steps": args.steps, "seconds": time.monotonic() - started}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"mean loss per token: before {before:.3f}, after {after:.3f} (summary in {args.out}/summary.json)")
    return 0
