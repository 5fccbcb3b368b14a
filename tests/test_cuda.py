"""What only a CUDA device can show: bf16 detection, `bios.kernels` and whole training steps on the GPU against
references, and NCCL collectives between two GPUs.

Machines without CUDA (CI, the development machines) skip this file with that reason; `python bench/gpu_check.py`
runs it on a GPU machine. TF32 is off here so fp32 means fp32; references are float64 on the CPU, computed from
the very (dtype-rounded) values the GPU saw.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from conftest import random_llama

from bios.kernels import adamw_step, linear_cross_entropy, lora_linear, rms_norm, swiglu
from bios.types import AdamParams, Datum, LoraConfig, ModelInput
from bios.worker.adapter import AdapterState
from bios.worker.compute_mode import base_dtype, native_bf16
from bios.worker.engine import ForwardItem, commit_gradients, forward_backward, optim_step
from bios.worker.lora import attach_lora

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: run `python bench/gpu_check.py` on a GPU machine"
)
CUDA = torch.device("cuda")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative, on the whole tensor
ADAM = AdamParams(learning_rate=1e-2, beta1=0.85, beta2=0.98, weight_decay=0.05, grad_clip_norm=5.0)


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.detach().double().cpu()
    return float((actual.detach().double().cpu() - expected).norm() / expected.norm())


def random_inputs(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Fresh random tensors on the GPU in `dtype`, each with a float64 CPU twin of the same rounded values."""
    generator = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(shape, generator=generator, dtype=torch.float64) / shape[-1] ** 0.25).to(dtype)
            for name, shape in shapes.items()}


def on_gpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to(CUDA, copy=True).requires_grad_() for name, t in tensors.items()}


def in_float64(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().double().requires_grad_() for name, t in tensors.items()}


def assert_matches(gpu_out, ref_out, gpu_inputs, ref_inputs, dtype) -> None:
    grad_out = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    gpu_out.backward(grad_out.to(gpu_out.dtype).to(CUDA))
    ref_out.backward(grad_out)
    errors = {"output": relative_error(gpu_out, ref_out)}
    errors |= {f"d{name}": relative_error(gpu_inputs[name].grad, ref_inputs[name].grad) for name in ref_inputs}
    assert max(errors.values()) <= TOLERANCE[dtype], f"{dtype} relative errors {errors}"


