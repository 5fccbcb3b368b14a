"""Protobuf on the Tinker wire: `ForwardBackwardRequest` in, `ForwardBackwardOutput` and `SampleResponse` out.

The schema is the SDK's own (`tinker.proto.tinker_public_pb2`), so the gateway can never drift from what the
client writes and reads. Tensors travel as raw little-endian buffers; they are viewed with `np.frombuffer`
rather than copied, and every length is checked against its declared shape before use.
"""

from __future__ import annotations

import math

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from bios import messages as m
from bios import types as t
from bios.exceptions import BadRequestError

# proto DType -> (dtype of the bytes on the wire, dtype Bios keeps). int32 widens to int64, bfloat16 to float32.
_WIRE_DTYPES: dict[int, tuple[np.dtype, np.dtype]] = {
    pb.DTYPE_FLOAT32: (np.dtype("<f4"), np.dtype(np.float32)),
    pb.DTYPE_INT64: (np.dtype("<i8"), np.dtype(np.int64)),
    pb.DTYPE_INT32: (np.dtype("<i4"), np.dtype(np.int64)),
    pb.DTYPE_BFLOAT16: (np.dtype("<u2"), np.dtype(np.float32)),
}
_OUT_DTYPES: dict[str, int] = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}


def decode_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    """The `ForwardBackwardRequest` in a request body; BadRequestError if the bytes are not one."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise BadRequestError(
            f"the body is not a tinker_public.ForwardBackwardRequest protobuf ({exc})", field="body"
        ) from None
    if not msg.model_id:
        raise BadRequestError("model_id is missing", field="model_id")
    if msg.seq_id < 1:
        raise BadRequestError(f"seq_id must be >= 1 (the first request after create_model is 1), got {msg.seq_id}",
                              field="seq_id")
    return msg


def forward_backward_op(msg: pb.ForwardBackwardRequest) -> m.ForwardBackward:
    """The request as a Bios op. BadRequestError naming the field for a missing loss, a config text value (no
    Bios loss takes one), an audio chunk, or a tensor whose bytes do not match its dtype and shape.
    """
    if not msg.loss_fn:
        raise BadRequestError("loss_fn is missing", field="loss_fn")
    config = {} if msg.loss_fn == "custom" else _loss_config(msg)  # a custom loss's config names it (loss_id)
    data = [_datum(d, f"data[{i}]") for i, d in enumerate(msg.data)]
    return m.ForwardBackward(msg.model_id, msg.seq_id, data, msg.loss_fn, config or None, msg.forward_only)


def custom_loss_id(msg: pb.ForwardBackwardRequest) -> str | None:
    """The `loss_id` a `custom` forward_backward names (from create_custom_loss)."""
    value = msg.loss_fn_config_v2.get("loss_id")
    return value.text if value is not None and value.WhichOneof("value") == "text" else None


def _loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, float]:
    """The v2 map when the client wrote it (it can carry text), else the legacy number map."""
    if not msg.loss_fn_config_v2:
        return {key: float(value) for key, value in msg.loss_fn_config.items()}
    numbers: dict[str, float] = {}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise BadRequestError(
                f"loss_fn_config[{key!r}] must be a number: no Bios loss takes text configuration",
                field=f"loss_fn_config.{key}",
            )
        numbers[key] = value.number
    return numbers


def _datum(msg: pb.Datum, where: str) -> t.Datum:
    chunks: list[t.ModelInputChunk] = []
    for i, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind == "image":
            image = chunk.image
            if image.HasField("override_dimensions"):
                raise BadRequestError(f"{where}.model_input[{i}] sets override_dimensions, which Bios does not "
                                      "support: resize the image before sending it", field=f"{where}.model_input")
            expected = image.expected_tokens if image.HasField("expected_tokens") else None
            chunks.append(t.ImageChunk(image.data, image.format, expected))
            continue
        if kind != "encoded_text":
            raise BadRequestError(
                f"{where}.model_input[{i}] is a {kind or 'empty'} chunk; Bios takes text tokens and images",
                field=f"{where}.model_input",
            )
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise BadRequestError(f"{where}.model_input[{i}] tokens are {len(raw)} bytes, not int32s",
                                  field=f"{where}.model_input")
        chunks.append(t.EncodedTextChunk(np.frombuffer(raw, dtype="<i4").tolist()))
    inputs = {}
    for key, value in msg.loss_fn_inputs.items():
        array = _tensor(value, f"{where}.loss_fn_inputs.{key}")
        inputs[key] = t.TensorData(array, "int64" if array.dtype == np.int64 else "float32")
    return t.Datum(t.ModelInput(chunks), inputs)


def _tensor(msg: pb.Tensor, field: str) -> np.ndarray:
    if msg.dtype not in _WIRE_DTYPES:
        raise BadRequestError(f"{field} has unknown dtype {msg.dtype}", field=field)
    wire, kept = _WIRE_DTYPES[msg.dtype]
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise BadRequestError(f"{field} has a negative dimension in shape {shape}", field=field)
    if msg.WhichOneof("encoding") == "sparse_csr":
        array = _dense_from_csr(msg.sparse_csr, wire, shape, field)
    else:
        array = _frombuffer(msg.dense, wire, field)
        if shape:
            if math.prod(shape) != array.size:
                raise BadRequestError(f"{field} holds {array.size} values but its shape is {shape}", field=field)
            array = array.reshape(shape)
    if msg.dtype == pb.DTYPE_BFLOAT16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(kept, copy=False)


def _dense_from_csr(csr: pb.SparseCsr, wire: np.dtype, shape: list[int], field: str) -> np.ndarray:
    if len(shape) != 2:
        raise BadRequestError(f"{field} is sparse CSR, which needs a 2-D shape, got {shape}", field=field)
    values = _frombuffer(csr.values, wire, field)
    crow = _frombuffer(csr.crow_indices, np.dtype("<i8"), field)
    cols = _frombuffer(csr.col_indices, np.dtype("<i8"), field)
    rows_n, cols_n = shape
    if (crow.size != rows_n + 1 or cols.size != values.size or crow[0] != 0 or crow[-1] != values.size
            or (np.diff(crow) < 0).any() or (cols.size and (cols.min() < 0 or cols.max() >= cols_n))):
        raise BadRequestError(f"{field} has inconsistent sparse CSR indices for shape {shape}", field=field)
    dense = np.zeros(shape, dtype=wire)
    dense[np.repeat(np.arange(rows_n), np.diff(crow)), cols] = values
    return dense


def _frombuffer(raw: bytes, dtype: np.dtype, field: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise BadRequestError(f"{field} is {len(raw)} bytes, not a whole number of {dtype.itemsize}-byte values",
                              field=field)
    return np.frombuffer(raw, dtype=dtype)


def forward_backward_output(out: t.ForwardBackwardOutput, metrics: dict[str, float]) -> bytes:
    """One `ArrayRecord` holding every datum's outputs (e.g. `logprobs`), batched per field, and `metrics`."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type or "ArrayRecord")
    msg.metrics.update(metrics)
    outputs = out.loss_fn_outputs
    if outputs:
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
        for name in outputs[0]:
            arrays = [np.ascontiguousarray(o[name].to_numpy()) for o in outputs]
            field = record.fields[name]
            field.dtype = _OUT_DTYPES[outputs[0][name].dtype]
            field.trailing_shape.extend(arrays[0].shape[1:])
            field.data = b"".join(a.tobytes() for a in arrays)
            field.offsets = np.cumsum([0, *(a.nbytes for a in arrays)], dtype=np.int64).tobytes()
    return msg.SerializeToString()


