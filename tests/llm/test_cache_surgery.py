"""Cache surgery on tiny Llama / Qwen2 / OLMo-2: re-rotation equals computing at the final positions (also with
Llama-3 and YaRN scaled RoPE), assembly + recomputing every context token equals full prefill, recomputing none
equals naive reuse, the selective forward with every token selected equals the normal forward (also on ragged
batches), a layer hook that drops rows leaves their later layers stale, and the one-line refusals."""

from __future__ import annotations

import pytest
import torch

from lightning_modules.llm.runtime.cache_surgery import (assemble, compute_segments, rerotate_keys, selective_forward,
                                                 check_cache_surgery)
from lightning_modules.llm.runtime.cached_lm import CachedLM
from lightning_modules.llm.model.loading import load_causal_lm
from lightning_modules.llm.model.surgery import SurgeryError

pytestmark = pytest.mark.usefixtures("torch_seed")

ARCHS = ("llama", "qwen2", "olmo2")
ROPES = {
    "default": {},
    "llama3": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "yarn": {"max_position_embeddings": 1024,
             "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 256}},
}


def tiny(arch="llama", dtype="float32", layers=3, **over):
    model, _ = load_causal_lm(f"tiny-{arch}", with_tokenizer=False, dtype=dtype,
                              tiny={"num_hidden_layers": layers, **over})
    return model


def toks(n, seed, vocab=256):
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def keys_at(model, ids, start):
    """Every layer's keys of ``ids`` computed alone at positions ``start ..``: ``[L] x [1, Hk, n, d]``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    pos = torch.arange(start, start + len(ids)).unsqueeze(0)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), position_ids=pos, cache=cache, use_cache=True)
    return [layer.keys for layer in cache.layers]


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_rerotation_equals_computing_at_the_final_positions(arch, rope):
    model = tiny(arch, dtype="float64", **ROPES[rope])
    ids = toks(12, 0)
    at_a, at_b = keys_at(model, ids, 5), keys_at(model, ids, 333)
    moved = [rerotate_keys(model, k, torch.arange(5, 17), torch.arange(333, 345)) for k in at_a]
    for layer, (m, b) in enumerate(zip(moved, at_b)):
        assert torch.allclose(m, b, atol=1e-5, rtol=1e-5), (layer, float((m - b).abs().max()))
    # and it is a real move: the keys at the old positions differ
    assert float((at_a[0] - at_b[0]).abs().max()) > 1e-2


def test_rerotation_round_trip_is_exact_in_float32_with_scaled_rope():
    model = tiny("qwen2", **ROPES["yarn"])
    k = torch.randn(2, 2, 7, 16)
    there = rerotate_keys(model, k, torch.arange(7), torch.arange(900, 907))
    back = rerotate_keys(model, there, torch.arange(900, 907), torch.arange(7))
    assert torch.allclose(back, k, atol=1e-5)
    assert not torch.allclose(there, k, atol=1e-2)


def _prompt(n_chunks=3, seed=0):
    prefix = toks(5, 100 + seed)
    chunks = [toks(6 + 2 * i, 200 + seed + i) for i in range(n_chunks)]
    question = toks(4, 300 + seed)
    return prefix, chunks, question


def _full_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ARCHS)
def test_recomputing_every_context_token_equals_full_prefill(arch):
    model = tiny(arch)
    prefix, chunks, question = _prompt()
    segs = compute_segments(model, chunks, prefix)
    ctx = assemble(model, [segs], prefix)
    full = _full_logits(model, prefix + sum(chunks, []) + question)
    every = torch.tensor([ctx.chunk_columns[0]])
    logits = selective_forward(ctx, every, torch.tensor([question]), n_logits=len(question))
    assert torch.allclose(logits[0], full[-len(question):], atol=1e-4), float((logits[0] - full[-4:]).abs().max())
    # decoding continues from the recomputed cache exactly as from a full prefill
    lm = CachedLM(model)
    first = lm.feed(torch.tensor([prefix + sum(chunks, []) + question]))
    assert ctx.lm.greedy(logits[:, -1], 6) == lm.greedy(first, 6)


@pytest.mark.parametrize("arch", ARCHS)
def test_recomputing_nothing_equals_naive_reuse_and_naive_reuse_differs_from_full_prefill(arch):
    model = tiny(arch)
    prefix, chunks, question = _prompt()
    segs = compute_segments(model, chunks, prefix)
    naive = assemble(model, [segs], prefix).lm.feed(torch.tensor([question]))
    ctx = assemble(model, [segs], prefix)
    none = selective_forward(ctx, torch.empty(1, 0, dtype=torch.long), torch.tensor([question]))[:, -1]
    assert torch.allclose(none, naive, atol=1e-5)
    full = _full_logits(model, prefix + sum(chunks, []) + question)[-1]
    assert float((naive[0] - full).abs().max()) > 1e-3  # stale chunks do change the answer distribution


def test_the_first_chunk_behind_the_prefix_is_exact_without_recomputation():
    model = tiny("llama")
    prefix, chunks, _ = _prompt()
    segs = compute_segments(model, chunks, prefix)
    ctx = assemble(model, [segs], prefix)
    ref = CachedLM(model)
    ref.feed(torch.tensor([prefix + sum(chunks, [])]))
    s, e = ctx.spans[0][0]
    for got, want in zip(ctx.lm.cache.layers, ref.cache.layers):
        assert torch.allclose(got.keys[:, :, :e], want.keys[:, :, :e], atol=1e-5)
        assert torch.allclose(got.values[:, :, :e], want.values[:, :, :e], atol=1e-5)
    assert ctx.lm.positions[0].tolist() == list(range(ref.positions.shape[1]))


@pytest.mark.parametrize("arch", ARCHS)
def test_selective_forward_with_every_token_selected_equals_the_normal_forward_on_a_ragged_batch(arch):
    model = tiny(arch)
    rows = [_prompt(2, 0), _prompt(3, 7)]
    prefix = rows[0][0]
    ctx = assemble(model, [compute_segments(model, chunks, prefix) for _, chunks, _ in rows], prefix)
    width = max(len(c) for c in ctx.chunk_columns)
    slots = torch.full((2, width), -1, dtype=torch.long)
    for r, cols in enumerate(ctx.chunk_columns):  # in reverse order: the layout, not the order, matters
        slots[r, :len(cols)] = torch.tensor(cols[::-1])
    q = torch.tensor([[0, 0] + rows[0][2][:2], rows[1][2]])
    qm = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    logits = selective_forward(ctx, slots, q, qm)[:, -1]
    for r, (_, chunks, question) in enumerate(rows):
        ids = prefix + sum(chunks, []) + (question[:2] if r == 0 else question)
        assert torch.allclose(logits[r], _full_logits(model, ids)[-1], atol=1e-4), r


def test_a_layer_hook_that_drops_rows_leaves_their_later_layers_stale():
    model = tiny("llama", layers=4)
    prefix, chunks, question = _prompt()
    segs = compute_segments(model, chunks, prefix)
    stale = assemble(model, [segs], prefix)
    ctx = assemble(model, [segs], prefix)
    cols = ctx.chunk_columns[0]
    seen = []

    def hook(step):
        seen.append((step.layer, step.slots.shape[1]))
        if step.layer == 1:  # keep the first half of the rows from layer 2 on
            keep = torch.zeros_like(step.slots, dtype=torch.bool)
            keep[:, : step.slots.shape[1] // 2] = True
            return keep
        return None

    selective_forward(ctx, torch.tensor([cols]), torch.tensor([question]), layer_hook=hook)
    half = len(cols) // 2
    assert seen == [(0, len(cols)), (1, len(cols)), (2, half), (3, half)]
    dropped, kept = cols[half:], cols[:half]
    for layer in (2, 3):
        got, old = ctx.lm.cache.layers[layer], stale.lm.cache.layers[layer]
        assert torch.equal(got.values[:, :, dropped], old.values[:, :, dropped])
        assert not torch.allclose(got.values[:, :, kept], old.values[:, :, kept], atol=1e-6)
    # layer 1 (layer 0's values depend on the token alone) was recomputed for the dropped rows too
    got, old = ctx.lm.cache.layers[1], stale.lm.cache.layers[1]
    assert not torch.allclose(got.values[:, :, dropped], old.values[:, :, dropped], atol=1e-6)


def test_bad_input_is_refused_in_one_line():
    with pytest.raises(SurgeryError, match="sliding-window"):
        check_cache_surgery(tiny("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1))
    with pytest.raises(SurgeryError, match="rope_type='dynamic'"):
        check_cache_surgery(tiny("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                             "factor": 2.0}))
    model = tiny("llama")
    prefix, chunks, question = _prompt()
    segs = compute_segments(model, chunks, prefix)
    with pytest.raises(ValueError, match="behind a 5-token prefix"):
        assemble(model, [segs], prefix[:3])
    ctx = assemble(model, [segs], prefix)
    with pytest.raises(ValueError, match="slots must be"):
        selective_forward(ctx, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="the cache has"):
        selective_forward(ctx, torch.tensor([[999]]))
