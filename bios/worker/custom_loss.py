"""Run a checked custom loss (`bios.custom_loss`) on one datum, with gradients, by interpreting its nodes.

Each node's target is looked up in `bios.custom_loss`'s allow-lists and resolved to the torch / math / operator
function of that name (`getattr` on those modules, never `eval`); arguments are decoded from their plain-data
form. A `{"device": ...}` argument means the datum's device: a loss cannot move tensors elsewhere.
"""

from __future__ import annotations

import builtins
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from bios import custom_loss as rules
from bios import types as t
from bios.exceptions import BadRequestError

_MODULES = {"torch": torch, "torch.nn.functional": torch.nn.functional, "math": math, "operator": operator,
            "builtins": builtins}


def _function(target: str) -> Callable[..., Any]:
    if target not in rules.ALLOWED_FUNCTIONS:  # checked at acceptance; a worker checks again before resolving
        raise BadRequestError(f"custom loss calls {target!r}, which Bios does not allow", field="graph.nodes")
    module, _, name = target.rpartition(".")
    return getattr(_MODULES[module], name)


def check_custom_inputs(loss: t.CustomLoss, inputs: Mapping[str, t.TensorData], num_tokens: int, where: str) -> None:
    """BadRequestError unless a datum has every input of rank 0 or 2 the loss reads, at that rank (a rank-2 one
    over the datum's tokens). Its rank-1 inputs are the request spec's to check (`spec.check_forward` requires
    each, shaped [tokens]): with this, the worker's wall (`engine.check_item`) covers every input a loss reads."""
    for item in loss.inputs[1:]:
        if item.rank == 1:
            continue
        field = f"{where}.loss_fn_inputs.{item.name}"
        if item.name not in inputs:
            raise BadRequestError(f"{where}: custom loss {loss.name!r} reads loss_fn_inputs[{item.name!r}], which "
                                  "the datum lacks", field=field)
        shape = tuple(inputs[item.name].shape)
        if len(shape) != item.rank or (item.rank >= 1 and shape[0] != num_tokens):
            raise BadRequestError(f"{where}.loss_fn_inputs[{item.name!r}] has shape {shape}; custom loss "
                                  f"{loss.name!r} declared rank {item.rank} over the datum's {num_tokens} tokens",
                                  field=field)


class CompiledLoss:
    """A custom loss ready to run: `loss(logprobs [T], inputs) -> (scalar loss, metrics)`. Its data is checked
    by the worker's wall (`engine.check_item`, with `graph`), not here."""

    def __init__(self, loss: t.CustomLoss) -> None:
        rules.check_custom_loss(loss)
        self.graph = loss
        self.name = loss.name
        self.inputs = loss.inputs
        self._nodes = loss.nodes
        self._functions = {node.name: _function(node.target) for node in loss.nodes if node.op == "call_function"}

    def __call__(self, logprobs: Tensor, inputs: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        values: dict[str, Any] = {}
        feeds = [logprobs] + [_as_float(inputs[item.name], logprobs) for item in self.inputs[1:]]
        placeholder = 0
        for node in self._nodes:
            if node.op == "placeholder":
                values[node.name] = feeds[placeholder]
                placeholder += 1
                continue
            args = [_decode(a, values, logprobs) for a in node.args]
            kwargs = {key: _decode(a, values, logprobs) for key, a in node.kwargs.items()}
            if node.op == "call_function":
                values[node.name] = self._functions[node.name](*args, **kwargs)
            elif node.op == "call_method":
                values[node.name] = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:  # output, last (checked)
                loss, metrics = args[0]
                if not isinstance(loss, Tensor) or loss.ndim != 0:
                    raise BadRequestError(f"custom loss {self.name!r} must return a scalar tensor loss",
                                          field="graph.nodes")
                return loss, metrics
        raise AssertionError("a checked graph ends in its output node")


def _as_float(value: Tensor, logprobs: Tensor) -> Tensor:
    value = value.to(logprobs.device)
    return value.to(logprobs.dtype) if value.is_floating_point() else value


def _decode(value: Any, values: Mapping[str, Any], like: Tensor) -> Any:
    if isinstance(value, list):
        return [_decode(v, values, like) for v in value]
    if not isinstance(value, dict):
        return value
    (kind, inner), = value.items()
    if kind == "ref":
        return values[inner]
    if kind == "tuple":
        return tuple(_decode(v, values, like) for v in inner)
    if kind == "dict":
        return {key: _decode(v, values, like) for key, v in inner.items()}
    if kind == "slice":
        return slice(*(_decode(v, values, like) for v in inner))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "float":
        return float(inner)
    if kind == "dtype":
        return getattr(torch, inner)
    if kind == "device":
        return like.device
    if kind == "layout":
        return torch.strided
    return torch.contiguous_format  # memory_format, the only other kind a checked graph holds
