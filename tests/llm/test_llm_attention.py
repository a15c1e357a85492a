"""The ``litctx`` attention function and the KV-policy installer on tiny random Llama, Qwen2 and OLMo-2 models:
parity with transformers' SDPA (prefill and cached decoding, batch 2 with left padding), bit-identical
outputs with a no-op policy installed and after removal, and clean removal when the body raises."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("transformers", reason="the LLM substrate needs transformers (pip install -e '.[llm]')")

from lightning_modules.llm.model.attention import RUNNER_ATTR  # noqa: E402
from lightning_modules.llm.runtime.cached_lm import CachedLM  # noqa: E402
from lightning_modules.llm.model.loading import TINY_ARCHS, load_causal_lm  # noqa: E402
from lightning_modules.llm.kv_policy.protocol import Budget, KVPolicy, RecentScorer  # noqa: E402
from lightning_modules.llm.kv_policy.runner import SESSION_ATTR, active_session, install_policy  # noqa: E402
from lightning_modules.llm.runtime.stack import attention_modules  # noqa: E402


def _pair(arch: str, seed: int = 3):
    ours, _ = load_causal_lm(f"tiny-{arch}", with_tokenizer=False, seed=seed)
    stock, _ = load_causal_lm(f"tiny-{arch}", with_tokenizer=False, seed=seed, attn_implementation="sdpa")
    return ours, stock


def _batch(seed: int = 0, n: int = 13, pad: int = 5):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, n), generator=gen)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :pad] = 0  # row 1 is left-padded
    return ids, mask


def _run(model, ids, mask, steps: int = 4):
    """Prefill, then ``steps`` cached decode steps with fixed next tokens: logits at every real position."""
    lm = CachedLM(model)
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        full = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        outs = [lm.feed(ids, mask)]
        gen = torch.Generator().manual_seed(1)
        for _ in range(steps):
            outs.append(lm.feed(torch.randint(0, 256, (2, 1), generator=gen)))
    return full, torch.stack(outs, 1)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_litctx_matches_sdpa_prefill_and_decode_with_left_padding(arch):
    ours, stock = _pair(arch)
    ids, mask = _batch()
    full_a, steps_a = _run(ours, ids, mask)
    full_b, steps_b = _run(stock, ids, mask)
    real = mask.bool()
    assert torch.isfinite(full_a[real]).all()
    torch.testing.assert_close(full_a[real], full_b[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(steps_a, steps_b, atol=1e-5, rtol=0)
    # the padded row's real tokens equal the same tokens run alone (padding changes nothing)
    alone = ours(input_ids=ids[1:, 5:]).logits
    torch.testing.assert_close(full_a[1, 5:], alone[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_noop_policy_is_bit_identical_and_removed(arch):
    ours, _ = _pair(arch)
    ids, mask = _batch(seed=2)
    before = _run(ours, ids, mask)
    for policy in (KVPolicy(), KVPolicy(scorer=RecentScorer()), KVPolicy(budget=Budget(keep=4))):
        with install_policy(ours, policy) as session:
            assert active_session(ours) is session
            during = _run(ours, ids, mask)
        after = _run(ours, ids, mask)
        for a, b, c in zip(before, during, after):
            assert torch.equal(a, b) and torch.equal(a, c)
        assert not any(hasattr(m, RUNNER_ATTR) for m in attention_modules(ours))
        assert not hasattr(ours, SESSION_ATTR)
        assert not ours._forward_pre_hooks and not any(m._forward_pre_hooks for m in attention_modules(ours))


def test_policy_is_removed_when_the_body_raises():
    model, _ = load_causal_lm("tiny-llama", with_tokenizer=False, attn_implementation="sdpa")
    with pytest.raises(RuntimeError, match="boom"):
        with install_policy(model, KVPolicy(scorer=RecentScorer(), budget=Budget(keep=3))):
            assert model.config._attn_implementation == "litctx"
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    assert active_session(model) is None
    assert not any(hasattr(m, RUNNER_ATTR) or m._forward_pre_hooks for m in attention_modules(model))


def test_a_second_policy_and_a_model_without_attention_fail_clearly():
    model, _ = load_causal_lm("tiny-qwen2", with_tokenizer=False)
    with install_policy(model, KVPolicy()):
        with pytest.raises(RuntimeError, match="already installed"):
            with install_policy(model, KVPolicy()):
                pass
    with pytest.raises(ValueError, match="no attention layer"):
        with install_policy(torch.nn.Linear(2, 2), KVPolicy()):
            pass


# ------------------------------------------------------------------------------------------ policy actions
from lightning_modules.llm.kv_policy.protocol import (  # noqa: E402
    Action,
    OffloadCompensator,
    RandomScorer,
    Schedule,
    SharedTopKSelector,
)


def _prefill_then_decode(model, ids, mask, steps=3, policy=None):
    """Logits of the prefill's last position and of ``steps`` decode steps, plus the runner states."""
    import contextlib

    ctx = install_policy(model, policy) if policy is not None else contextlib.nullcontext()
    with ctx as session:
        lm = CachedLM(model)
        outs = [lm.feed(ids, mask)]
        sizes = [lm.cache.layers[0].keys.shape[2]]
        gen = torch.Generator().manual_seed(7)
        for _ in range(steps):
            outs.append(lm.feed(torch.randint(0, 256, (ids.shape[0], 1), generator=gen)))
            sizes.append(lm.cache.layers[0].keys.shape[2])
        states = {i: (r.state.slots.clone(), r.state.valid.clone()) for i, r in session.runners.items()} if session else {}
    return torch.stack(outs, 1), sizes, states, lm


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_eviction_with_an_exact_offload_compensator_reproduces_the_full_cache(arch):
    model, _ = load_causal_lm(f"tiny-{arch}", with_tokenizer=False, seed=5)
    ids, mask = _batch(seed=4, n=17, pad=6)
    full, _, _, _ = _prefill_then_decode(model, ids, mask)
    comp = OffloadCompensator()
    policy = KVPolicy(scorer=RandomScorer(1), budget=Budget(keep=5, sink=1, window=2), compensator=comp)
    got, sizes, _, lm = _prefill_then_decode(model, ids, mask, policy=policy)
    assert sizes[0] == 5 and comp.held_bytes() > 0  # the cache really shrank; the rest sits in the compensator
    torch.testing.assert_close(got, full, atol=1e-5, rtol=0)


