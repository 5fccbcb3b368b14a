"""Fuzzing every request validator and request decoder: hostile input gets the error its contract names, never
another exception (which would surface as an internal error, or take down a handler).

Coordinator validators see only what the codec lets through, so each random request is first sent through the
real codec (encode, then decode); whatever the codec refuses is the codec's business (tests/test_codec.py).
Each hypothesis example draws one seed and validates `PER_EXAMPLE` inputs built from it with
`random.Random(seed)`: hypothesis's cost per draw would otherwise dominate, and a failure names the seed and
the index that reproduce it. `EXAMPLES x PER_EXAMPLE` = 10,000 inputs per validator or decoder.
"""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from bios import messages as m
from bios import types as t
from bios.checkpoint_path import CheckpointPath, check_name
from bios.exceptions import AuthenticationError, BadRequestError
from bios.gateway import json_wire as gateway
from bios.gateway import proto
from bios.gateway.json_body import Body
from bios.security.keys import AdminKey, ApiKey, KeyStore, WorkerToken
from bios.security.limits import QuotaLedger, Quotas
from bios.transport.codec import DecodeError, Envelope
from bios import spec
from bios.worker import engine
from bios.worker.adapter import validate_lora_config
from bios.wire import make_codec

EXAMPLES = 400
PER_EXAMPLE = 25
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
SEEDS = st.integers(0, 2**64 - 1)
CODEC = make_codec()
LEDGER = QuotaLedger(Quotas(max_tokens_per_request=1024))
INFO = t.BaseModelInfo(name="fuzz-llama", local_dir="", arch="llama", vocab_size=256, max_context_length=64,
                       hidden_size=16, num_layers=1, num_parameters=1, eos_token_id=2)

_INTS = [0, 1, -1, 2, 3, 4, 7, 8, 16, 63, 64, 65, 128, 255, 256, 257, 1024, 2**31, -(2**31), 2**53 + 1,
         2**63 - 1, -(2**63), 2**64 - 1]
_FLOATS = [0.0, -0.0, 1e-12, 1e-8, 0.5, 0.9, 0.95, 0.999999, 1.0, 1.0000001, 1.5, -1.0, -1e-12, 1e308, -1e308,
           5e-324, math.nan, math.inf, -math.inf]
_TEXTS = ["", "x", " ", "\x00", "é", "😀", "a" * 300, "cross_entropy", "ppo", "importance_sampling", "CROSS_ENTROPY",
          "clip_low_threshold", "clip_high_threshold", "beta", "target_tokens", "weights", "logprobs", "advantages",
          "mask", "sequence_ratio_mask", "../..", "a/b", "bios://r/weights/n", "tinker://r/sampler_weights/n",
          "bios://r/weights/", "bios:///weights/n", "bios://r/other/n", "bios://r/weights/.hidden", "-n", "n" * 129]


def _check(seed: int, build: Callable[[random.Random], Any], validate: Callable[[Any], Any],
           allowed: tuple[type[BaseException], ...]) -> None:
    """The fuzz property: `validate` succeeds or raises one of `allowed`, for every input built from `seed`."""
    rng = random.Random(seed)
    for index in range(PER_EXAMPLE):
        value = build(rng)
        try:
            validate(value)
        except allowed:
            pass
        except Exception as exc:
            raise AssertionError(f"seed {seed}, input {index}: {type(exc).__name__}: {exc}\n{value!r}") from exc


