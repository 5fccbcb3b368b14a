"""What a server-side custom loss may contain: the allow-list of operations and the structural rules of its graph.

A custom loss arrives as torch.fx nodes encoded as plain data (the tinker SDK's `CustomLossGraph`). Nothing in it
is executed as code: the coordinator checks every node here at acceptance (no torch needed), and a worker
rebuilds it by looking each target up in these same tables (`bios.worker.custom_loss`), so an operation is
either named here or refused with a BadRequestError naming it. No pickles, no `eval`.

The graph must take exactly its declared inputs (`logprobs` first, rank 1: Bios computes the target tokens'
log-probabilities, [T]) and return `(loss, metrics)`, metrics keyed `custom/<name>:sum` or `:mean`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from bios import types as t
from bios.exceptions import BadRequestError

# Functions a node may call, by the qualified name the tinker SDK sends. All are pure tensor math.
_TORCH_MATH = (
    "abs", "add", "clamp", "clip", "cos", "div", "exp", "expm1", "log", "log1p", "log_softmax", "logsigmoid",
    "logsumexp", "max", "maximum", "mean", "min", "minimum", "mul", "neg", "pow", "reciprocal", "relu", "rsqrt",
    "sigmoid", "sign", "sin", "softmax", "sqrt", "square", "sub", "sum", "tanh", "where", "ones_like",
    "zeros_like", "full_like", "stack", "cat", "gather", "masked_fill", "exp2", "prod", "cumsum", "isfinite",
    "nan_to_num", "detach",
)
ALLOWED_FUNCTIONS: frozenset[str] = frozenset(
    [f"torch.{name}" for name in _TORCH_MATH]
    + [f"torch.nn.functional.{name}" for name in ("relu", "softplus", "logsigmoid", "log_softmax", "softmax",
                                                  "sigmoid", "tanh")]
    + [f"math.{name}" for name in ("exp", "log", "sqrt", "log1p", "expm1")]
    + [f"operator.{name}" for name in ("add", "sub", "mul", "truediv", "floordiv", "neg", "pos", "pow", "abs",
                                       "getitem", "lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "invert")]
    + ["builtins.getattr"]
)
# Tensor methods a node may call (`call_method`).
ALLOWED_METHODS: frozenset[str] = frozenset((
    "abs", "add", "clamp", "clamp_max", "clamp_min", "clip", "detach", "div", "exp", "expm1", "float", "gather",
    "log", "log1p", "log_softmax", "logsumexp", "masked_fill", "max", "mean", "min", "mul", "neg", "pow",
    "reshape", "rsqrt", "sigmoid", "sign", "size", "softmax", "sqrt", "square", "squeeze", "sub", "sum", "tanh",
    "unsqueeze", "view", "where", "cumsum", "prod", "sum_to_size", "double", "exp2", "nan_to_num",
))
# Attributes `builtins.getattr` may read.
ALLOWED_ATTRIBUTES: frozenset[str] = frozenset(("shape", "ndim", "dtype", "T"))
ALLOWED_DTYPES: frozenset[str] = frozenset(("float32", "float64", "int64", "bool"))
_NODE_OPS = ("placeholder", "call_function", "call_method", "output")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
MAX_NODES = 4096
MAX_INPUTS = 16


def check_custom_loss(loss: t.CustomLoss) -> None:
    """BadRequestError naming the problem (the op, for an operation outside the allow-list) unless `loss` is a
    graph Bios can run."""
    where = f"custom loss {loss.name!r}"
    if loss.format != 1:
        raise BadRequestError(f"{where} has graph format {loss.format!r}; Bios reads format 1", field="graph.format")
    _check_inputs(loss, where)
    if not 0 < len(loss.nodes) <= MAX_NODES:
        raise BadRequestError(f"{where} has {len(loss.nodes)} nodes; a loss has 1 to {MAX_NODES}", field="graph.nodes")
    defined: set[str] = set()
    placeholders: list[str] = []
    for index, node in enumerate(loss.nodes):
        at = f"{where} node {index} ({node.name!r})"
        if node.op not in _NODE_OPS:
            raise BadRequestError(f"{at} is a {node.op!r} node; a custom loss may only call functions and tensor "
                                  "methods (no modules, no captured tensors)", field="graph.nodes")
        if not isinstance(node.name, str) or not node.name or node.name in defined:
            raise BadRequestError(f"{at} has an empty or repeated name", field="graph.nodes")
        for ref in _refs(node.args, at) if node.op != "placeholder" else ():
            if ref not in defined:
                raise BadRequestError(f"{at} uses {ref!r} before it is defined", field="graph.nodes")
        for ref in _refs(list(node.kwargs.values()), at):
            if ref not in defined:
                raise BadRequestError(f"{at} uses {ref!r} before it is defined", field="graph.nodes")
        if node.op == "placeholder":
            placeholders.append(node.target)
        elif node.op == "call_function" and node.target not in ALLOWED_FUNCTIONS:
            raise BadRequestError(f"{at} calls {node.target!r}, which is not an operation Bios allows in a custom "
                                  "loss (pure torch/math tensor functions only)", field="graph.nodes")
        elif node.op == "call_method" and node.target not in ALLOWED_METHODS:
            raise BadRequestError(f"{at} calls tensor method {node.target!r}, which is not an operation Bios allows "
                                  "in a custom loss", field="graph.nodes")
        if node.op == "call_function" and node.target == "builtins.getattr":
            attribute = node.args[1] if len(node.args) == 2 else None
            if attribute not in ALLOWED_ATTRIBUTES:
                raise BadRequestError(f"{at} reads attribute {attribute!r}; a custom loss may read only "
                                      f"{sorted(ALLOWED_ATTRIBUTES)}", field="graph.nodes")
        if node.op == "output" and index != len(loss.nodes) - 1:
            raise BadRequestError(f"{at}: the output node must come last", field="graph.nodes")
        defined.add(node.name)
    names = [i.name for i in loss.inputs]
    if placeholders != names:
        raise BadRequestError(f"{where} takes {placeholders}, but declares inputs {names}", field="inputs")
    _check_output(loss.nodes[-1], where)


def _check_inputs(loss: t.CustomLoss, where: str) -> None:
    names = [i.name for i in loss.inputs]
    if not names or names[0] != "logprobs" or len(names) > MAX_INPUTS or len(set(names)) != len(names):
        raise BadRequestError(f"{where} inputs must be logprobs then up to {MAX_INPUTS - 1} distinct loss_fn_inputs "
                              f"keys, got {names}", field="inputs")
    if loss.inputs[0].rank != 1:
        raise BadRequestError(f"{where} takes logprobs with rank {loss.inputs[0].rank}; Bios gives a loss the "
                              "target tokens' log-probabilities, rank 1 ([T])", field="inputs")
    for item in loss.inputs[1:]:
        if item.name == "logprobs" or item.rank not in (0, 1, 2):
            raise BadRequestError(f"{where} input {item.name!r} has rank {item.rank!r}; ranks are 0, 1 or 2",
                                  field="inputs")


def _check_output(node: t.CustomLossNode, where: str) -> None:
    output = node.args[0] if node.op == "output" and len(node.args) == 1 else None
    parts = output.get("tuple") if isinstance(output, dict) else output
    if not (isinstance(parts, list) and len(parts) == 2 and isinstance(parts[0], dict) and "ref" in parts[0]
            and isinstance(parts[1], dict) and isinstance(parts[1].get("dict"), dict)):
        raise BadRequestError(f"{where} must end in an output node returning (loss, metrics)", field="graph.nodes")
    for key in parts[1]["dict"]:
        if not _METRIC_KEY.fullmatch(key):
            raise BadRequestError(f"{where} metric {key!r} must be named custom/<name>:sum or custom/<name>:mean",
                                  field="graph.nodes")


def _refs(values: list[Any], at: str) -> Iterator[str]:
    """Every node name an encoded argument list refers to; BadRequestError for an encoding Bios does not read."""
    for value in values:
        if value is None or isinstance(value, (bool, int, float, str)):
            continue
        if isinstance(value, list):
            yield from _refs(value, at)
            continue
        if not isinstance(value, dict) or len(value) != 1:
            raise BadRequestError(f"{at} has an argument Bios cannot read: {value!r}", field="graph.nodes")
        (kind, inner), = value.items()
        if kind == "ref" and isinstance(inner, str):
            yield inner
        elif kind in ("tuple", "slice") and isinstance(inner, list):
            yield from _refs(inner, at)
        elif kind == "dict" and isinstance(inner, dict):
            yield from _refs(list(inner.values()), at)
        elif kind == "float" and inner in ("inf", "-inf", "nan"):
            continue
        elif kind == "dtype" and inner in ALLOWED_DTYPES:
            continue
        elif kind in ("ellipsis", "device", "layout", "memory_format"):
            continue
        else:
            raise BadRequestError(f"{at} has an argument Bios cannot read: {value!r}", field="graph.nodes")