def test_evict_and_mask_give_the_same_outputs_and_evict_frees_memory():
    model, _ = load_causal_lm("tiny-llama", with_tokenizer=False, seed=6)
    ids, mask = _batch(seed=8, n=20, pad=7)
    budget = Budget(compression_ratio=0.5, sink=2, window=3)
    ev, ev_sizes, ev_states, ev_lm = _prefill_then_decode(model, ids, mask,
                                                          policy=KVPolicy(scorer=RandomScorer(3), budget=budget))
    mk, mk_sizes, mk_states, mk_lm = _prefill_then_decode(model, ids, mask, policy=KVPolicy(
        scorer=RandomScorer(3), budget=budget, action=Action.MASK))
    torch.testing.assert_close(ev, mk, atol=1e-5, rtol=0)
    assert ev_sizes[0] == 10 and mk_sizes[0] == 20  # row 0: 20 valid -> 10 kept; masks keep memory
    assert ev_lm.cache_bytes() < mk_lm.cache_bytes()
    # kept slots: row 0 keeps 10 of 20, row 1 keeps floor(13 * 0.5) = 6 of its 13 real tokens (slots 7..19)
    slots, valid = ev_states[0]
    prefill_valid = valid[..., :10]
    assert prefill_valid[0].sum(-1).eq(10).all() and prefill_valid[1].sum(-1).eq(6).all()
    kept1 = slots[1, :, :10][prefill_valid[1]].view(2, 6)
    assert (kept1 >= 7).all()
    assert (kept1[:, :2] == torch.tensor([7, 8])).all()  # sinks: the row's first two real tokens
    assert (kept1[:, -3:] == torch.tensor([17, 18, 19])).all()  # window: its last three