def sample_response(resp: t.SampleResponse, prompt_logprobs_last_n: int | None) -> bytes:
    """Sequences as int32 tokens and float32 logprobs; prompt logprobs with NaN for "none" (and outside last_n),
    top-k prompt logprobs with Tinker's sentinel rows (also outside last_n), alternative prompt tokens."""
    msg = pb.SampleResponse()
    for seq in resp.sequences:
        out = msg.sequences.add()
        out.stop_reason = pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        out.tokens = np.asarray(seq.tokens, dtype="<i4").tobytes()
        if seq.logprobs is not None:
            out.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
        if seq.topk_logprobs is not None:
            _topk(out.topk_sampled_logprobs, seq.topk_logprobs, None)
    if resp.prompt_logprobs is not None:
        values = np.array([math.nan if v is None else v for v in resp.prompt_logprobs], dtype="<f4")
        if prompt_logprobs_last_n is not None:
            values[: max(0, values.size - prompt_logprobs_last_n)] = math.nan
        msg.prompt_logprobs = values.tobytes()
    if resp.topk_prompt_logprobs is not None:
        _topk(msg.topk_prompt_logprobs, resp.topk_prompt_logprobs, prompt_logprobs_last_n)
    if resp.target_prompt_logprobs is not None:
        _dense(msg.target_prompt_logprobs, resp.target_prompt_logprobs)
    if resp.prompt_alt_tokens is not None:
        _dense(msg.prompt_alt_tokens.tokens, resp.prompt_alt_tokens.tokens)
        _dense(msg.prompt_alt_tokens.logprobs, resp.prompt_alt_tokens.logprobs)
    return msg.SerializeToString()


def _topk(msg: pb.TopkLogprobs, topk: t.TopkLogprobs, last_n: int | None) -> None:
    ids, logprobs = topk.token_ids.to_numpy().astype("<i4"), topk.logprobs.to_numpy().astype("<f4")
    if last_n is not None:
        ids[: max(0, len(ids) - last_n)] = 0
        logprobs[: max(0, len(ids) - last_n)] = t.TOPK_MASK_LOGPROB
    msg.length, msg.k = ids.shape
    msg.token_ids, msg.logprobs = ids.tobytes(), logprobs.tobytes()


def _dense(msg: pb.Tensor, tensor: t.TensorData) -> None:
    array = tensor.to_numpy()
    msg.dtype = _OUT_DTYPES[tensor.dtype]
    msg.shape.extend(array.shape)
    msg.dense = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
