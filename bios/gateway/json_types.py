"""The `tinker.types` values inside Tinker request bodies, read from their JSON forms.

A `ModelInput`'s chunks (token ids, base64 images, image pointers), `SamplingParams`, and
`target_prompt_logprobs` (a dense or sparse CSR table of token ids, read into a dense one). `json_wire` builds
request messages out of these; each is typed strictly, a missing or mistyped field a BadRequestError naming it.
"""

from __future__ import annotations

import base64
import binascii

from bios import types as t
from bios.exceptions import BadRequestError

from .json_body import Body


def target_ids(body: Body | None) -> t.TensorData | None:
    """Tinker's `target_prompt_logprobs` in its JSON form (`data`, `dtype`, `shape`, optionally sparse CSR with
    `sparse_crow_indices` / `sparse_col_indices`): a dense int64 table, -1 in the cells a sparse one leaves out
    (they request nothing)."""
    if body is None:
        return None
    import numpy as np

    where = "target_prompt_logprobs"
    data, shape = body.array("data"), body.array("shape", None)
    if body.text("dtype", "int64") != "int64" or not all(isinstance(x, int) and not isinstance(x, bool)
                                                          for x in data):
        raise BadRequestError(f"{where} must hold int64 token ids", field=where)
    if shape is None or len(shape) != 2 or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise BadRequestError(f"{where} needs a 2-D shape [len(prompt) - 1, K]", field=f"{where}.shape")
    values = np.asarray(data, dtype=np.int64)
    crow, cols = body.array("sparse_crow_indices", None), body.array("sparse_col_indices", None)
    if crow is None and cols is None:
        if values.size != shape[0] * shape[1]:
            raise BadRequestError(f"{where} holds {values.size} values but its shape is {shape}", field=where)
        return t.TensorData(values.reshape(shape), "int64")
    try:
        crow_a, cols_a = np.asarray(crow, dtype=np.int64), np.asarray(cols, dtype=np.int64)
    except (TypeError, ValueError):
        crow_a = cols_a = np.zeros(0, dtype=np.int64)
    rows_n, cols_n = shape
    if (crow_a.ndim != 1 or crow_a.size != rows_n + 1 or cols_a.size != values.size or crow_a[0] != 0
            or crow_a[-1] != values.size or (np.diff(crow_a) < 0).any()
            or (cols_a.size and (cols_a.min() < 0 or cols_a.max() >= cols_n))):
        raise BadRequestError(f"{where} has inconsistent sparse CSR indices for shape {shape}", field=where)
    dense = np.full(shape, -1, dtype=np.int64)
    dense[np.repeat(np.arange(rows_n), np.diff(crow_a)), cols_a] = values
    return t.TensorData(dense, "int64")


def model_input(body: Body) -> t.ModelInput:
    """Token, image (base64 `data`) and image-pointer chunks, as the tinker SDK's `ModelInput` writes them."""
    chunks: list[t.ModelInputChunk] = []
    for i, chunk in enumerate(body.array("chunks")):
        part = Body(chunk, f"{body.where}.chunks[{i}]")
        kind = part.text("type", "encoded_text")
        if kind == "encoded_text":
            ids = part.array("tokens")
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
                raise BadRequestError(f"{part.where}.tokens must be integers", field=f"{part.where}.tokens")
            chunks.append(t.EncodedTextChunk(ids))
        elif kind == "image":
            try:
                data = base64.b64decode(part.text("data"), validate=True)
            except binascii.Error:
                raise BadRequestError(f"{part.where}.data is not base64", field=f"{part.where}.data") from None
            chunks.append(t.ImageChunk(data, part.text("format"), part.integer("expected_tokens", None)))
        elif kind == "image_asset_pointer":
            chunks.append(t.ImageAssetPointerChunk(part.text("format"), part.text("location"),
                                                   part.integer("expected_tokens", None)))
        else:
            raise BadRequestError(f"{part.where} is a {kind} chunk; Bios takes encoded_text, image and "
                                  "image_asset_pointer chunks", field=part.where)
    return t.ModelInput(chunks)


def sampling_params(body: Body) -> t.SamplingParams:
    stop = body.data.get("stop")
    valid = stop is None or isinstance(stop, str) or (
        isinstance(stop, list) and (all(isinstance(s, str) for s in stop)
                                    or all(isinstance(s, int) and not isinstance(s, bool) for s in stop)))
    if not valid:
        raise BadRequestError(f"{body.where}.stop must be a string, a list of strings or a list of token ids",
                              field=f"{body.where}.stop")
    return t.SamplingParams(
        max_tokens=body.integer("max_tokens", None),
        seed=body.integer("seed", None),
        stop=stop,
        temperature=body.number("temperature", 1.0),
        top_k=body.integer("top_k", -1),
        top_p=body.number("top_p", 1.0),
        min_p=body.number("min_p", 0.0),
        repetition_penalty=body.number("repetition_penalty", 1.0),
        presence_penalty=body.number("presence_penalty", 0.0),
        frequency_penalty=body.number("frequency_penalty", 0.0),
    )