def test_budgets_are_never_exceeded_and_count_sinks_and_windows():
    model, _ = load_causal_lm("tiny-olmo2", with_tokenizer=False, seed=2)
    ids, mask = _batch(seed=9, n=24, pad=4)
    budgets = (Budget(keep=6, sink=4, window=4), Budget(keep=3, sink=2, window=4),
               Budget(compression_ratio=0.75, sink=1, window=1), Budget(keep=8, head_scale=[0.5, 1.0]))
    for budget, compaction in itertools.product(budgets, ("inplace", "gather")):
        policy = KVPolicy(scorer=RandomScorer(0), budget=budget,
                          schedule=Schedule(prefill=True, decode_every=1, compaction=compaction))
        _, sizes, states, _ = _prefill_then_decode(model, ids, mask, steps=4, policy=policy)
        for layer, (slots, valid) in states.items():
            n_valid = mask.sum(-1).view(2, 1).expand(2, 2)
            cap = budget.capacity(n_valid, layer, 2)  # a ratio is resolved once, on the prompt
            assert (valid.sum(-1) <= cap).all(), (budget, valid.sum(-1), cap)
            # protected entries survive every step: the first min(sink, cap) real tokens
            for b in range(2):
                first = int((mask[b] == 0).sum())
                for h in range(2):
                    s = slots[b, h][valid[b, h]]
                    if compaction == "gather":
                        assert s.tolist() == sorted(s.tolist())  # kept entries stay in sequence order
                    s = s.sort().values  # in place, the new entry takes a dropped one's place
                    n_sink = min(budget.sink, int(cap[b, h]))
                    assert s[:n_sink].tolist() == list(range(first, first + n_sink))


def test_sparse_read_keeps_the_cache_whole_and_matches_masked_attention():
    model, _ = load_causal_lm("tiny-llama", with_tokenizer=False, seed=11)
    ids, mask = _batch(seed=1, n=15, pad=0)
    policy = KVPolicy(scorer=RecentScorer(), budget=Budget(keep=4, sink=1), action=Action.SPARSE_READ)
    got, sizes, _, _ = _prefill_then_decode(model, ids, mask, steps=2, policy=policy)
    assert sizes == [15, 16, 17]  # nothing removed
    # the first decode step against a brute force: its query reads the sink and the 3 most recent slots
    lm = CachedLM(model)
    with torch.no_grad():
        lm.feed(ids, mask)
        nxt = torch.randint(0, 256, (2, 1), generator=torch.Generator().manual_seed(7))
        # brute force: a full forward whose last query reads slots {0, 13, 14, 15} only
        full_ids = torch.cat([ids, nxt], 1)
        allowed = torch.zeros(16, 16, dtype=torch.bool)
        allowed[:15, :15] = torch.ones(15, 15, dtype=torch.bool).tril()
        allowed[15, [0, 13, 14, 15]] = True
        bias = torch.zeros(2, 1, 16, 16).masked_fill(~allowed, float("-inf"))
        ref = model(input_ids=full_ids, attention_mask=bias).logits[:, -1]
    torch.testing.assert_close(got[:, 1], ref, atol=1e-5, rtol=0)


def test_recompute_records_the_selection_and_shared_selector_picks_one_set_per_layer():
    model, _ = load_causal_lm("tiny-qwen2", with_tokenizer=False, seed=1)
    ids, mask = _batch(seed=3, n=12, pad=0)
    policy = KVPolicy(scorer=RandomScorer(4), selector=SharedTopKSelector(), budget=Budget(keep=5),
                      action=Action.RECOMPUTE)
    with install_policy(model, policy) as session:
        lm = CachedLM(model)
        lm.feed(ids, mask)
        sets = session.recompute_sets()
    assert set(sets) == {0, 1}
    for chosen in sets.values():
        assert chosen.sum(-1).eq(12 - 5).all()  # 7 entries to recompute per head
        assert torch.equal(chosen[:, 0], chosen[:, 1])  # one set shared by the KV heads
    assert lm.cache.layers[0].keys.shape[2] == 12  # recompute does not evict


@pytest.mark.parametrize("policy", [None, KVPolicy(scorer=RecentScorer(), budget=Budget(keep=10, sink=2)),
                                    KVPolicy(scorer=RandomScorer(2), budget=Budget(keep=12, window=4),
                                             schedule=Schedule(decode_every=1))])
