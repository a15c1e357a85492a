"""The slot-buffer cache layer: appends in place, grows with room, never writes a tensor it adopted, and moves
entries into dropped ones' places."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the LLM substrate needs transformers (pip install -e '.[llm]')")

from transformers.cache_utils import DynamicCache, DynamicLayer  # noqa: E402

from lightning_modules.llm.runtime.slot_buffer import SlotBufferLayer, as_slot_buffer  # noqa: E402


def _kv(n, seed, b=2, h=3, d=4):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, n, d, generator=gen), torch.randn(b, h, n, d, generator=gen)


def test_appends_equal_concatenation_and_reuse_the_buffer_once_it_has_room():
    layer, plain = SlotBufferLayer(slack=4), DynamicLayer()
    k0, v0 = _kv(5, 0)
    shared_k = k0.clone()
    layer.update(shared_k, v0)
    plain.update(k0, v0)
    buffers = []
    for step in range(7):
        k, v = _kv(1 + step % 2, step + 1)
        got = layer.update(k, v)
        want = plain.update(k, v)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        buffers.append(layer._buf["keys"].data_ptr())
        assert layer.get_seq_length() == plain.get_seq_length()
    assert torch.equal(shared_k, k0)  # the adopted tensor was copied before the first in-place write
    assert len(set(buffers)) < len(buffers)  # most appends reused the buffer


def test_a_cache_held_at_its_budget_appends_in_place_into_a_contiguous_view():
    """Without slack, the one place a step's eviction frees takes the next step's entry: no new buffer, and the
    view the attention reads is the whole buffer."""
    layer = SlotBufferLayer()
    k, v = _kv(8, 7)
    layer.update(k, v)
    first = None
    for step in range(5):
        k1, v1 = _kv(1, 10 + step)
        keys, values = layer.update(k1, v1)
        assert keys.is_contiguous() and values.is_contiguous()
        first = first or layer._buf["keys"].data_ptr()
        assert layer._buf["keys"].data_ptr() == first
        layer.fill(torch.full((2, 3, 1), step), 8, 8)  # the new entry replaces entry `step`
        assert torch.equal(layer.keys[:, :, step], k1[:, :, 0])


def test_fill_moves_entries_per_head_and_cuts_the_length():
    layer = SlotBufferLayer(slack=2)
    k, v = _kv(6, 3, b=1, h=2)
    layer.update(k, v)
    # head 0: the entry at 5 takes place 1; head 1: place 3 (entry 4 stays where it is, past the new length)
    dest = torch.tensor([[[1, 4], [3, 4]]])
    layer.fill(dest, 4, 4)
    assert layer.keys.shape[-2] == 4 and layer.values.shape[-2] == 4
    assert torch.equal(layer.keys[0, 0, 1], k[0, 0, 4]) and torch.equal(layer.keys[0, 1, 3], k[0, 1, 4])
    assert torch.equal(layer.values[0, 0, 0], v[0, 0, 0]) and torch.equal(layer.values[0, 1, 1], v[0, 1, 1])


def test_assigning_keys_adopts_and_crop_and_reset_behave_like_a_dynamic_layer():
    layer = SlotBufferLayer()
    k, v = _kv(5, 4)
    layer.keys, layer.values = k, v
    layer.is_initialized = True
    assert layer.keys.data_ptr() == k.data_ptr() and torch.equal(layer.keys, k)  # adopted, not copied
    layer.crop(-2)
    assert layer.get_seq_length() == 3 and torch.equal(layer.keys, k[:, :, :3])
    with pytest.raises(ValueError, match="negative count"):
        layer.crop(2)
    layer.reset()
    assert layer.keys is None and not layer.is_initialized


def test_as_slot_buffer_replaces_a_dynamic_layer_in_its_cache_and_rejects_other_layers():
    cache = DynamicCache()
    k, v = _kv(3, 5)
    cache.update(k, v, 0)
    layer = as_slot_buffer(cache, 0)
    assert cache.layers[0] is layer and torch.equal(layer.keys, k)
    assert as_slot_buffer(cache, 0) is layer
    k2, v2 = _kv(1, 6)
    cache.update(k2, v2, 0)
    assert cache.get_seq_length() == 4

    class Other(DynamicLayer):
        pass

    cache.layers[0] = Other()
    with pytest.raises(TypeError, match="DynamicLayer"):
        as_slot_buffer(cache, 0)
    with pytest.raises(ValueError, match="slack"):
        SlotBufferLayer(slack=-1)