def test_native_bf16_is_detected_and_becomes_the_default(monkeypatch):
    monkeypatch.delenv("BIOS_BASE_DTYPE", raising=False)
    native = torch.cuda.get_device_capability(CUDA)[0] >= 8  # Ampere and later multiply bf16 natively
    assert native_bf16(CUDA) == ("CUDA bf16" if native else None)
    assert base_dtype(CUDA).dtype == (torch.bfloat16 if native else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_on_cuda(dtype):
    values = random_inputs({"x": (3, 37, 96), "w": (80, 96), "b": (80,), "a": (8, 96), "bb": (80, 8)}, dtype, 1)
    gpu, ref = on_gpu(values), in_float64(values)
    out = lora_linear(gpu["x"], gpu["w"], gpu["b"], gpu["a"], gpu["bb"], 2.0)
    expected = ref["x"] @ ref["w"].T + ref["b"] + 2.0 * (ref["x"] @ ref["a"].T) @ ref["bb"].T
    assert_matches(out, expected, gpu, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_on_cuda(dtype):
    values = random_inputs({"h": (129, 64), "w": (1000, 64), "a": (8, 64), "bb": (1000, 8)}, dtype, 2)
    targets = torch.randint(0, 1000, (129,), generator=torch.Generator().manual_seed(3))
    gpu, ref = on_gpu(values), in_float64(values)
    out = linear_cross_entropy(gpu["h"], gpu["w"], targets.to(CUDA), lora_a=gpu["a"], lora_b=gpu["bb"],
                               lora_scale=0.5, chunk_size=100)
    logits = ref["h"] @ ref["w"].T + 0.5 * (ref["h"] @ ref["a"].T) @ ref["bb"].T
    expected = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    assert_matches(out, expected, gpu, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_swiglu_on_cuda(dtype):
    values = random_inputs({"x": (5, 33, 64), "w": (64,)}, dtype, 4)
    gpu, ref = on_gpu(values), in_float64(values)
    out = rms_norm(gpu["x"], gpu["w"], 1e-6)
    expected = ref["x"] * torch.rsqrt(ref["x"].pow(2).mean(-1, keepdim=True) + 1e-6) * ref["w"]
    assert_matches(out, expected, gpu, ref, dtype)

    values = random_inputs({"gate": (5, 33, 64), "up": (5, 33, 64)}, dtype, 5)
    gpu, ref = on_gpu(values), in_float64(values)
    expected = torch.nn.functional.silu(ref["gate"]) * ref["up"]
    assert_matches(swiglu(gpu["gate"], gpu["up"]), expected, gpu, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_on_cuda_is_transformers_bit_for_bit_both_ways(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from bios.kernels.rotary import rotary

    generator = torch.Generator().manual_seed(6)
    qk = torch.randn(2, 17, 6 * 16, generator=generator).to(dtype).to(CUDA)
    angles = torch.randn(2, 17, 8, generator=generator).repeat(1, 1, 2).to(CUDA)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    grad = torch.randn(2, 17, 6 * 16, generator=generator).to(dtype).to(CUDA)
    results = []
    for stock in (False, True):
        x = qk.clone().requires_grad_()
        if stock:
            heads = x.unflatten(-1, (6, 16)).transpose(1, 2)
            out = apply_rotary_pos_emb(heads, heads, cos, sin)[0].transpose(1, 2).flatten(-2)
        else:
            out = rotary(x, cos, sin)
        out.backward(grad)
        results.append((out.detach(), x.grad))
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(*results))


def test_adamw_step_on_cuda_equals_torch_adamw():
    generator = torch.Generator().manual_seed(6)
    params = [torch.randn(shape, generator=generator) for shape in [(64, 32), (17,), (8, 128)]]
    grads = [[torch.randn(p.shape, generator=generator) for p in params] for _ in range(4)]
    reference = [p.clone().double().requires_grad_() for p in params]
    optimizer = torch.optim.AdamW(reference, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
                                  weight_decay=ADAM.weight_decay)
    ours = [p.to(CUDA) for p in params]
    exp_avg, exp_avg_sq = [torch.zeros_like(p) for p in ours], [torch.zeros_like(p) for p in ours]
    for step, step_grads in enumerate(grads, start=1):
        for p, g in zip(reference, step_grads):
            p.grad = g.double().clone()
        torch.nn.utils.clip_grad_norm_(reference, ADAM.grad_clip_norm)
        optimizer.step()
        adamw_step(ours, [g.to(CUDA) for g in step_grads], exp_avg, exp_avg_sq, step=step, lr=ADAM.learning_rate,
                   beta1=ADAM.beta1, beta2=ADAM.beta2, eps=ADAM.eps, weight_decay=ADAM.weight_decay,
                   grad_clip_norm=ADAM.grad_clip_norm)
    for got, want in zip(ours, reference):
        assert relative_error(got, want) <= 1e-6


def llama_batch(seed: int, lengths: list[int], vocab: int = 300) -> list[Datum]:
    generator = torch.Generator().manual_seed(seed)
    data = []
    for length in lengths:
        tokens = torch.randint(0, vocab, (length + 1,), generator=generator)
        data.append(Datum(ModelInput.from_ints(tokens[:-1].tolist()),
                          {"target_tokens": tokens[1:], "weights": torch.rand(length, generator=generator)}))
    return data


def train(device: torch.device, base: str, steps: int = 3) -> tuple[list[float], torch.Tensor]:
    """Losses and final LoRA parameters of `steps` steps of the worker's engine on `device` with base dtype `base`."""
    os.environ["BIOS_BASE_DTYPE"] = base
    model = random_llama(300).to(device)
    attach_lora(model)
    adapter = AdapterState.create("run", model, LoraConfig(rank=8, seed=3), device=device)
    losses = []
    for step in range(steps):
        data = llama_batch(step, [11, 30, 7, 19])
        losses.append(forward_backward(model, [ForwardItem(adapter, data, "cross_entropy", None, False)])[0].loss)
        commit_gradients(adapter)
        optim_step(adapter, ADAM)
    return losses, adapter.params.detach().cpu()


def test_training_steps_on_cuda_equal_cpu_in_fp32_and_track_them_in_bf16(monkeypatch):
    monkeypatch.setenv("BIOS_BASE_DTYPE", "float32")
    cpu_losses, cpu_params = train(torch.device("cpu"), "float32")
    gpu_losses, gpu_params = train(CUDA, "float32")
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-5)
    assert relative_error(gpu_params, cpu_params) <= 1e-4
    bf16_losses, bf16_params = train(CUDA, "bfloat16")
    assert bf16_losses == pytest.approx(cpu_losses, rel=2e-2)
    assert relative_error(bf16_params, cpu_params) <= 5e-2


def _sample_both_ways(model, items) -> tuple[list, list, object]:
    """(responses through the lean decode step, through the model's modules, the lean step that ran)."""
    from bios.worker.llama_decode import LlamaDecodeStep
    from bios.worker.sampling import generate

    made = []
    real = LlamaDecodeStep.for_model
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LlamaDecodeStep, "for_model", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
        lean = generate(model, None, items(), eos_token_id=None)
        patch.setattr(LlamaDecodeStep, "for_model", lambda *a, **k: None)
        modules = generate(model, None, items(), eos_token_id=None)
    return lean, modules, made[-1]


@pytest.mark.parametrize("base", ["float32", "bfloat16"])
def test_sampling_on_cuda_through_the_lean_decode_step_agrees_with_the_modules(base, monkeypatch):
    """`bios.worker.llama_decode` on the GPU, for rows of one shared prompt and of several (each row keeps its own
    cache there: `decode_cache.RowCache`): fp32 samples the module path's tokens with its log-probs to 1e-4; bf16
    agrees until the first token where rounding makes the two differ (log-probs to 0.1 up to there)."""
    from bios.types import SamplingParams
    from bios.worker.decode_cache import RowCache
    from bios.worker.sampling import SampleItem

    monkeypatch.setenv("BIOS_BASE_DTYPE", base)
    model = random_llama(300).to(CUDA)
    attach_lora(model)
    adapter = AdapterState.create("rl", model, LoraConfig(rank=4, seed=5), device=CUDA)
    generator = torch.Generator().manual_seed(6)
    adapter.load_state_dict({k: v + 0.2 * torch.randn(v.shape, generator=generator).to(v.device)
                             for k, v in adapter.state_dict().items()})
    shared = [9, 80, 7, 33, 120, 5, 61, 2, 44, 17]
    batches = [lambda: [SampleItem(adapter, shared, 6, SamplingParams(max_tokens=20, seed=1))],
               lambda: [SampleItem(adapter, [3, 1, 4], 3, SamplingParams(max_tokens=20, seed=2)),
                        SampleItem(None, [2, 7, 1, 8, 2, 8], 2, SamplingParams(max_tokens=9, seed=3))]]
    for items in batches:
        lean, modules, step = _sample_both_ways(model, items)
        assert step is not None and all(type(cache) is RowCache for cache in step._caches)
        for ours, theirs in zip(lean, modules):
            for a, b in zip(ours.sequences, theirs.sequences):
                if base == "float32":
                    assert a.tokens == b.tokens
                    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
                    continue
                same = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), len(a.tokens))
                assert same >= 1 and a.logprobs[:same] == pytest.approx(b.logprobs[:same], abs=0.1)


def _all_reduce_on(rank: int, port, sums) -> None:
    from bios.worker.collectives import CollectiveGroup

    group = CollectiveGroup(torch.device(f"cuda:{rank}"), "127.0.0.1")
    if rank == 0:
        port.put(group.store_port)
        master_port = group.store_port
    else:
        master_port = port.get(timeout=60)
    group.rebuild(1, rank, 2, "127.0.0.1", master_port, timeout_s=60)
    tensor = torch.full((1024,), float(rank + 1), device=f"cuda:{rank}")
    group.all_reduce_sum_(tensor)
    sums.put((rank, float(tensor[0])))
    group.destroy()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between workers needs 2 GPUs")
def test_nccl_sums_gradients_between_two_gpus():
    context = mp.get_context("spawn")
    port, sums = context.Queue(), context.Queue()
    processes = [context.Process(target=_all_reduce_on, args=(rank, port, sums)) for rank in range(2)]
    for process in processes:
        process.start()
    try:
        assert dict(sums.get(timeout=120) for _ in processes) == {0: 3.0, 1: 3.0}
    finally:
        for process in processes:
            process.join(timeout=30)
            process.kill()
