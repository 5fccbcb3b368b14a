"""Each built-in loss equals a hand-written per-token reference, in value and in gradient."""

from __future__ import annotations

import math

import pytest
import torch

from bios.exceptions import BadRequestError
from bios import types as t
from bios.spec import LOSSES
from bios.worker.engine import check_item
from bios.worker.losses import COMPUTE, compute_loss

N = 24


def _inputs(seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Learner log-probs spread around the sampler's so ratios fall below, inside and above the clip range."""
    generator = torch.Generator().manual_seed(seed)
    q = -torch.rand(N, generator=generator, dtype=torch.float64) * 3 - 0.05
    logp = q + torch.randn(N, generator=generator, dtype=torch.float64) * 0.5
    advantages = torch.randn(N, generator=generator, dtype=torch.float64)
    inputs = {
        "target_tokens": torch.randint(0, 100, (N,), generator=generator),
        "weights": torch.randn(N, generator=generator, dtype=torch.float64),
        "logprobs": q,
        "advantages": advantages,
        "sequence_ratio_mask": (torch.arange(N) >= 4).to(torch.float64),
    }
    return logp, inputs


def _value_and_grad(loss_fn, logp, inputs, config=None):
    leaf = logp.clone().requires_grad_(True)
    loss = compute_loss(loss_fn, leaf, inputs, config)
    loss.backward()
    return loss.item(), leaf.grad


def _clip(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def _ppo_like(logp, inputs, low, high):
    """-(sum of min(r A, clip(r) A)) per token, and its gradient: -r A where the unclipped term is the min."""
    value, grad = 0.0, []
    for t in range(N):
        r = math.exp(logp[t] - inputs["logprobs"][t])
        a = float(inputs["advantages"][t])
        lo = float(low[t]) if isinstance(low, torch.Tensor) else low
        hi = float(high[t]) if isinstance(high, torch.Tensor) else high
        unclipped, clipped = r * a, _clip(r, lo, hi) * a
        value -= min(unclipped, clipped)
        grad.append(-r * a if unclipped <= clipped else 0.0)
    return value, torch.tensor(grad, dtype=torch.float64)


def test_cross_entropy():
    logp, inputs = _inputs()
    value, grad = _value_and_grad("cross_entropy", logp, inputs)
    assert value == pytest.approx(-sum(float(w * lp) for w, lp in zip(inputs["weights"], logp)), rel=1e-12)
    torch.testing.assert_close(grad, -inputs["weights"])


def test_importance_sampling():
    logp, inputs = _inputs(1)
    value, grad = _value_and_grad("importance_sampling", logp, inputs)
    ratios = [math.exp(lp - q) for lp, q in zip(logp.tolist(), inputs["logprobs"].tolist())]
    advantages = inputs["advantages"].tolist()
    assert value == pytest.approx(-sum(r * a for r, a in zip(ratios, advantages)), rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([-r * a for r, a in zip(ratios, advantages)], dtype=torch.float64))


def test_ppo_clips_on_both_sides_with_default_thresholds():
    logp, inputs = _inputs(2)
    ratios = torch.exp(logp - inputs["logprobs"])
    assert (ratios < 0.8).any() and (ratios > 1.2).any() and ((ratios > 0.8) & (ratios < 1.2)).any()
    value, grad = _value_and_grad("ppo", logp, inputs)
    want_value, want_grad = _ppo_like(logp.tolist(), inputs, 0.8, 1.2)
    assert value == pytest.approx(want_value, rel=1e-12)
    torch.testing.assert_close(grad, want_grad)
    assert (grad == 0).any() and (grad != 0).any()  # some tokens are clipped away, others are not


def test_ppo_config_and_per_token_thresholds():
    logp, inputs = _inputs(3)
    value, grad = _value_and_grad("ppo", logp, inputs, {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5})
    want_value, want_grad = _ppo_like(logp.tolist(), inputs, 0.5, 1.5)
    assert value == pytest.approx(want_value, rel=1e-12)
    torch.testing.assert_close(grad, want_grad)

    low = torch.linspace(0.6, 0.95, N, dtype=torch.float64)
    high = torch.linspace(1.05, 1.6, N, dtype=torch.float64)
    per_token = {**inputs, "clip_low_threshold": low, "clip_high_threshold": high}
    value, grad = _value_and_grad("ppo", logp, per_token, {"clip_low_threshold": 0.1, "clip_high_threshold": 9.0})
    want_value, want_grad = _ppo_like(logp.tolist(), inputs, low, high)
    assert value == pytest.approx(want_value, rel=1e-12)
    torch.testing.assert_close(grad, want_grad)


def test_cispo_stops_the_gradient_through_the_clipped_weight():
    logp, inputs = _inputs(4)
    value, grad = _value_and_grad("cispo", logp, inputs, {"clip_high_threshold": 1.1})
    want_value, want_grad = 0.0, []
    for lp, q, a in zip(logp.tolist(), inputs["logprobs"].tolist(), inputs["advantages"].tolist()):
        weight = _clip(math.exp(lp - q), 0.0, 1.1)
        want_value -= weight * lp * a
        want_grad.append(-weight * a)  # no d(weight)/dlogp term
    assert value == pytest.approx(want_value, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64))


def test_dro():
    logp, inputs = _inputs(5)
    value, grad = _value_and_grad("dro", logp, inputs, {"beta": 0.3})
    mask = inputs["sequence_ratio_mask"].tolist()
    want_value, want_grad = 0.0, []
    for lp, q, a, m in zip(logp.tolist(), inputs["logprobs"].tolist(), inputs["advantages"].tolist(), mask):
        want_value -= m * (a * lp - 0.15 * (lp - q) ** 2)
        want_grad.append(-m * (a - 0.3 * (lp - q)))
    assert value == pytest.approx(want_value, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64))


