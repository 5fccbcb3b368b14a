"""Replicas following the work between a tensor-parallel group and an unsplit one, in a running cluster, against
one worker in the same run (issue 37, build step 4: `bios.coordinator.placement._rebalance`).

Five CPU workers whose `--memory-limit` holds the built-in tiny model whole but tests/tp_model.py's Llama only
split over two. The tiny model's run trains a step (five unsplit replicas); the large model's run is created
(its group takes two of them, tensor-parallel over two) and trains: the tiny model's idle replicas move to it
(two unsplit workers become one more split replica). Then the tiny model's run trains for longer than
`MOVE_INTERVAL_S`: one split replica becomes two unsplit ones again. The same steps on one worker give every
loss and the final adapters; the script prints the groups at each move, the largest loss difference, and the
largest weight difference (fp32 summation order only: a step lost or run twice moves every weight by about lr).

    python bench/replica_moves.py [--small-steps 400] [--large-steps 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from machine import describe_machine  # noqa: E402
from tp_model import RANK, tp2_only_memory_limit, write_tp_model  # noqa: E402

import bios  # noqa: E402
from bios import types  # noqa: E402

BASE = "bios/tiny-llama"
# A low learning rate: 400 Adam steps on one batch at 2.5e-4 turn fp32 summation-order noise (1e-7) into 1e-2
# loss differences (chaotic, with or without a move); at 2e-5 they stay at summation order.
LR = 2e-5
PARAMS = types.AdamParams(learning_rate=LR)
BATCH = [types.Datum(types.ModelInput.from_ints(list(row[:-1])), {"target_tokens": list(row[1:]),
                                                                  "weights": [1.0] * (len(row) - 1)})
         for row in (f"Replica move sentence {i}: the work decides.".encode() for i in range(6))]


def _groups(svc) -> dict[str, tuple[int, int]]:
    """Model (last path part) -> (tensor-parallel size, replicas) of each group."""
    return {g.models[0].rsplit("/", 1)[-1]: (g.tp, g.replicas) for g in svc.cluster_status().groups}


def _step(tc) -> float:
    loss = tc.forward_backward(BATCH)
    tc.optim_step(PARAMS).result(300)
    return loss.result(300).loss


def run(large: str, steps: list[tuple[str, int]], **cluster) -> dict:
    """Train the plan's phases; every loss, each run's final adapter, the groups seen."""
    workers = cluster["workers"]
    with bios.LocalCluster(**cluster) as c, bios.ServiceClient(address=c.address) as svc:
        deadline = time.monotonic() + 120
        while sum(w.state != "dead" for w in svc.cluster_status().workers) < workers:
            assert time.monotonic() < deadline, "the workers never registered"
            time.sleep(0.2)
        clients = {"tiny": svc.create_lora_training_client(BASE, rank=RANK, seed=31)}
        losses = {"tiny": [_step(clients["tiny"])], "large": []}
        clients["large"] = svc.create_lora_training_client(large, rank=RANK, seed=31)
        seen = [("start", _groups(svc))]
        for who, count in steps:
            for _ in range(count):
                losses[who].append(_step(clients[who]))
                if (now := _groups(svc)) != seen[-1][1]:
                    seen.append((f"{who} step {len(losses[who])}", now))
        adapters = {who: svc.create_rest_client().download_checkpoint(tc.save_state().result(120).path).result().adapter
                    for who, tc in clients.items()}
        return {"losses": losses, "adapters": adapters, "seen": seen, "notes": svc.cluster_status().placement_notes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small-steps", type=int, default=400)
    parser.add_argument("--large-steps", type=int, default=8)
    args = parser.parse_args()
    print(describe_machine())
    large = str(write_tp_model(Path(tempfile.mkdtemp()) / "large"))
    plan = [("large", args.large_steps), ("tiny", args.small_steps), ("large", 2)]
    one = run(large, plan, workers=1, worker_threads=1, env={"BIOS_BASE_DTYPE": "float32"})
    five = run(large, plan, workers=5, worker_threads=1, env={"BIOS_BASE_DTYPE": "float32"},
               worker_memory_limit=tp2_only_memory_limit(Path(large)))
    for when, groups in five["seen"]:
        print(f"{when:>18}: " + ", ".join(f"{m} {r} replica(s) x {tp}" for m, (tp, r) in sorted(groups.items())))
    for note in five["notes"]:
        print(f"  placed: {note}")
    for who in ("tiny", "large"):
        pairs = list(zip(one["losses"][who], five["losses"][who], strict=True))
        loss = max(abs(a - b) / abs(a) for a, b in pairs)
        diffs = [abs(one["adapters"][who][k] - five["adapters"][who][k]).ravel() for k in one["adapters"][who]]
        largest, off = max(float(d.max()) for d in diffs), sum(int((d > LR / 2).sum()) for d in diffs)
        print(f"{who}: {len(pairs)} steps, largest loss difference {loss:.1e} (relative); against one worker the "
              f"largest weight difference is {largest:.1e}, and {off} of {sum(d.size for d in diffs)} weights "
              "differ by more than lr/2")


if __name__ == "__main__":
    main()