def _through_wire(rng: random.Random, build: Callable[[random.Random], Any]) -> Any:
    """A random request as the coordinator would decode it, or None if the codec refuses it."""
    try:
        frames = [bytes(f) for f in CODEC.encode(Envelope(1, build(rng)))]
        return CODEC.decode(frames).body
    except (DecodeError, TypeError, OverflowError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------- random values


def _int(rng: random.Random) -> int:
    return rng.choice(_INTS) if rng.random() < 0.6 else rng.randint(-300, 300)


def _float(rng: random.Random) -> float:
    return rng.choice(_FLOATS) if rng.random() < 0.6 else rng.uniform(-2.0, 2.0)


def _number(rng: random.Random) -> float | int:
    return _int(rng) if rng.random() < 0.25 else _float(rng)


def _numbers(rng: random.Random, n: int) -> list[float | int]:
    return [_number(rng) for _ in range(n)]


def _text(rng: random.Random) -> str:
    if rng.random() < 0.8:
        return rng.choice(_TEXTS)
    return "".join(rng.choice("ab/:._-0\x00é ") for _ in range(rng.randint(0, 12)))


def _tokens(rng: random.Random) -> list[int]:
    n = rng.choice([0, 1, 2, 3, 5, 8, 64, 65])  # the fuzz model's context is 64
    if rng.random() < 0.7:
        return [rng.randrange(256) for _ in range(n)]
    return [_int(rng) for _ in range(n)]


def _model_input(rng: random.Random) -> t.ModelInput:
    return t.ModelInput([t.EncodedTextChunk(_tokens(rng)) for _ in range(rng.choice([0, 1, 1, 1, 2, 3]))])


def _array(rng: random.Random, n: int) -> np.ndarray:
    dtype = rng.choice([np.int64, np.float32])
    shape = rng.choice([(n,), (n,), (n,), (n + 1,), (max(n - 1, 0),), (), (0,), (n, 2), (1, n)])
    size = int(np.prod(shape)) if shape else 1
    if dtype is np.int64:
        values = [rng.randrange(256) if rng.random() < 0.8 else rng.choice(_INTS[:-1]) for _ in range(size)]
        values = [max(min(v, 2**63 - 1), -(2**63)) for v in values]
    else:
        values = [rng.uniform(-3, 3) if rng.random() < 0.9 else rng.choice(_FLOATS) for _ in range(size)]
    with np.errstate(over="ignore"):  # 1e308 becomes inf in float32: wanted
        return np.array(values, dtype=dtype).reshape(shape)


def _datum(rng: random.Random) -> t.Datum:
    model_input = _model_input(rng)
    n = model_input.length
    keys = list(rng.choice([loss.required_inputs for loss in spec.LOSSES.values()]))
    if rng.random() < 0.3:
        keys.remove(rng.choice(keys))
    if rng.random() < 0.3:
        keys.append(rng.choice(["mask", "sequence_ratio_mask", "clip_low_threshold", "junk", ""]))
    return t.Datum(model_input, {key: t.TensorData.from_numpy(_array(rng, n)) for key in keys})


def _loss_fn(rng: random.Random) -> str:
    return rng.choice(list(spec.LOSSES)) if rng.random() < 0.85 else _text(rng)


def _loss_config(rng: random.Random) -> dict[str, float] | None:
    if rng.random() < 0.5:
        return None
    keys = ["clip_low_threshold", "clip_high_threshold", "beta", "eps", _text(rng)]
    return {rng.choice(keys): _number(rng) for _ in range(rng.randint(0, 3))}


def _sampling_params(rng: random.Random) -> t.SamplingParams:
    stop: Any = rng.choice([None, None, _text(rng), [_text(rng)], [_int(rng), _int(rng)], [], ["\n", 3]])
    return t.SamplingParams(
        max_tokens=None if rng.random() < 0.2 else _int(rng),
        seed=None if rng.random() < 0.5 else _int(rng),
        stop=stop,
        temperature=_number(rng),
        top_k=_int(rng) if rng.random() < 0.7 else -1,
        top_p=_number(rng) if rng.random() < 0.7 else 1.0,
    )


def _lora(rng: random.Random) -> t.LoraConfig:
    return t.LoraConfig(rank=_int(rng), seed=None if rng.random() < 0.3 else _int(rng),
                        train_unembed=rng.random() < 0.5, train_mlp=rng.random() < 0.5, train_attn=rng.random() < 0.5)


def _path(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return _text(rng)
    parts = [rng.choice(["bios", "tinker", "http", "", "bios:"]), rng.choice(["s:train:0", "", "..", "r/x"]),
             rng.choice(["weights", "sampler_weights", "", "w"]), rng.choice(["n", "", ".n", "a" * 129, "n-1.x"])]
    return f"{parts[0]}://{parts[1]}/{parts[2]}/{parts[3]}" + rng.choice(["", "", "/", "/extra"])


# ---------------------------------------------------------------------------------------------- coordinator side


def _validate_forward_backward(op: m.ForwardBackward | None) -> None:
    if op is None:
        return
    LEDGER.check_tokens(sum(datum.model_input.length for datum in op.data), "data")
    spec.check_forward(op.data, op.loss_fn, op.loss_fn_config, INFO)


@settings(FUZZ)
@given(seed=SEEDS)
def test_fuzz_forward_backward_validation_raises_only_bad_request(seed: int) -> None:
    def build(rng: random.Random) -> m.ForwardBackward | None:
        return _through_wire(rng, lambda r: m.ForwardBackward(
            "s:train:0", 1, [_datum(r) for _ in range(r.choice([0, 1, 1, 2, 3]))], _loss_fn(r), _loss_config(r),
            r.random() < 0.3))

    _check(seed, build, _validate_forward_backward, (BadRequestError,))


@settings(FUZZ)
@given(seed=SEEDS)
def test_fuzz_optim_step_and_lora_validation_raise_only_bad_request(seed: int) -> None:
    def build(rng: random.Random) -> Any:
        if rng.random() < 0.5:
            return _through_wire(rng, lambda r: m.OptimStep("s:train:0", 2, t.AdamParams(*_numbers(r, 6))))
        return _through_wire(rng, lambda r: m.CreateModel("s", 0, _text(r), _lora(r)))

    def validate(op: Any) -> None:
        if isinstance(op, m.OptimStep):
            spec.check_adam(op.adam_params)
        elif isinstance(op, m.CreateModel):
            spec.check_lora(op.lora)

    _check(seed, build, validate, (BadRequestError,))


@settings(FUZZ)
@given(seed=SEEDS)
def test_fuzz_sample_validation_raises_only_bad_request(seed: int) -> None:
    """The spec's sampling checks and the quota's token bound, with and without model info."""

    def build(rng: random.Random) -> tuple[m.Sample | None, t.BaseModelInfo | None]:
        op = _through_wire(rng, lambda r: m.Sample("s:sample:0", 0, _model_input(r), _int(r), _sampling_params(r)))
        return op, INFO if rng.random() < 0.7 else None

    def validate(value: tuple[m.Sample | None, t.BaseModelInfo | None]) -> None:
        op, info = value
        if op is not None:
            spec.check_sample(op.prompt.to_ints(), op.num_samples, op.sampling_params, info)
            LEDGER.check_tokens(op.num_samples * (op.prompt.length + (op.sampling_params.max_tokens or 1)),
                                "sampling_params.max_tokens")

    _check(seed, build, validate, (BadRequestError,))


@settings(FUZZ)
@given(seed=SEEDS)
def test_fuzz_checkpoint_names_and_paths_raise_only_bad_request(seed: int) -> None:
    def build(rng: random.Random) -> Any:
        kind = rng.choice([m.SaveWeights, m.LoadWeights, m.CreateSamplingSession, m.DeleteCheckpoint])
        if kind is m.SaveWeights:
            return _through_wire(rng, lambda r: m.SaveWeights("s:train:0", 3, _path(r), "weights"))
        if kind is m.LoadWeights:
            return _through_wire(rng, lambda r: m.LoadWeights("s:train:0", 3, _path(r), r.random() < 0.5))
        if kind is m.CreateSamplingSession:
            return _through_wire(rng, lambda r: m.CreateSamplingSession("s", 0, None, _path(r)))
        return _through_wire(rng, lambda r: m.DeleteCheckpoint(_path(r)))

    def validate(op: Any) -> None:
        if isinstance(op, m.SaveWeights):
            check_name(op.name)
        elif isinstance(op, m.CreateSamplingSession):
            CheckpointPath.parse(op.model_path, field="model_path")
        elif op is not None:
            parsed = CheckpointPath.parse(op.path)
            assert str(CheckpointPath.parse(str(parsed))) == str(parsed)

    _check(seed, build, validate, (BadRequestError,))


# ---------------------------------------------------------------------------------------------- worker side


class _LlamaLayout(nn.Module):
    """The linear layers of a one-layer Llama (names and shapes), which is all LoRA validation looks at."""

    def __init__(self) -> None:
        super().__init__()
        shapes = {"q_proj": (16, 16), "k_proj": (16, 8), "v_proj": (16, 8), "o_proj": (16, 16),
                  "gate_proj": (16, 32), "up_proj": (16, 32), "down_proj": (32, 16)}
        layer = nn.ModuleDict({"self_attn": nn.ModuleDict(), "mlp": nn.ModuleDict()})
        for name, (fan_in, fan_out) in shapes.items():
            layer["self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"][name] = nn.Linear(
                fan_in, fan_out, bias=False)
        self.layers = nn.ModuleList([layer])
        self.lm_head = nn.Linear(16, 256, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


@pytest.fixture(scope="module")
def tiny_model() -> nn.Module:
    return _LlamaLayout()


@settings(FUZZ)
@given(seed=SEEDS)
def test_fuzz_worker_lora_config_validation_raises_only_bad_request(seed: int, tiny_model: nn.Module) -> None:
    _check(seed, lambda r: _through_wire(r, lambda rr: m.CreateModel("s", 0, "b", _lora(rr))),
           lambda op: op is None or validate_lora_config(tiny_model, op.lora), (BadRequestError,))


@settings(FUZZ)
@given(seed=SEEDS)
def test_fuzz_worker_loss_inputs_raise_only_bad_request(seed: int) -> None:
    """The worker's wall for forward items (`engine.check_item`) reports bad input as BadRequestError."""

    def build(rng: random.Random) -> tuple[str, dict[str, float] | None, t.Datum]:
        return _loss_fn(rng), _loss_config(rng), _datum(rng)

    def validate(value: tuple[str, dict[str, float] | None, t.Datum]) -> None:
        loss_fn, config, datum = value
        engine.check_item([datum], loss_fn, config, None, None)

    _check(seed, build, validate, (BadRequestError,))


# ---------------------------------------------------------------------------------------------- keys


@pytest.fixture(scope="module")
def key_store(tmp_path_factory) -> KeyStore:
    store, _ = KeyStore.init(tmp_path_factory.mktemp("fuzz-keys"))
    store.create("fuzz")
    yield store
    store.close()


def _mutated(rng: random.Random, text: str) -> str:
    chars = list(text)
    for _ in range(rng.randint(1, 3)):
        action = rng.random()
        i = rng.randrange(len(chars) + 1)
        if action < 0.4 and chars:
            chars[min(i, len(chars) - 1)] = rng.choice("AZaz09-_=+/.\x00é ")
        elif action < 0.7:
            chars.insert(i, rng.choice("AZaz09-_=+/.\x00é "))
        else:
            del chars[i:i + rng.randint(1, 8)]
    return "".join(chars)


@settings(FUZZ)
@given(seed=SEEDS)
def test_fuzz_api_keys_and_tokens_raise_only_authentication_error(seed: int, key_store: KeyStore) -> None:
    key = str(ApiKey(key_store.list()[0].key_id, bytes(24), key_store.cluster.server_public_key))  # id right
    valid = [key, "tml-" + key, str(key_store.cluster.worker_token()), "tml-" + str(key_store.admin_key())]

    def build(rng: random.Random) -> str:
        return _mutated(rng, rng.choice(valid)) if rng.random() < 0.8 else _text(rng)

    def validate(text: str) -> None:
        for parse in (ApiKey.parse, WorkerToken.parse, AdminKey.parse, key_store.authenticate,
                      key_store.check_worker_token, key_store.is_admin):
            try:
                parse(text)
            except AuthenticationError:
                pass

    _check(seed, build, validate, ())


# ---------------------------------------------------------------------------------------------- gateway bodies


JSON_BODIES: dict[str, tuple[Callable[[Any], Any], dict[str, Any]]] = {
    "create_model": (gateway.create_model, {
        "session_id": "s", "model_seq_id": 0, "base_model": "bios/tiny-llama",
        "lora_config": {"rank": 8, "seed": 1, "train_unembed": True, "train_mlp": True, "train_attn": False},
        "optimizer_config": {"type": "adamw"}}),
    "load_weights": (gateway.load_weights, {
        "model_id": "s:train:0", "seq_id": 2, "path": "tinker://s:train:0/weights/w", "optimizer": True}),
    "load_weights_new_run": (gateway.load_weights, {
        "session_id": "s", "model_seq_id": 1, "path": "tinker://s:train:0/weights/w", "optimizer": False}),
    "optim_step": (gateway.optim_step, {"model_id": "s:train:0", "seq_id": 1, "adam_params": {
        "learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
        "grad_clip_norm": 1.0, "type": "adam"}}),
    "save_weights": (gateway.save_weights, {"model_id": "s:train:0", "seq_id": 3, "path": "w", "overwrite": False}),
    "save_weights_for_sampler": (gateway.save_weights_for_sampler, {
        "model_id": "s:train:0", "seq_id": 4, "sampling_session_seq_id": 0}),
    "create_sampling_session": (gateway.create_sampling_session, {
        "session_id": "s", "sampling_session_seq_id": 0, "base_model": "bios/tiny-llama", "model_path": None}),
    "sample": (gateway.sample, {
        "sampling_session_id": "s:sample:0", "seq_id": 0, "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 4, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3,
                            "stop": ["\n"]},
        "prompt_logprobs": True, "prompt_logprobs_last_n": 2, "topk_prompt_logprobs": 0}),
}
_JSON_SCALARS: list[Any] = [None, True, False, 0, 1, -1, 2, 10**30, -(10**30), 10**400, 0.5, -0.0, 1e308, "", "x",
                            "adam", "sgd", "encoded_text", "image", [], {}, [1, 2], ["\n"], [1, "a"]]


def _json_value(rng: random.Random, depth: int = 2) -> Any:
    r = rng.random()
    if depth and r < 0.15:
        return [_json_value(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    if depth and r < 0.25:
        return {_text(rng): _json_value(rng, depth - 1) for _ in range(rng.randint(0, 3))}
    return copy.deepcopy(rng.choice(_JSON_SCALARS)) if r < 0.8 else _number(rng)  # a copy: bodies get mutated


def _mutate_json(rng: random.Random, body: Any) -> Any:
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        slots: list[tuple[Any, Any]] = []
        stack = [body]
        while stack:
            node = stack.pop()
            keys = list(node) if isinstance(node, dict) else range(len(node)) if isinstance(node, list) else ()
            for key in keys:
                slots.append((node, key))
                stack.append(node[key])
        if not slots or rng.random() < 0.05:
            return _json_value(rng)
        node, key = rng.choice(slots)
        if isinstance(node, dict) and rng.random() < 0.2:
            del node[key]
        else:
            node[key] = _json_value(rng)
    return body


@settings(FUZZ)
@given(seed=SEEDS)
def test_fuzz_gateway_json_bodies_raise_only_bad_request(seed: int) -> None:
    """Each JSON request decoder, then the coordinator's validator for what it produced."""
    names = sorted(JSON_BODIES)

    def build(rng: random.Random) -> tuple[str, Any]:
        name = rng.choice(names)
        return name, _mutate_json(rng, JSON_BODIES[name][1])

    def validate(value: tuple[str, Any]) -> None:
        name, data = value
        decoded = JSON_BODIES[name][0](Body(data))
        op = decoded[0] if isinstance(decoded, tuple) else decoded
        if isinstance(op, m.OptimStep):
            spec.check_adam(op.adam_params)
        elif isinstance(op, m.CreateModel):
            spec.check_lora(op.lora)
        elif isinstance(op, m.Sample):
            spec.check_sample(op.prompt.to_ints(), op.num_samples, op.sampling_params, INFO)
        elif isinstance(op, m.SaveWeights) and op.name is not None:
            check_name(op.name)

    _check(seed, build, validate, (BadRequestError,))


def _random_tensor(rng: random.Random, n: int) -> Any:
    pb = proto.pb
    tensor = pb.Tensor(dtype=rng.choice([pb.DTYPE_FLOAT32, pb.DTYPE_INT64, pb.DTYPE_INT32, pb.DTYPE_BFLOAT16, 0, 99]))
    shape = rng.choice([[n], [n], [], [n + 1], [-1], [2, n], [2**62], [1, 2**62], [2**40, 2**40]])
    tensor.shape.extend(shape)
    itemsize = {pb.DTYPE_FLOAT32: 4, pb.DTYPE_INT64: 8, pb.DTYPE_INT32: 4, pb.DTYPE_BFLOAT16: 2}.get(tensor.dtype, 4)
    if rng.random() < 0.8:
        tensor.dense = rng.randbytes(itemsize * n + rng.choice([0, 0, 0, 1, -1 if n else 0]))
    else:
        rows = rng.choice([1, 2, 3])
        tensor.sparse_csr.values = rng.randbytes(itemsize * rng.randint(0, 3))
        tensor.sparse_csr.crow_indices = np.array(sorted(rng.randint(-1, 4) for _ in range(rows + 1)), "<i8").tobytes()
        tensor.sparse_csr.col_indices = np.array([rng.randint(-1, 5) for _ in range(rng.randint(0, 3))],
                                                 "<i8").tobytes()
    return tensor


def _random_forward_backward(rng: random.Random) -> bytes:
    pb = proto.pb
    msg = pb.ForwardBackwardRequest(model_id=rng.choice(["s:train:0", ""]), seq_id=rng.choice([1, 2, 0, -5]),
                                    loss_fn=_loss_fn(rng), forward_only=rng.random() < 0.3)
    for _ in range(rng.choice([0, 1, 2])):
        datum = msg.data.add()
        n = rng.choice([0, 1, 3, 5])
        chunk = datum.model_input.add()
        if rng.random() < 0.9:
            chunk.encoded_text.tokens = np.array([rng.randrange(300) - 20 for _ in range(n)], "<i4").tobytes()[
                : None if rng.random() < 0.9 else -1]
        for key in rng.sample(["target_tokens", "weights", "logprobs", "advantages", "mask"], rng.randint(0, 4)):
            datum.loss_fn_inputs[key].CopyFrom(_random_tensor(rng, n))
    for key in rng.sample(["clip_low_threshold", "beta", "x"], rng.randint(0, 2)):
        if rng.random() < 0.5:
            msg.loss_fn_config[key] = _float(rng)
        elif rng.random() < 0.5:
            msg.loss_fn_config_v2[key].number = _float(rng)
        else:
            msg.loss_fn_config_v2[key].text = _text(rng)
    raw = msg.SerializeToString()
    r = rng.random()
    if r < 0.15 and raw:  # and sometimes damage the bytes themselves
        i = rng.randrange(len(raw))
        raw = raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1:]
    elif r < 0.25:
        raw = raw[: rng.randint(0, len(raw))]
    elif r < 0.3:
        raw = rng.randbytes(rng.randint(0, 64))
    return raw


@settings(FUZZ)
@given(seed=SEEDS)
def test_fuzz_gateway_protobuf_forward_backward_raises_only_bad_request(seed: int) -> None:
    def validate(raw: bytes) -> None:
        op = proto.forward_backward_op(proto.decode_forward_backward(raw))
        _validate_forward_backward(op)

    _check(seed, _random_forward_backward, validate, (BadRequestError,))
