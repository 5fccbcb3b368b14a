"""Gradient accumulation: four forward_backward calls on quarter batches, then one optim_step with defaults.

    python examples/grad_accumulation.py [STEPS]
"""

import sys

import bios
from bios import types

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 10
TEXTS = [f"Example number {i}: gradients add up across forward_backward calls." for i in range(16)]


def datum(text: str) -> types.Datum:
    tokens = list(text.encode())
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


batch = [datum(t) for t in TEXTS]
quarters = [batch[i::4] for i in range(4)]

with bios.ServiceClient() as service:
    tc = service.create_lora_training_client(base_model="bios/tiny-llama", rank=16)
    for step in range(STEPS):
        futures = [tc.forward_backward(q, "cross_entropy") for q in quarters]
        opt = tc.optim_step()  # AdamParams() defaults: lr 1e-4, betas (0.9, 0.95)
        loss = sum(f.result().loss for f in futures)
        print(f"step {step:3d}  summed loss {loss:10.2f}  grad_norm {opt.result().grad_norm:8.3f}")
