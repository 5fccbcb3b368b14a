"""Server-side custom losses: graphs traced by the official tinker SDK, checked against Bios's allow-list at
acceptance and run by workers with gradients; a graph equal to cross-entropy trains like cross_entropy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import BASE, random_llama, text_datum
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from bios import types
from bios.custom_loss import check_custom_loss
from bios.exceptions import BadRequestError
from bios.models.catalog import BUILTIN_VOCAB_SIZE
from bios.worker.adapter import AdapterState
from bios.worker.custom_loss import CompiledLoss
from bios.worker.engine import ForwardItem, check_item, forward_backward, model_limits
from bios.worker.lora import attach_lora


def as_bios(fn, ranks) -> types.CustomLoss:
    """What the tinker SDK's create_custom_loss sends, as Bios's typed value."""
    handle = trace_loss(fn, ranks, "session")
    graph = encode_graph(handle).model_dump()
    return types.CustomLoss(handle.name, [types.CustomLossInput(i.name, i.rank) for i in handle.inputs],
                            [types.CustomLossNode(**node) for node in graph["nodes"]], graph["format"])


def weighted_ce(logprobs, weights):
    loss = -(weights * logprobs).sum()
    return loss, {"custom/weight:sum": weights.sum()}


def clipped_ratio(logprobs, advantages, old):
    ratio = torch.exp(logprobs - old)
    loss = -torch.minimum(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean()}


@pytest.fixture(scope="module")
def model():
    llama = random_llama(BUILTIN_VOCAB_SIZE)
    attach_lora(llama)
    return llama


def gradients(model, loss_fn: str, data, custom=None) -> tuple[types.ForwardBackwardOutput, torch.Tensor]:
    adapter = AdapterState.create("c", model, types.LoraConfig(rank=4, seed=1), device="cpu")
    with torch.no_grad():  # B != 0, so A gets gradients too
        adapter.params.add_(torch.randn(adapter.params.shape, generator=torch.Generator().manual_seed(2)) * 0.05)
    out = forward_backward(model, [ForwardItem(adapter, data, loss_fn, None, custom_loss=custom)])[0]
    return out, adapter.pending_grad.clone()


def test_a_graph_equal_to_cross_entropy_gives_cross_entropys_gradients(model):
    data = [text_datum("Custom losses run on the workers."), text_datum("Weighted tokens.", weight=0.5)]
    out, grad = gradients(model, "cross_entropy", data)
    custom_out, custom_grad = gradients(model, "custom", data, CompiledLoss(as_bios(weighted_ce, {
        "logprobs": 1, "weights": 1})))
    assert custom_out.loss == pytest.approx(out.loss, rel=1e-6)
    weights = sum(float(d.loss_fn_inputs["weights"].to_numpy().sum()) for d in data)
    assert custom_out.metrics["custom/weight:sum"] == pytest.approx(weights)
    assert float(grad.abs().max()) > 0
    # fp32 rounding only: cross_entropy's head computes its gradients in forward (linear_weighted_loss), a custom
    # loss's head in backward from the log-probs' gradient
    torch.testing.assert_close(custom_grad, grad, rtol=1e-5, atol=1e-5 * float(grad.abs().max()))


def test_a_ppo_like_graph_runs_with_its_inputs_and_metrics(model):
    datum = text_datum("Advantages and old logprobs.")
    n = datum.model_input.length
    datum = types.Datum(datum.model_input, {**datum.loss_fn_inputs, "advantages": np.ones(n, np.float32),
                                                  "old": np.full(n, -3.0, np.float32)})
    compiled = CompiledLoss(as_bios(clipped_ratio, {"logprobs": 1, "advantages": 1, "old": 1}))
    out, grad = gradients(model, "custom", [datum, datum], compiled)
    assert out.loss < 0 and float(grad.abs().max()) > 0
    single, _ = gradients(model, "custom", [datum], compiled)
    assert out.loss == pytest.approx(2 * single.loss, rel=1e-6)  # losses add up, per-datum means do not
    assert out.metrics["custom/ratio:mean"] == pytest.approx(single.metrics["custom/ratio:mean"], rel=1e-6)
    assert out.metrics["custom/ratio:mean"] > 0
    logprobs = torch.full((n,), -3.0)
    value, metrics = compiled(logprobs, {"advantages": torch.ones(n), "old": torch.full((n,), -3.0)})
    assert float(value) == pytest.approx(-n) and float(metrics["custom/ratio:mean"]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="data\\[0\\].loss_fn_inputs lacks 'advantages', which custom needs"):
        gradients(model, "custom", [text_datum("no inputs")], compiled)


def scaled_ce(logprobs, weights, scale, table):
    return -(scale * weights * logprobs).sum() + 0 * table.sum(), {}


def test_the_wall_checks_inputs_of_every_rank_and_the_engine_then_trusts_them(model):
    """Rank-1 inputs are the request spec's; ranks 0 and 2, which only the graph declares, are the wall's too."""
    graph = as_bios(scaled_ce, {"logprobs": 1, "weights": 1, "scale": 0, "table": 2})
    datum = text_datum("Every rank is checked.")
    n = datum.model_input.length
    limits = model_limits(model)
    inputs = {**datum.loss_fn_inputs, "scale": np.array(2.0, np.float32), "table": np.zeros((n, 3), np.float32)}
    good = types.Datum(datum.model_input, inputs)
    check_item([good], "custom", None, graph, limits)
    for changed, message in (({"scale": None}, r"data\[1\]: custom loss .* reads loss_fn_inputs\['scale'\], which"),
                             ({"scale": np.ones(n, np.float32)}, r"\['scale'\] has shape \(\d+,\); .* rank 0"),
                             ({"table": np.zeros((n + 1, 3), np.float32)}, r"\['table'\] has shape .* rank 2")):
        bad = {key: value for key, value in {**inputs, **changed}.items() if value is not None}
        with pytest.raises(BadRequestError, match=message):
            check_item([good, types.Datum(datum.model_input, bad)], "custom", None, graph, limits)
        with pytest.raises(ValueError, match=message):
            gradients(model, "custom", [good, types.Datum(datum.model_input, bad)], CompiledLoss(graph))
    halved = types.Datum(datum.model_input, {**inputs, "scale": np.array(0.5, np.float32)})
    half, _ = gradients(model, "custom", [halved], CompiledLoss(graph))
    whole, _ = gradients(model, "cross_entropy", [datum])
    assert half.loss == pytest.approx(0.5 * whole.loss, rel=1e-5)


def test_a_forbidden_op_is_refused_naming_it():
    loss = as_bios(weighted_ce, {"logprobs": 1, "weights": 1})
    calls = [i for i, node in enumerate(loss.nodes) if node.op == "call_function"]
    nodes = list(loss.nodes)
    nodes[calls[0]] = types.CustomLossNode("call_function", nodes[calls[0]].name, "torch.save",
                                           nodes[calls[0]].args, nodes[calls[0]].kwargs)
    forbidden = types.CustomLoss(loss.name, loss.inputs, nodes)
    with pytest.raises(BadRequestError, match="'torch.save'"):
        check_custom_loss(forbidden)
    with pytest.raises(BadRequestError, match="'torch.save'"):
        CompiledLoss(forbidden)
    method = [types.CustomLossNode(n.op, n.name, "__reduce__", n.args, n.kwargs) if n.op == "call_method" else n
              for n in as_bios(lambda logprobs: (logprobs.sum(), {}), {"logprobs": 1}).nodes]
    with pytest.raises(BadRequestError, match="'__reduce__'"):
        check_custom_loss(types.CustomLoss("m", [types.CustomLossInput("logprobs", 1)], method))
    module = [types.CustomLossNode("call_module", "m", "os", [], {})] + list(loss.nodes)
    with pytest.raises(BadRequestError, match="call_module"):
        check_custom_loss(types.CustomLoss(loss.name, loss.inputs, module))
    with pytest.raises(BadRequestError, match="'__class__'"):
        check_custom_loss(types.CustomLoss("g", [types.CustomLossInput("logprobs", 1)], [
            types.CustomLossNode("placeholder", "logprobs", "logprobs"),
            types.CustomLossNode("call_function", "c", "builtins.getattr", [{"ref": "logprobs"}, "__class__"]),
            types.CustomLossNode("output", "output", "output", [{"tuple": [{"ref": "c"}, {"dict": {}}]}]),
        ]))


@pytest.mark.e2e
def test_through_the_coordinator_a_ce_graph_equals_cross_entropy_and_a_forbidden_op_is_refused(service):
    data = [text_datum("Custom losses run on the workers."), text_datum("Weighted tokens.", weight=0.5)]
    graph = as_bios(weighted_ce, {"logprobs": 1, "weights": 1})
    builtin, custom = (service.create_lora_training_client(BASE, rank=4, seed=17) for _ in range(2))
    expected = builtin.forward_backward(data).result(120)
    got = custom.forward_backward(data, "custom", custom_loss=graph).result(120)
    assert got.loss == pytest.approx(expected.loss, rel=1e-6)
    assert got.grad_norm == pytest.approx(expected.grad_norm, rel=1e-6)
    assert got.metrics["custom/weight:sum"] == pytest.approx(
        sum(float(d.loss_fn_inputs["weights"].to_numpy().sum()) for d in data))
    nodes = [types.CustomLossNode(n.op, n.name, "torch.save", n.args, n.kwargs) if n.op == "call_function" else n
             for n in graph.nodes]
    with pytest.raises(BadRequestError, match="'torch.save'"):
        custom.forward_backward(data, "custom", custom_loss=types.CustomLoss("evil", graph.inputs, nodes)).result(60)
    with pytest.raises(BadRequestError, match="comes with a custom loss graph"):
        custom.forward_backward(data, "custom").result(60)


def test_an_uploaded_loss_outlives_the_gateway_and_stays_with_its_key(tmp_path):
    from tinker.types import CreateCustomLossRequest

    from bios.coordinator.store import Store
    from bios.exceptions import NotFoundError
    from bios.gateway.custom_losses import CustomLosses
    from bios.gateway.json_body import Body

    handle = trace_loss(weighted_ce, {"logprobs": 1, "weights": 1}, "s1")
    request = CreateCustomLossRequest(session_id="s1", custom_loss_seq_id=3, name=handle.name,
                                      inputs=list(handle.inputs), graph=encode_graph(handle))
    store = Store(tmp_path)
    loss_id = CustomLosses(store.db).create("alice", Body(request.model_dump(mode="json")))
    store.close()

    store = Store(tmp_path)  # a restarted coordinator, its gateway new
    losses = CustomLosses(store.db)
    assert losses.get("alice", loss_id) == as_bios(weighted_ce, {"logprobs": 1, "weights": 1})
    with pytest.raises(NotFoundError, match="create_custom_loss"):
        losses.get("bob", loss_id)
    store.close()