def test_hf_generate_and_our_driver_agree_with_and_without_a_policy(policy):
    """transformers' ``generate`` (its own positions and masks) and :class:`CachedLM` give the same greedy
    tokens at batch 2 with left padding, also while a policy evicts at prefill or at every decode step."""
    import contextlib

    from lightning_modules.llm.decoding.generate import greedy_generate

    model, _ = load_causal_lm("tiny-llama", with_tokenizer=False, seed=1)
    ids, mask = _batch(seed=5, n=30, pad=6)
    ctx = install_policy(model, policy) if policy is not None else contextlib.nullcontext()
    with ctx:
        hf = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        ours = greedy_generate(model, ids, mask, 8)
    assert hf[:, 30:].tolist() == ours.tokens


def test_the_padding_mask_is_factored_once_per_forward():
    from lightning_modules.llm.model.attention import mask_to_key_mask

    n = 6
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    keys = torch.tensor([[False, True, True, True, True, True]])
    mask = (causal & keys[:, None, :]).view(1, 1, n, n)
    first = mask_to_key_mask(mask, n, n)
    assert torch.equal(first[0, 0], keys[0]) and mask_to_key_mask(mask, n, n) is first  # kept on the tensor
    window = mask.clone()
    window[0, 0, 5, 1] = False  # a sliding window: not causal x per-key
    assert mask_to_key_mask(window, n, n) is None and mask_to_key_mask(window, n, n) is None


def test_a_sparse_read_policy_decodes_through_the_compact_gather(monkeypatch):
    """A sparse_read policy's decode step reads its few entries through the sparse-read kit's compact gather
    (one fused call on the gathered keys), not a masked pass over the whole cache; the result is the masked
    reference's (the brute-force test above)."""
    import lightning_modules.llm.sparse_read.kit as sparse_read

    model, _ = load_causal_lm("tiny-llama", with_tokenizer=False, seed=11)
    ids, mask = _batch(seed=1, n=15, pad=0)
    calls = []
    real = sparse_read.sparse_read_attention

    def spy(query, key, value, read, scale=None, **kw):
        calls.append((query.shape[2], key.shape[2], int(read.sum())))
        return real(query, key, value, read, scale, **kw)

    monkeypatch.setattr(sparse_read, "sparse_read_attention", spy)
    policy = KVPolicy(scorer=RecentScorer(), budget=Budget(keep=4, sink=1), action=Action.SPARSE_READ)
    got, _, _, _ = _prefill_then_decode(model, ids, mask, steps=2, policy=policy)
    monkeypatch.setattr(sparse_read, "sparse_read_attention", real)
    ref, _, _, _ = _prefill_then_decode(model, ids, mask, steps=2, policy=policy)
    n_layers = model.config.num_hidden_layers
    assert len(calls) == 2 * n_layers  # both decode steps, every layer; never the prefill
    assert all(nq == 1 and nk in (16, 17) for nq, nk, _ in calls)
    torch.testing.assert_close(got, ref)


def test_dense_masked_attention_equals_a_float64_softmax_over_many_rows_and_empty_ones():
    from lightning_modules.llm.model import attention as la

    g = torch.Generator().manual_seed(0)
    b, hq, hk, nq, nk, d = 2, 4, 2, la.MASKED_ROWS_PER_CALL + 37, 90, 8
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h, n in ((hq, nq), (hk, nk), (hk, nk)))
    mask = torch.rand(b, 1, nq, nk, generator=g) > 0.6
    mask[0, 0, 5] = False  # a row with no live key
    got = la.dense_masked_attention(q, k, v, mask, 0.3)
    kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * 0.3
    s = s.masked_fill(~mask, float("-inf"))
    live = mask.any(-1, keepdim=True)
    ref = torch.softmax(torch.where(live, s, torch.zeros_like(s)), -1) @ vv * live
    assert torch.allclose(got.double(), ref, atol=1e-5)
    assert torch.equal(got[0, :, 5], torch.zeros_like(got[0, :, 5]))
    additive = torch.where(mask, 0.0, float("-inf"))
    assert torch.allclose(la.dense_masked_attention(q, k, v, additive, 0.3), got, atol=1e-6)
