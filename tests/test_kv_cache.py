"""The decode cache with reserved room (bios.worker.kv_cache): after `reserve_decode_room` a prefilled cache
returns exactly the keys and values Transformers' growing cache returns, through updates past the reserve and
row reorders, and leaves layers of other kinds alone."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from bios.worker.kv_cache import reserve_decode_room


def _states(generator, rows, positions):
    return torch.randn(rows, 2, positions, 4, generator=generator), torch.randn(rows, 2, positions, 4,
                                                                                generator=generator)


def test_a_cache_with_room_returns_what_the_growing_cache_returns():
    generator = torch.Generator().manual_seed(0)
    plain, roomy = DynamicCache(), DynamicCache()
    prompt = [_states(generator, 5, 7) for _ in range(2)]
    for layer, (keys, values) in enumerate(prompt):
        plain.update(keys, values, layer)
        roomy.update(keys, values, layer)
    assert reserve_decode_room(roomy, 3) == 2
    for step in range(6):  # three steps into the reserve, then past it
        if step == 4:
            keep = torch.tensor([4, 0, 2])
            plain.reorder_cache(keep)
            roomy.reorder_cache(keep)
        rows = 5 if step < 4 else 3
        for layer in range(2):
            keys, values = _states(generator, rows, 1)
            expected = plain.update(keys, values, layer)
            got = roomy.update(keys, values, layer)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert roomy.get_seq_length() == plain.get_seq_length() == 13


def test_steps_within_the_reserve_write_into_the_reserved_buffers():
    """No step inside the reserve copies the cache again (the first step once did: the layer's keys were still
    the prefill's tensors, so it reserved anew, and again when that room ran out)."""
    generator = torch.Generator().manual_seed(3)
    cache = DynamicCache()
    cache.update(*_states(generator, 4, 6), 0)
    reserve_decode_room(cache, 5, torch.float64)
    layer = cache.layers[0]
    buffers = layer.keys.data_ptr(), layer.values.data_ptr()
    assert layer.keys.dtype == torch.float64 and layer.keys.shape[-2] == 6
    for _ in range(5):
        keys, values = cache.update(*_states(generator, 4, 1), 0)
        assert (keys.data_ptr(), values.data_ptr()) == buffers
    assert keys.shape[-2] == 11


def test_layers_of_other_kinds_and_empty_layers_keep_their_own_code():
    cache = DynamicCache()
    keys, values = _states(torch.Generator().manual_seed(1), 2, 3)
    cache.update(keys, values, 0)
    cache.layers.append(DynamicSlidingWindowLayer(sliding_window=4))
    cache.layers.append(DynamicLayer())  # never filled
    assert reserve_decode_room(cache, 5) == 1
    assert type(cache.layers[1]) is DynamicSlidingWindowLayer and type(cache.layers[2]) is DynamicLayer


def test_keys_replaced_by_the_layers_own_methods_are_taken_up():
    generator = torch.Generator().manual_seed(2)
    plain, roomy = DynamicCache(), DynamicCache()
    keys, values = _states(generator, 4, 5)
    plain.update(keys, values, 0)
    roomy.update(keys, values, 0)
    reserve_decode_room(roomy, 8)
    for cache in (plain, roomy):
        cache.layers[0].batch_select_indices(torch.tensor([1, 3]))
        cache.layers[0].crop(-2)
    keys, values = _states(generator, 2, 1)
    expected, got = plain.update(keys, values, 0), roomy.update(keys, values, 0)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_room_in_another_dtype_holds_the_same_values_in_it():
    """A bf16 model's decode cache kept in fp32 (what `cpu_attention` reads): every step returns the growing
    cache's keys and values, exactly, in fp32, through a reorder and past the reserve."""
    generator = torch.Generator().manual_seed(3)
    plain, roomy = DynamicCache(), DynamicCache()
    keys, values = (t.bfloat16() for t in _states(generator, 3, 4))
    plain.update(keys, values, 0)
    roomy.update(keys, values, 0)
    assert reserve_decode_room(roomy, 2, torch.float32) == 1
    for step in range(4):
        if step == 1:
            plain.reorder_cache(torch.tensor([2, 0, 1]))
            roomy.reorder_cache(torch.tensor([2, 0, 1]))
        keys, values = (t.bfloat16() for t in _states(generator, 3, 1))
        expected, got = plain.update(keys, values, 0), roomy.update(keys, values, 0)
        assert got[0].dtype == got[1].dtype == torch.float32
        assert torch.equal(got[0], expected[0].float()) and torch.equal(got[1], expected[1].float())
