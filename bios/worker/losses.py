"""The built-in losses, one datum at a time, as plain differentiable functions of the learner's log-probs.

Every loss is a SUM over the datum's tokens with no normalisation (Tinker's convention), so results add up
across datums, micro-batches, calls and workers. Notation: `logp` = the learner's log p(target_i) [N],
`q` = the sampler's log-probs (`inputs["logprobs"]`), `A` = `inputs["advantages"]`, `r = exp(logp - q)`,
`sg` = stop-gradient. Formulas for cross_entropy, importance_sampling, ppo and cispo are Tinker's documented
ones; dro, gspo and stable_reinforce have no public Tinker formula, so each docstring says which one we chose.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from bios import spec

LossCompute = Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], Tensor]


def _ratio(logp: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
    return torch.exp(logp - inputs["logprobs"])


def _clip_bounds(inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> tuple[Tensor | float, Tensor | float]:
    """Clip thresholds: per-token tensors in `inputs` win over the scalar config values."""
    low = inputs.get("clip_low_threshold", config["clip_low_threshold"])
    high = inputs.get("clip_high_threshold", config["clip_high_threshold"])
    return low, high


def _clip(ratio: Tensor, low: Tensor | float, high: Tensor | float) -> Tensor:
    if isinstance(low, Tensor) or isinstance(high, Tensor):
        low = torch.as_tensor(low, dtype=ratio.dtype, device=ratio.device)
        high = torch.as_tensor(high, dtype=ratio.dtype, device=ratio.device)
    return torch.clamp(ratio, low, high)


def _sampled_mask(inputs: Mapping[str, Tensor]) -> Tensor:
    """Which tokens are sampled completion tokens: `sequence_ratio_mask` if given, else tokens with A != 0.

    The Tinker cookbook gives prompt and observation tokens advantage 0 and sampler log-prob 0 and strips its
    own mask before sending, so A != 0 is the only mark of a sampled token a Tinker client leaves. A penalty
    towards q on prompt tokens (q = 0 there) would push their log-probs towards 0, hence the mask.
    """
    if "sequence_ratio_mask" in inputs:
        return inputs["sequence_ratio_mask"]
    return (inputs["advantages"] != 0).to(inputs["advantages"].dtype)


def cross_entropy(logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """`-(weights * logp).sum()`; weights may be any real number (forward_backward_custom sends -dL/dlogp)."""
    return -(inputs["weights"] * logp).sum()


def importance_sampling(logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """`-(r * A).sum()`: the policy gradient corrected for the sampler differing from the learner."""
    return -(_ratio(logp, inputs) * inputs["advantages"]).sum()


def ppo(logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """`-min(r * A, clip(r, low, high) * A).sum()`, thresholds from config (0.8, 1.2) or per-token inputs."""
    ratio = _ratio(logp, inputs)
    advantages = inputs["advantages"]
    clipped = _clip(ratio, *_clip_bounds(inputs, config))
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


def cispo(logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """`-(sg(clip(r, low, high)) * logp * A).sum()`: clipped importance weights that never stop a token's gradient."""
    weight = _clip(_ratio(logp, inputs), *_clip_bounds(inputs, config)).detach()
    return -(weight * logp * inputs["advantages"]).sum()


def dro(logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """`-(m * (A * logp - beta/2 * (logp - q)**2)).sum()`, m = sampled-token mask, beta from config (0.1).

    Direct Reward Optimisation (Richemond et al. 2024, "Offline Regularised Reinforcement Learning for LLM
    Alignment") minimises the squared residual `1/2 (A - beta * log(pi/q))**2` per token; dividing it by beta
    and dropping the constant gives this form, with the same minimiser and the same gradient direction, but
    whose on-policy gradient (logp = q) equals importance_sampling's, so a learning rate carries over. It is
    also verl's "dro" policy loss. The quadratic term keeps the learner near the sampler without clipping.
    """
    mask = _sampled_mask(inputs)
    residual = logp - inputs["logprobs"]
    return -(mask * (inputs["advantages"] * logp - 0.5 * config["beta"] * residual.square())).sum()


def gspo(logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """`-(m * min(s_t * A, clip(s_t, low, high) * A)).sum()` with the GSPO sequence ratio.

    GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): s = exp(mean over masked tokens of
    (logp - q)), m = `sequence_ratio_mask`. We use the paper's GSPO-token form s_t = sg(s) * exp(logp_t -
    sg(logp_t)) (value s, gradient flowing through each token) and, like every Tinker loss, sum over tokens
    rather than average, so on-policy its gradient equals importance_sampling's. Clipping is decided per
    sequence on s; default thresholds are the paper's 1 - 3e-4 and 1 + 4e-4 (sequence ratios stay close to
    1), overridable in config or per token.
    """
    mask = inputs["sequence_ratio_mask"]
    seq_log_ratio = (mask * (logp - inputs["logprobs"])).sum() / mask.sum().clamp(min=1)
    token_ratio = torch.exp(seq_log_ratio.detach() + logp - logp.detach())
    advantages = inputs["advantages"]
    clipped = _clip(token_ratio, *_clip_bounds(inputs, config))
    return -(mask * torch.minimum(token_ratio * advantages, clipped * advantages)).sum()


def stable_reinforce(logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """importance_sampling plus `kl_coeff * (m * k3).sum()`, k3 = exp(q - logp) - (q - logp) - 1, m = sampled mask.

    Tinker's version uses stability info its sampler recorded per sequence, which a client cannot send; the
    fallback the wire notes suggest is importance sampling with a small KL penalty towards the sampler. k3 is
    Schulman's non-negative KL estimator as GRPO uses it (here KL(learner || sampler)); kl_coeff defaults to
    the cookbook's 0.01.
    """
    mask = _sampled_mask(inputs)
    log_ratio = inputs["logprobs"] - logp
    k3 = torch.exp(log_ratio) - log_ratio - 1
    return importance_sampling(logp, inputs, config) + config["kl_coeff"] * (mask * k3).sum()


COMPUTE: dict[str, LossCompute] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
}
assert COMPUTE.keys() == spec.LOSSES.keys(), "every loss of the request spec needs its computation here"


def fixed_token_weights(loss_fn: str, inputs: Mapping[str, Tensor]) -> Tensor | None:
    """`c` when the loss is `-(c * logp).sum()` with `c` known before any forward (cross_entropy: its
    weights), else None. Such a loss's gradient w.r.t. the log-probs is `-c` whatever the log-probs are, which
    lets the output head accumulate every gradient in its one forward (`bios.kernels.linear_weighted_loss`)."""
    return inputs["weights"] if loss_fn == "cross_entropy" else None


def compute_loss(
    loss_fn: str, logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float] | None
) -> Tensor:
    """The summed loss of one datum. `logprobs` [N] is the learner's log p(target); `inputs` that datum's inputs.

    The request passed the worker's wall (`engine.check_item`: a known loss, its config keys in range, every
    input it reads present and [N]), so nothing is checked here; `config` is laid over the loss's defaults.
    Inputs the loss does not read are ignored.
    """
    loss = spec.LOSSES[loss_fn]
    resolved = {**loss.defaults, **{key: float(value) for key, value in (config or {}).items()}}
    used = {
        key: inputs[key] if key == "target_tokens" else inputs[key].to(dtype=logprobs.dtype, device=logprobs.device)
        for key in (*loss.required_inputs, *loss.optional_inputs)
        if key in inputs
    }
    return COMPUTE[loss_fn](logprobs, used, resolved)