def test_gspo_uses_one_length_normalised_ratio_per_sequence():
    logp, inputs = _inputs(6)
    mask = inputs["sequence_ratio_mask"].tolist()
    log_ratios = [lp - q for lp, q in zip(logp.tolist(), inputs["logprobs"].tolist())]
    s = math.exp(sum(m * d for m, d in zip(mask, log_ratios)) / sum(mask))
    for low, high in ((0.5, 2.0), (s + 0.01, s + 0.02)):  # unclipped, then s clipped from below
        value, grad = _value_and_grad("gspo", logp, inputs, {"clip_low_threshold": low, "clip_high_threshold": high})
        want_value, want_grad = 0.0, []
        for m, a in zip(mask, inputs["advantages"].tolist()):
            unclipped, clipped = s * a, _clip(s, low, high) * a
            want_value -= m * min(unclipped, clipped)
            want_grad.append(-m * s * a if unclipped <= clipped else 0.0)
        assert value == pytest.approx(want_value, rel=1e-12)
        torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64))


def test_stable_reinforce_adds_a_k3_penalty_on_sampled_tokens_only():
    logp, inputs = _inputs(7)
    del inputs["sequence_ratio_mask"]
    inputs["advantages"][:4] = 0.0  # prompt tokens: advantage 0 and sampler log-prob 0 (Tinker convention)
    inputs["logprobs"][:4] = 0.0
    value, grad = _value_and_grad("stable_reinforce", logp, inputs, {"kl_coeff": 0.2})
    want_value, want_grad = 0.0, []
    for t, (lp, q, a) in enumerate(zip(logp.tolist(), inputs["logprobs"].tolist(), inputs["advantages"].tolist())):
        r = math.exp(lp - q)
        sampled = 1.0 if t >= 4 else 0.0
        want_value += -r * a + 0.2 * sampled * (math.exp(q - lp) - (q - lp) - 1)
        want_grad.append(-r * a + 0.2 * sampled * (1 - math.exp(q - lp)))
    assert value == pytest.approx(want_value, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64))
    assert (grad[:4] == 0).all()


def test_every_loss_declares_its_inputs_and_runs():
    logp, inputs = _inputs(8)
    assert set(LOSSES) == set(COMPUTE) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo",
                                           "stable_reinforce"}
    assert set(LOSSES) == set(t.LossFnType.__args__)  # the public Literal names the spec's losses
    for name in LOSSES:
        assert "target_tokens" in LOSSES[name].required_inputs
        value, grad = _value_and_grad(name, logp, inputs)
        assert math.isfinite(value) and torch.isfinite(grad).all()


def test_bad_requests_are_refused_at_the_workers_wall_with_clear_errors():
    """The losses compute what passed the worker's one wall (`engine.check_item`), which refuses the rest."""
    _, inputs = _inputs(9)

    def check(loss_fn, config=None, **changed):
        given = {key: value for key, value in {**inputs, **changed}.items() if value is not None}
        datum = t.Datum(t.ModelInput.from_ints(list(range(N))),
                        {key: t.TensorData.from_torch(value) for key, value in given.items()})
        check_item([datum], loss_fn, config, None, None)

    with pytest.raises(BadRequestError, match="unknown loss_fn 'nope'"):
        check("nope")
    with pytest.raises(BadRequestError, match=r"\['clip_ratio'\].*clip_high_threshold"):
        check("ppo", {"clip_ratio": 0.2})
    with pytest.raises(BadRequestError, match="accepts no keys"):
        check("cross_entropy", {"beta": 0.1})
    with pytest.raises(BadRequestError, match="finite"):
        check("dro", {"beta": float("nan")})
    with pytest.raises(BadRequestError, match="must not exceed"):
        check("ppo", {"clip_low_threshold": 1.5})
    with pytest.raises(BadRequestError, match=r"lacks 'advantages', which importance_sampling needs"):
        check("importance_sampling", advantages=None)
    with pytest.raises(BadRequestError, match=r"loss_fn_inputs\['weights'\] has 23 entries but model_input has 24"):
        check("cross_entropy", weights=inputs["weights"][:-1])
    for name in LOSSES:
        check(name)  # every loss's inputs pass as they are
