"""A SwiGLU MLP's `down_proj` input is recomputed in backward instead of held (bios.kernels.recompute): it is
gone by the time the head runs, and the gradients are bit for bit those of holding it."""

from __future__ import annotations

import weakref

import torch
from test_kernel_integration import random_batch, smollm2_shaped

from bios.types import LoraConfig
from bios.worker.adapter import AdapterState
from bios.worker.engine import ForwardItem, forward_backward
from bios.worker.lora import attach_lora


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
    monkeypatch.setenv("BIOS_BASE_DTYPE", "float32")
    model = smollm2_shaped()
    attach_lora(model)
    adapter = AdapterState.create("run", model, LoraConfig(rank=8, seed=0), device="cpu")
    with torch.no_grad():
        adapter.params.add_(0.01 * torch.randn(adapter.params.shape, generator=torch.Generator().manual_seed(1)))
    data = random_batch(model.config.vocab_size, [14, 9, 20], seed=1)
    alive, grad = _pass(model, adapter, data)
    assert alive == [False, False]
    # Under other saved-tensor hooks (as activation checkpointing installs) the input is held as before.
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        held, held_grad = _pass(model, adapter, data)
    assert held == [True, True]
    assert float(grad.abs().max()) > 0 and torch.equal(grad, held_grad)
