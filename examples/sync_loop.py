"""The plain synchronous loop: forward_backward + optim_step, printing loss, grad norm, throughput and LR.

    python examples/sync_loop.py [STEPS]
"""

import sys
import time

import bios
from bios import types

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 30
TEXTS = [
    "Bios is a self-hostable LoRA fine-tuning service.",
    "Many users' adapters share one copy of the base model.",
    "The coordinator schedules work on a fixed cycle clock.",
    "Workers sum gradients with torch.distributed collectives.",
]


def datum(text: str) -> types.Datum:
    tokens = list(text.encode())  # bios/tiny-llama's tokenizer is byte-level
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


batch = [datum(t) for t in TEXTS]
tokens_per_step = sum(d.model_input.length for d in batch)

with bios.ServiceClient() as service:
    tc = service.create_lora_training_client(base_model="bios/tiny-llama", rank=16)
    for step in range(STEPS):
        started = time.perf_counter()
        fwd = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        loss, grad_norm, lr = fwd.result().loss, fwd.result().grad_norm, opt.result().learning_rate
        rate = tokens_per_step / (time.perf_counter() - started)
        print(f"step {step:3d}  loss/token {loss / tokens_per_step:.4f}  grad_norm {grad_norm:8.3f}  "
              f"{rate:8.0f} tok/s  lr {lr:g}")
