"""`m.Request` and `ids.request_id_of`: every request a client submits names its target and seq, and its id is
built from them in one place."""

from __future__ import annotations

import typing

import pytest

from bios import ids
from bios import messages as m
from bios import types as t

RUN = "s1:train:3"
SAMPLER = "s1:sample:2"

REQUESTS: list[tuple[m.Request, str, int]] = [
    (m.CreateModel("s1", 3, "bios/tiny-llama", t.LoraConfig()), RUN, 0),
    (m.ForwardBackward(RUN, 5, [], "cross_entropy"), RUN, 5),
    (m.OptimStep(RUN, 6, t.AdamParams()), RUN, 6),
    (m.SaveWeights(RUN, 7, "ckpt", "weights"), RUN, 7),
    (m.LoadWeights(RUN, 8, f"bios://{RUN}/weights/ckpt", optimizer=True), RUN, 8),
    (m.ReleaseSeq(RUN, 9, "the client gave it up"), RUN, 9),
    (m.Sample(SAMPLER, 4, t.ModelInput.from_ints([1, 2]), 1, t.SamplingParams()), SAMPLER, 4),
]


def test_every_request_type_is_in_the_union() -> None:
    assert set(typing.get_args(m.Request)) == set(m.REQUEST_TYPES)
    assert {type(op) for op, _, _ in REQUESTS} == set(m.REQUEST_TYPES)
    assert set(m.FORWARD_TYPES) <= set(m.REQUEST_TYPES)


@pytest.mark.parametrize(("op", "target", "seq"), REQUESTS, ids=[type(op).__name__ for op, _, _ in REQUESTS])
def test_request_id_of(op: m.Request, target: str, seq: int) -> None:
    assert (op.target, op.seq) == (target, seq)
    assert ids.request_id_of(op) == f"{target}#{seq}"
    assert ids.RequestId.parse(ids.request_id_of(op)) == ids.RequestId(target, seq)
    assert ids.target_of(ids.request_id_of(op)) == target


def test_a_create_is_request_zero_of_the_run_it_creates() -> None:
    create = m.CreateModel("abc", 7, "bios/tiny-llama", t.LoraConfig())
    assert ids.request_id_of(create) == ids.request_id(ids.run_id("abc", 7), 0)
