"""The KV-policy protocol's parts against brute force: budgets, protected sets, selectors, the observation's
lazy window statistics."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lightning_modules.llm.kv_policy.protocol import (
    Budget,
    KVObservation,
    KVPolicy,
    RandomScorer,
    RecentScorer,
    SharedTopKSelector,
    TopKSelector,
    protected_mask,
    top_capacity,
)


def _random_valid(b, h, n, seed):
    gen = torch.Generator().manual_seed(seed)
    pads = torch.randint(0, n // 2, (b,), generator=gen)
    valid = torch.arange(n).view(1, 1, n) >= pads.view(b, 1, 1)
    return valid.expand(b, h, n).clone()


@pytest.mark.parametrize("keep,ratio", [(5, None), (None, 0.5), (None, 0.9), (40, None)])
def test_capacity_matches_its_definition(keep, ratio):
    budget = Budget(keep=keep, compression_ratio=ratio, layer_scale=[1.0, 0.5], head_scale=[[1.0, 2.0], [1.0, 1.0]])
    n_valid = torch.tensor([[20, 20], [7, 7]])
    for layer in (0, 1):
        cap = budget.capacity(n_valid, layer, 2)
        for b, h in itertools.product(range(2), range(2)):
            base = keep if keep is not None else int(n_valid[b, h]) * (1 - ratio)
            want = math.floor(base * [1.0, 0.5][layer] * budget.head_scale[layer][h] + 1e-9)
            assert int(cap[b, h]) == min(max(want, 1), int(n_valid[b, h]))


@pytest.mark.parametrize("ratio", [0.8, 0.9, 0.75, 0.3])
def test_keep_for_is_the_unscaled_capacity(ratio):
    # 1000 * (1 - 0.8) is 199.99999999999997 in floats: a plain floor gives 199, the budget 200
    budget = Budget(compression_ratio=ratio)
    ns = list(range(1, 60)) + [1000, 1005, 2048, 4095]
    caps = budget.capacity(torch.tensor([ns]), 0, len(ns))[0]
    for n, cap in zip(ns, caps.tolist()):
        assert budget.keep_for(n) == cap, (n, ratio)
    assert Budget(compression_ratio=0.8).keep_for(1000) == 200
    assert Budget(keep=7).keep_for(1000) == 7 and Budget().keep_for(13) == 13


def test_budget_rejects_bad_values_with_the_key_named():
    with pytest.raises(ValueError, match="either keep or compression_ratio"):
        Budget(keep=3, compression_ratio=0.5)
    with pytest.raises(ValueError, match="compression_ratio"):
        Budget(compression_ratio=1.0)
    with pytest.raises(ValueError, match="head_scale needs 3"):
        Budget(keep=4, head_scale=[1.0, 1.0]).capacity(torch.tensor([[9, 9, 9]]), 0, 3)


def test_protected_mask_brute_force():
    valid = _random_valid(3, 2, 12, seed=1)
    for sink, window, capv in itertools.product((0, 2, 4), (0, 3), (1, 3, 6, 12)):
        cap = torch.full((3, 2), capv)
        got = protected_mask(valid, sink, window, cap)
        for b, h in itertools.product(range(3), range(2)):
            idx = [j for j in range(12) if valid[b, h, j]]
            s = min(sink, capv)
            w = max(0, min(window, capv - s))
            want = set(idx[:s]) | (set(idx[-w:]) if w else set())
            assert {j for j in range(12) if got[b, h, j]} == want


def _moved(b, h, n, seed):
    """A random layout of entries whose places moved (in-place eviction): ``slots [b, h, n]`` (distinct, gapped)
    and ``perm`` with ``slots = ordered_slots.gather(-1, perm)``; also the validity, tied scores and
    capacities."""
    gen = torch.Generator().manual_seed(seed)
    ordered = torch.stack([torch.randperm(3 * n, generator=gen)[:n].sort().values for _ in range(b * h)]).view(b, h, n)
    perm = torch.stack([torch.randperm(n, generator=gen) for _ in range(b * h)]).view(b, h, n)
    valid = torch.rand(b, h, n, generator=gen) > 0.15
    scores = torch.randint(0, 4, (b, h, n), generator=gen).float()  # many ties
    return ordered, perm, valid, scores


@pytest.mark.parametrize("seed", range(6))
def test_protected_mask_by_slot_is_the_ordered_rule_on_moved_entries(seed):
    ordered, perm, valid_o, _ = _moved(2, 3, 17, seed)
    slots = ordered.gather(-1, perm)
    valid = valid_o.gather(-1, perm)
    for sink, window, capv in itertools.product((0, 2), (0, 3, torch.tensor([[1, 2, 4], [0, 5, 3]])), (1, 4, 9)):
        cap = torch.full((2, 3), capv)
        want = protected_mask(valid_o, sink, window, cap).gather(-1, perm)  # the rule on the stream order, moved
        assert torch.equal(protected_mask(valid, sink, window, cap, slots), want)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("drops", [1, 2, 4, 7])
def test_top_capacity_by_slot_keeps_what_the_ordered_rule_keeps_on_moved_entries(seed, drops):
    """The few-drops path (repeated minima) and the general path (a sort by slot first) against the stable
    position-ordered top-k on the same entries in stream order, with many tied scores."""
    ordered, perm, valid_o, scores_o = _moved(2, 3, 19, seed)
    cap = (valid_o.sum(-1) - drops).clamp_min(1)
    protected_o = protected_mask(valid_o, 1, 2, cap)
    want = top_capacity(scores_o, cap, protected_o, valid_o)
    slots = ordered.gather(-1, perm)
    got = top_capacity(scores_o.gather(-1, perm), cap, protected_o.gather(-1, perm), valid_o.gather(-1, perm), slots)
    assert torch.equal(got, want.gather(-1, perm))
    # and in stream order, slots change nothing
    assert torch.equal(top_capacity(scores_o, cap, protected_o, valid_o, ordered), want)


@pytest.mark.parametrize("selector", [TopKSelector(), SharedTopKSelector()])
def test_selectors_keep_protected_then_best_and_never_exceed(selector):
    gen = torch.Generator().manual_seed(0)
    valid = _random_valid(2, 3, 16, seed=2)
    scores = torch.randn(2, 3, 16, generator=gen)
    cap = torch.tensor([[5, 5, 5], [9, 9, 9]])
    protected = protected_mask(valid, 1, 2, cap)
    keep = selector.select(scores, cap, protected, valid)
    assert (keep <= valid).all() and (keep.sum(-1) <= cap).all()
    assert (keep | ~protected).all()  # every protected entry kept
    for b, h in itertools.product(range(2), range(3)):
        s = scores[b, h] if isinstance(selector, TopKSelector) else (scores[b] * valid[b]).sum(0) / valid[b].sum(0).clamp_min(1)
        free = [j for j in range(16) if valid[b, h, j] and not protected[b, h, j]]
        n_free = int(cap[b, h]) - int(protected[b, h].sum())
        want = set(sorted(free, key=lambda j: -float(s[j]))[:n_free]) | set(protected[b, h].nonzero().flatten().tolist())
        assert set(keep[b, h].nonzero().flatten().tolist()) == want
    if isinstance(selector, SharedTopKSelector):
        assert torch.equal(keep[:, 0], keep[:, 1]) and torch.equal(keep[:, 1], keep[:, 2])


def test_policy_decide_with_recent_scorer_is_streaming_llm():
    n = 20
    slots = torch.arange(n).view(1, 1, n).expand(1, 2, n)
    valid = torch.ones(1, 2, n, dtype=torch.bool)
    q = torch.randn(1, 4, 3, 8)
    k = v = torch.randn(1, 2, n, 8)
    obs = KVObservation(0, "prefill", q, k, v, slots, valid, 8 ** -0.5)
    keep = KVPolicy(scorer=RecentScorer(), budget=Budget(keep=7, sink=4)).decide(obs)
    assert keep[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 17, 18, 19]
    random_keep = KVPolicy(scorer=RandomScorer(0), budget=Budget(keep=7, sink=4)).decide(obs)
    assert int(random_keep[0, 0].sum()) == 7 and random_keep[0, 0, :4].all()


def test_observation_window_statistics_match_float64_brute_force():
    gen = torch.Generator().manual_seed(3)
    b, hq, hk, nq, n, d = 2, 4, 2, 5, 11, 8
    q = torch.randn(b, hq, nq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hk, n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hk, n, d, generator=gen, dtype=torch.float64)
    valid = torch.ones(b, hk, n, dtype=torch.bool)
    valid[1, :, :3] = False
    obs = KVObservation(0, "prefill", q, k, v, torch.arange(n).expand(b, hk, n), valid, d ** -0.5)
    probs = obs.window_probs(3)
    for bb, h, i in itertools.product(range(b), range(hq), range(3)):
        qi = q[bb, h, nq - 3 + i]
        pos = n - 3 + i  # bottom-right aligned query position
        logits = [float(qi @ k[bb, h // 2, j]) * d ** -0.5 if (j <= pos and valid[bb, h // 2, j]) else -math.inf
                  for j in range(n)]
        m = max(logits)
        z = sum(math.exp(x - m) for x in logits if x > -math.inf)
        want = [math.exp(x - m) / z if x > -math.inf else 0.0 for x in logits]
        assert torch.allclose(probs[bb, h, i].double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)


def test_observation_colstats_come_from_the_kernels_and_match_the_window_probabilities():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 6, 8, generator=gen)
    k = torch.randn(1, 2, 9, 8, generator=gen)
    v = torch.randn(1, 2, 9, 8, generator=gen)
    obs = KVObservation(0, "prefill", q, k, v, torch.arange(9).expand(1, 2, 9), torch.ones(1, 2, 9, dtype=torch.bool),
                        8 ** -0.5)
    stats = obs.colstats(4)
    probs = obs.window_probs(4)
    torch.testing.assert_close(stats.p_sum, probs.sum(-2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.p2_sum, (probs ** 2).sum(-2), atol=1e-5, rtol=1e-5)
    # masked entries are excluded from the statistics exactly as from the probabilities
    obs.valid[0, 0, 0] = False
    obs.valid[0, 1, 5] = False
    obs._cache.clear()
    stats = obs.colstats(4, moments="logit")
    probs = obs.window_probs(4)
    torch.testing.assert_close(stats.p_sum, probs.sum(-2), atol=1e-5, rtol=1e-5)
    assert float(stats.p_sum[0, 0, 0]) == 0.0 and float(stats.p_sum[0, 3, 5]) == 0.0
    assert obs.colstats(4, moments="attention") is stats  # a richer cached result serves
    with pytest.raises(ValueError, match="moments"):
        obs.colstats(4, moments="second_order")


# ------------------------------------------------------------------------------------------ one runner path
def test_a_single_policy_is_a_batch_of_one_and_only_batches_of_several_are_restricted():
    from lightning_modules.llm.kv_policy.protocol import Action, OffloadCompensator, PolicyBatch

    single = KVPolicy(scorer=RecentScorer(), budget=Budget(keep=4), action=Action.SPARSE_READ, name="sr")
    batch = PolicyBatch.of(single)
    assert batch.policies == [single] and batch.name == "sr" and PolicyBatch.of(batch) is batch
    comp = OffloadCompensator()
    assert PolicyBatch([KVPolicy(scorer=RecentScorer(), budget=Budget(keep=4), compensator=comp)]).compensator is comp
    with pytest.raises(ValueError, match="share the action evict or mask; got.*sparse_read"):
        PolicyBatch([single, single])
    with pytest.raises(ValueError, match="compensator"):
        PolicyBatch([KVPolicy(compensator=comp), KVPolicy(compensator=comp)])


@pytest.mark.parametrize("decode_every", [0, 1])
def test_one_policy_over_a_batch_equals_a_batch_of_per_row_copies(decode_every):
    """The broadcast (one policy, every row) and the per-row form (policy i serves row i) of the same
    deterministic policy give the same logits and the same caches: they are one code path."""
    pytest.importorskip("transformers")
    import copy

    from lightning_modules.llm.runtime.cached_lm import CachedLM
    from lightning_modules.llm.model.loading import load_causal_lm
    from lightning_modules.llm.kv_policy.protocol import PolicyBatch, Schedule
    from lightning_modules.llm.kv_policy.runner import install_policy

    model, _ = load_causal_lm("tiny-llama", with_tokenizer=False, seed=4)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (2, 15), generator=gen)
    steps = torch.randint(0, 256, (4, 2, 1), generator=gen)
    policy = KVPolicy(scorer=RecentScorer(), budget=Budget(keep=6, sink=1),
                      schedule=Schedule(prefill=True, decode_every=decode_every))

    def run(p):
        with install_policy(model, p) as session:
            lm = CachedLM(model)
            outs = [lm.feed(ids)] + [lm.feed(t) for t in steps]
            sizes = [layer.keys.shape for layer in lm.cache.layers]
            slots = [r.state.slots.clone() for r in session.runners.values()]
        return torch.stack(outs, 1), sizes, slots

    a = run(policy)
    b = run(PolicyBatch([copy.deepcopy(policy), copy.deepcopy(policy)]))
    torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=0)
    assert a[1] == b[1] and all(torch.equal(x, y) for x, y in zip(a[2], b[2]))
    assert a[1][0][2] == (6 if decode_every else 6 + len(steps))  # evicted to the budget (then grown)


def test_protected_mask_by_slot_thresholds_equals_the_ranked_rule():
    """One sink and window size for every row takes the order-statistics path; it must protect exactly the
    first ``sink`` and last ``window`` valid entries by slot (brute force), with invalid entries anywhere."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(40):
        rows, n = 5, int(torch.randint(1, 40, (1,), generator=gen))
        slots = torch.stack([torch.randperm(3 * n, generator=gen)[:n] for _ in range(rows)]).view(rows, 1, n)
        valid = torch.rand(rows, 1, n, generator=gen) < 0.8
        count = valid.sum(-1)
        sink, window = int(torch.randint(0, 5, (1,), generator=gen)), int(torch.randint(0, n + 3, (1,), generator=gen))
        capacity = torch.clamp(count, max=int(count.min()) if trial % 2 else n)  # uniform or not
        got = protected_mask(valid, sink, window, capacity, slots)
        for r in range(rows):
            live = sorted(int(s) for s, v in zip(slots[r, 0], valid[r, 0]) if v)
            cap = int(capacity[r, 0])
            s_eff = min(cap, sink)
            w_eff = min(max(cap - s_eff, 0), window)
            keep = set(live[:s_eff]) | (set(live[len(live) - w_eff:]) if w_eff else set())
            want = [bool(v) and int(s) in keep for s, v in zip(slots[r, 0], valid[r, 0])]
            assert got[r, 0].tolist() == want, (trial, r)
