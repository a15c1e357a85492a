"""Sliding-window layers (Qwen2's ``max_window_layers``, Gemma-3-style interleaved ``layer_types``) through the
``litctx`` attention, with and without a KV policy, on tiny random Qwen2 models whose prompts are longer than
the window:

* without a policy and with a no-op one, logits equal transformers' own eager and SDPA attention (prefill of a
  left-padded batch, then cached decode steps), and the sliding layers' caches stay at the window;
* under eviction policies, every sliding-layer attention call equals a float64 brute force that masks by the
  entries' original positions (so no query reads outside its window), decoding runs, and dead entries leave
  the cache;
* ``window_attention`` itself (contiguous and evicted views, GQA) against the brute force.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the LLM substrate needs transformers (pip install -e '.[llm]')")

from lightning_modules.llm.kv_policy import runner as runner_mod  # noqa: E402  (window_attention's two callers)
from lightning_modules.llm.runtime import stack as session_mod  # noqa: E402
from lightning_modules.llm.model.attention import mask_to_key_mask  # noqa: E402
from lightning_modules.llm.runtime.cached_lm import CachedLM  # noqa: E402
from lightning_modules.llm.decoding.generate import greedy_generate  # noqa: E402
from lightning_modules.llm.model.loading import load_causal_lm  # noqa: E402
from lightning_modules.llm.kv_policy.protocol import Action, Budget, KVPolicy, RandomScorer, RecentScorer, Schedule  # noqa: E402
from lightning_modules.llm.kv_policy.runner import install_policy, window_attention  # noqa: E402

WINDOW = 6
PATTERNS = {  # which layers slide
    "qwen2_top_layers": {"max_window_layers": 1},  # layers 1, 2 slide (Qwen2's rule: i >= max_window_layers)
    "interleaved": {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},  # Gemma-3-like
}


def _model(pattern: str, attn: str = "litctx", seed: int = 11):
    tiny = dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, **PATTERNS[pattern])
    model, _ = load_causal_lm("tiny-qwen2", with_tokenizer=False, seed=seed, attn_implementation=attn, tiny=tiny)
    return model


def _sliding_layers(model):
    return [i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention"]


def _batch(n: int = 19, pad: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, n), generator=gen)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :pad] = 0
    return ids, mask


def _drive(model, ids, mask, steps: int = 5, policy=None):
    """Prefill then ``steps`` decode steps with fixed tokens: the logits ``[B, 1 + steps, V]`` and the cache."""
    import contextlib

    ctx = install_policy(model, policy) if policy is not None else contextlib.nullcontext()
    gen = torch.Generator().manual_seed(3)
    with ctx:
        lm = CachedLM(model)
        outs = [lm.feed(ids, mask)]
        for _ in range(steps):
            outs.append(lm.feed(torch.randint(0, 256, (ids.shape[0], 1), generator=gen)))
    return torch.stack(outs, 1), lm


def brute_window_attention(q, k, v, slots, valid, scale, window, first_slot):
    """float64: query ``i`` (slot ``first_slot + i``) reads valid entries with ``slot_i - window < slot <= slot_i``.
    Returns ``o [B, Hq, Nq, dv]`` (zeros for a query with nothing to read)."""
    b, hq, n_q, _ = q.shape
    g = hq // k.shape[1]
    kk = k.double().repeat_interleave(g, 1)
    vv = v.double().repeat_interleave(g, 1)
    sl = slots.repeat_interleave(g, 1).unsqueeze(-2)  # [B, Hq, 1, N]
    ok = valid.repeat_interleave(g, 1).unsqueeze(-2)
    pos = (first_slot + torch.arange(n_q)).view(1, 1, n_q, 1)
    allowed = ok & (sl <= pos) & (sl > pos - window)
    s = torch.matmul(q.double(), kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    live = allowed.any(-1, keepdim=True)
    p = torch.softmax(torch.where(live, s, torch.zeros_like(s)), -1) * live
    return torch.matmul(p, vv)


# ------------------------------------------------------------------------------------------ no policy, no-op
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("stock", ["eager", "sdpa"])
def test_sliding_layers_match_transformers_without_and_with_a_noop_policy(pattern, stock):
    ours, theirs = _model(pattern), _model(pattern, attn=stock)
    assert _sliding_layers(ours) and len(_sliding_layers(ours)) < 3
    ids, mask = _batch()
    want, _ = _drive(theirs, ids, mask)
    plain, _ = _drive(ours, ids, mask)
    torch.testing.assert_close(plain, want, atol=1e-5, rtol=0)
    got, lm = _drive(ours, ids, mask, policy=KVPolicy())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # the window really matters here (the same model with full attention everywhere differs)
    full = _model(pattern)
    full.config.layer_types = ["full_attention"] * 3
    for m in full.modules():
        if hasattr(m, "sliding_window"):
            m.sliding_window = None
    other, _ = _drive(full, ids, mask)
    assert (other - want).abs().max() > 1e-3
    # under the policy the sliding layers hold only what the next query can read: the last W - 1 entries
    n_seen = ids.shape[1] + 5
    for i, layer in enumerate(lm.cache.layers):
        expect = WINDOW - 1 if i in _sliding_layers(ours) else n_seen
        assert layer.keys.shape[2] == expect, (i, layer.keys.shape)


def test_a_policy_needs_a_mask_that_factors_with_the_layers_window():
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    pad = torch.ones(2, 12, dtype=torch.bool)
    pad[1, :3] = False
    m = sdpa_mask(batch_size=2, q_length=12, kv_length=12, mask_function=sliding_window_causal_mask_function(4),
                  attention_mask=pad, allow_is_causal_skip=False)
    assert mask_to_key_mask(m, 12, 12) is None  # not plain causal x padding
    assert mask_to_key_mask(m, 12, 12, window=5) is None  # nor another window
    km = mask_to_key_mask(m, 12, 12, window=4)
    assert km is not None and torch.equal(km[:, 0], pad)
    assert mask_to_key_mask(m, 12, 12, window=4) is km  # computed once per mask and window


# ------------------------------------------------------------------------------------------ eviction
POLICIES = {
    "random_evict_every_step": KVPolicy(scorer=RandomScorer(2), budget=Budget(keep=3, sink=1),
                                        schedule=Schedule(prefill=True, decode_every=1, append=True)),
    "recent_evict_at_prefill": KVPolicy(scorer=RecentScorer(), budget=Budget(keep=4, sink=2)),
    "random_mask": KVPolicy(scorer=RandomScorer(5), budget=Budget(compression_ratio=0.5), action=Action.MASK,
                            schedule=Schedule(prefill=True, decode_every=2, append=True)),
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("name", list(POLICIES))
def test_eviction_on_sliding_layers_never_reads_outside_the_window(pattern, name, monkeypatch):
    model = _model(pattern)
    sliding = _sliding_layers(model)
    calls = []
    real = session_mod.window_attention

    def recording(q, k, v, slots, valid, scale, window, first_slot):
        out = real(q, k, v, slots, valid, scale, window, first_slot)
        calls.append((q, k, v, slots.clone(), valid.clone(), scale, window, first_slot, out[0]))
        return out

    monkeypatch.setattr(session_mod, "window_attention", recording)
    monkeypatch.setattr(runner_mod, "window_attention", recording)
    ids, mask = _batch(n=21, pad=5, seed=4)
    question = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(8))
    with install_policy(model, POLICIES[name]) as session:
        res = greedy_generate(model, ids, mask, 6, question_ids=question)
        for layer in sliding:  # nothing the next query cannot read is still valid, and dead prefixes are gone
            st = session.runners[layer].state
            assert not bool((st.valid & (st.slots <= st.seen - WINDOW)).any())
            assert st.slots.shape[-1] <= max(WINDOW, int(st.valid.sum(-1).max()) + WINDOW)
    assert all(len(t) == 6 for t in res.tokens)  # it decodes (no stop ids: every row runs 6 steps)
    phases = {(c[0].shape[2] > 1, c[7] > 0) for c in calls}
    assert phases == {(True, False), (True, True), (False, True)}  # prefill, appended question, decode steps
    assert len(calls) == len(sliding) * (2 + 5)
    if POLICIES[name].action is Action.EVICT:  # an evicted view is scattered by slot (not plain column order)
        assert any(not bool((c[3].diff(dim=-1) == 1).all()) for c in calls if c[1].shape[2] > 1)
    for q, k, v, slots, valid, scale, window, first, out in calls:
        assert window == WINDOW
        ref = brute_window_attention(q, k, v, slots, valid, scale, window, first)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("gqa", [1, 2])
def test_window_attention_matches_the_brute_force_on_contiguous_and_evicted_views(gqa):
    gen = torch.Generator().manual_seed(0)
    b, hk, d, n_q, w = 2, 2, 8, 3, 5
    for first, keep in ((0, None), (9, None), (30, 7)):
        if keep is None:  # contiguous: slots first - n_old .. first + n_q - 1
            n_old = first
            slots = torch.arange(first + n_q).expand(b, hk, -1)
        else:  # an evicted view: `keep` old entries per head at scattered slots, some invalid padding
            old = torch.stack([torch.randperm(first, generator=gen)[:keep].sort().values for _ in range(b * hk)])
            slots = torch.cat([old.view(b, hk, keep), (first + torch.arange(n_q)).expand(b, hk, -1)], -1)
            n_old = keep
        n = n_old + n_q
        valid = torch.rand(b, hk, n, generator=gen) > 0.2
        valid[..., -n_q:] = True
        q = torch.randn(b, hk * gqa, n_q, d, generator=gen)
        k, v = torch.randn(b, hk, n, d, generator=gen), torch.randn(b, hk, n, d, generator=gen)
        o, lse = window_attention(q, k, v, slots, valid, d ** -0.5, w, first)
        ref = brute_window_attention(q, k, v, slots, valid, d ** -0.5, w, first)
        torch.testing.assert_close(o.double(), ref, atol=1e-5, rtol=0)
        assert lse.shape == (b, hk * gqa, n_q)


def test_a_compensator_on_a_sliding_layer_is_refused_by_name():
    from lightning_modules.llm.kv_policy.protocol import OffloadCompensator

    model = _model("qwen2_top_layers")
    ids, mask = _batch()
    policy = KVPolicy(scorer=RecentScorer(), budget=Budget(keep=4), compensator=OffloadCompensator())
    with pytest.raises(ValueError, match=r"layer 1 is a sliding-window layer \(window 6\).*full-attention layers"):
        _drive(model, ids, mask, policy=policy)
    # acting on the full-attention layer only is fine: the sliding layers never hand the compensator anything
    comp = OffloadCompensator()
    policy = KVPolicy(scorer=RecentScorer(), budget=Budget(keep=4), compensator=comp, layers=[0])
    _drive(model, ids, mask, policy=policy)
    assert comp.held_bytes() > 0 and set(comp._store) == {0}


def test_sparse_prefill_leaves_sliding_layers_exact():
    from lightning_modules.sparse_prefill.estimators import DenseEstimator
    from lightning_modules.sparse_prefill.session import install_sparse_prefill

    ours, theirs = _model("interleaved"), _model("interleaved", attn="eager")
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(input_ids=ids).logits
        with install_sparse_prefill(ours, DenseEstimator(), min_length=8) as sp:
            got = ours(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert {r["layer"] for r in sp.records} == {1}  # only the full-attention layer ran the estimator
