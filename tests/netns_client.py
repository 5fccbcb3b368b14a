"""The client host of tests/test_multihost.py: a Bios SDK client run in its own network namespace, driven by the
test through one JSON command per line on stdin, one JSON answer per line on stdout.

It reads BIOS_ADDRESS and BIOS_API_KEY like any script pointed at a cluster. Commands:
  {"cmd": "create", "base_model": ..., "seed": N}          -> {"run": i}
  {"cmd": "submit", "run": i, "steps": N}                   -> {"ticket": t}, once the coordinator accepted them
  {"cmd": "results", "ticket": t}                           -> {"losses": [...], "steps": [...]}
  {"cmd": "weights", "run": i, "path": FILE}                -> {"path": FILE} (the adapter as .npz)
  {"cmd": "sample", "run": i}                               -> {"tokens": [[...]], "logprobs": [...]}
  {"cmd": "status"}                                         -> workers, generation, queue depth, plans, cycle_s
Any failure answers {"error": "..."}.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

import bios
from bios import types

BATCH_TEXTS = [f"Sentence {i} crosses hosts: gradients meet over gloo between namespaces." for i in range(8)]
PARAMS = types.AdamParams(learning_rate=1e-3)  # see tests/test_elastic.py: 1e-3 keeps DP within 1e-5 of one worker
RESULT_TIMEOUT_S = 180


def _datum(text: str) -> types.Datum:
    tokens = list(text.encode())
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


class Driver:
    def __init__(self, service: bios.ServiceClient) -> None:
        self.service = service
        self.batch = [_datum(text) for text in BATCH_TEXTS]
        self.runs: list[Any] = []
        self.tickets: list[list[Any]] = []

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        cmd = command["cmd"]
        if cmd == "create":
            tc = self.service.create_lora_training_client(command["base_model"], rank=8, seed=command["seed"])
            self.runs.append(tc)
            return {"run": len(self.runs) - 1, "plan": tc.get_info().memory_plan}
        if cmd == "submit":
            tc = self.runs[command["run"]]
            futures = []
            for _ in range(command["steps"]):
                futures += [tc.forward_backward(self.batch), tc.optim_step(PARAMS)]
            for future in futures:
                future._accepted.result(60)
            self.tickets.append(futures)
            return {"ticket": len(self.tickets) - 1}
        if cmd == "results":
            futures = self.tickets[command["ticket"]]
            return {"losses": [f.result(RESULT_TIMEOUT_S).loss for f in futures[0::2]],
                    "steps": [f.result(RESULT_TIMEOUT_S).metrics["step:max"] for f in futures[1::2]]}
        if cmd == "weights":
            path = self.runs[command["run"]].save_state().result(RESULT_TIMEOUT_S).path
            adapter = self.service.create_rest_client().download_checkpoint(path).result().adapter
            np.savez(command["path"], **adapter)
            return {"path": command["path"]}
        if cmd == "sample":
            sampler = self.runs[command["run"]].save_weights_and_get_sampling_client()
            params = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
            sequences = sampler.sample(types.ModelInput.from_ints(list(b"Sentence")), 2, params)
            sequences = sequences.result(RESULT_TIMEOUT_S).sequences
            return {"tokens": [s.tokens for s in sequences], "logprobs": [lp for s in sequences for lp in s.logprobs]}
        if cmd == "status":
            status = self.service.cluster_status()
            return {"workers": [{"worker_id": w.worker_id, "pid": w.pid, "state": w.state} for w in status.workers],
                    "generation": status.generation, "queue_depth": status.queue_depth, "plans": status.plans,
                    "cycle_s": self.service.get_server_capabilities().cycle_s}
        raise ValueError(f"unknown command {cmd!r}")


def main() -> None:
    with bios.ServiceClient() as service:
        driver = Driver(service)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            try:
                answer = driver.handle(json.loads(line))
            except Exception as exc:
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
