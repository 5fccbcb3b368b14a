"""A SwiGLU MLP's `down_proj` input is recomputed in backward instead of held (bios.kernels.recompute): it is
gone by the time the head runs, and the gradients are bit for bit those of holding it."""

from __future__ import annotations

import weakref

import torch
from test_frozen_matmul import adapted_smollm2_shaped

from bios.worker.engine import ForwardItem, forward_backward


def _pass(model, adapter, data) -> tuple[list[bool], torch.Tensor]:
    """One training pass: whether each layer's down_proj input is still alive when the head runs, and the
    adapter's gradient."""
    inputs: list[weakref.ref] = []
    alive: list[list[bool]] = []
    hooks = [layer.mlp.down_proj.register_forward_pre_hook(lambda module, args: inputs.append(weakref.ref(args[0])))
             for layer in model.model.layers]
    hooks.append(model.get_output_embeddings().register_forward_hook(
        lambda module, args, output: alive.append([ref() is not None for ref in inputs])))
    adapter.pending_grad.zero_()
    forward_backward(model, [ForwardItem(adapter, data, "cross_entropy")])
    for hook in hooks:
        hook.remove()
    return alive[0], adapter.pending_grad.clone()


def test_down_proj_input_is_recomputed_not_held_with_the_same_gradients(monkeypatch):
    model, adapter, data = adapted_smollm2_shaped(monkeypatch)
    alive, grad = _pass(model, adapter, data)
    assert alive == [False, False]
    # Under other saved-tensor hooks (as activation checkpointing installs) the input is held as before.
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        held, held_grad = _pass(model, adapter, data)
    assert held == [True, True]
    assert float(grad.abs().max()) > 0 and torch.equal(grad, held_grad)
