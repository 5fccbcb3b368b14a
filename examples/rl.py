"""Reinforcement learning: sample → reward → `importance_sampling` → `optim_step`, repeated.

The policy is `bios/tiny-llama` (byte-level tokens) and the reward is the share of lowercase letters in a
completion, so the mean reward climbs within a few dozen iterations.

    python examples/rl.py [STEPS]
"""

import sys

import bios
from bios import types

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 30
GROUP = 16  # completions per step; each one's advantage is its reward minus the group mean
PROMPT = types.ModelInput.from_ints(list(b"Say: "))
LOWERCASE = set(range(ord("a"), ord("z") + 1))


def reward(tokens: list[int]) -> float:
    return sum(t in LOWERCASE for t in tokens) / max(1, len(tokens))


def training_datum(sequence: types.SampledSequence, advantage: float) -> types.Datum:
    """Prompt + completion; the sampler's logprobs and the advantage on completion tokens, zeros on the prompt."""
    tokens = PROMPT.to_ints() + sequence.tokens
    prompt_targets = PROMPT.length - 1
    return types.Datum(
        types.ModelInput.from_ints(tokens[:-1]),
        {
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * prompt_targets + list(sequence.logprobs),
            "advantages": [0.0] * prompt_targets + [advantage] * len(sequence.tokens),
        },
    )


with bios.ServiceClient() as service:
    tc = service.create_lora_training_client(base_model="bios/tiny-llama", rank=16, seed=0)
    for step in range(STEPS):
        sampler = tc.save_weights_and_get_sampling_client()  # the current policy
        samples = sampler.sample(PROMPT, GROUP, types.SamplingParams(max_tokens=8, temperature=1.0)).result()
        rewards = [reward(s.tokens) for s in samples.sequences]
        mean = sum(rewards) / len(rewards)
        batch = [training_datum(s, r - mean) for s, r in zip(samples.sequences, rewards)]
        tc.forward_backward(batch, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        print(f"step {step:3d}  mean reward {mean:.3f}  best {max(rewards):.3f}")
