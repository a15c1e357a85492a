"""Speculative decoding against independent references: plain greedy decoding (and a no-cache, one row at a
time forward), exact next-token distributions (chi-square tests of rejection sampling), brute-force top-k /
top-p filtering; per-row rollback, compaction, a KV policy under speculative decoding, and the composition of a
sparse prefill, a KV policy and a read method on one model."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

pytest.importorskip("transformers", reason="the LLM substrate needs transformers (pip install -e '.[llm]')")

from litctx_common.padding import left_pad  # noqa: E402
from lightning_modules.kv_eviction.config import SnapKVConfig  # noqa: E402
from lightning_modules.llm.model.attention import RUNNER_ATTR  # noqa: E402
from lightning_modules.llm.decoding.step import StepDecoder  # noqa: E402
from lightning_modules.llm.runtime.cached_lm import CachedLM  # noqa: E402
from lightning_modules.llm.decoding.generate import greedy_generate  # noqa: E402
from lightning_modules.llm.model.loading import load_causal_lm  # noqa: E402
from lightning_modules.llm.decoding.sampling import (  # noqa: E402
    SamplingConfig,
    filter_logits,
    make_generator,
    next_token_probs,
    pick_tokens,
)
from lightning_modules.llm.kv_policy.runner import SESSION_ATTR, install_policy  # noqa: E402
from lightning_modules.llm.runtime.stack import attention_modules, call_phase  # noqa: E402
from lightning_modules.llm.decoding.speculative import (  # noqa: E402
    SpeculativeDecoder,
    SpeculativeHook,
    accept_drafts,
    speculative_generate,
)
from lightning_modules.llm.sparse_read.read_method import DenseRead, QuestRead, install_read_method  # noqa: E402

ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-olmo2"]


# ---------------------------------------------------------------------------------------------- helpers
def _tiny(arch="tiny-llama", seed=0, layers=2, **extra):
    model, _ = load_causal_lm(arch, with_tokenizer=False, seed=seed, tiny=dict(num_hidden_layers=layers, **extra),
                              dtype="float64")
    return model


def _perturbed(target, scale=2e-3, seed=5):
    """A copy of ``target`` whose last decoder layer carries small Gaussian noise: it agrees with the target
    on most tokens, not all (ragged acceptance)."""
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.model.layers[-1].parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return draft


def _prompt(lengths=(12, 9, 7), vocab=256, seed=1):
    """Left-padded random prompts of the given real lengths: ``ids [B, n]``, ``mask [B, n]`` and the rows."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    ids, mask = left_pad(rows)
    return ids, mask, rows


@torch.no_grad()
def _reference_greedy(model, rows, n):
    """Greedy continuation of each row alone, without padding and without a cache (a full forward per
    token)."""
    out = []
    for row in rows:
        seq = list(row)
        for _ in range(n):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        out.append(seq[len(row):])
    return out


def _speculative(target, draft, ids, mask, n, gamma, sampling=None, compact_after=64, hooks=()):
    t, d = CachedLM(target, compact_after=compact_after), CachedLM(draft, compact_after=compact_after)
    logits = t.feed(ids, mask)
    d.feed(ids, mask)
    res = SpeculativeDecoder(t, d, gamma=gamma, sampling=sampling, hooks=hooks).run(logits, n)
    return res, t, d


class AcceptanceLog(SpeculativeHook):
    """Records, per verification, each active row's accepted count (None for rows already done)."""

    def __init__(self):
        self.steps = []

    def after_verify(self, decoder, state, accepted):
        self.steps.append([None if bool(state.done[b]) else int(a) for b, a in enumerate(accepted.tolist())])


def _assert_ragged(stats, log, gamma):
    assert len(set(stats["accepted_per_row"])) > 1, stats["accepted_per_row"]
    flat = [a for step in log.steps for a in step if a is not None]
    assert gamma in flat, f"no step accepted all {gamma} drafts: {log.steps}"
    assert any(a < gamma for a in flat), f"no step rejected a draft: {log.steps}"
    assert sum(flat) == sum(stats["accepted_per_row"])


def _chisquare(observed, expected_probs, min_expected=5.0):
    """p-value of a chi-square goodness-of-fit test; categories with an expected count below
    ``min_expected`` are pooled (an observation in a category of probability 0 gives p = 0)."""
    from scipy.stats import chisquare

    observed = torch.as_tensor(observed, dtype=torch.float64)
    probs = torch.as_tensor(expected_probs, dtype=torch.float64)
    total = float(observed.sum())
    expected = probs / probs.sum() * total
    if bool(((probs == 0) & (observed > 0)).any()):
        return 0.0
    support = probs > 0
    observed, expected = observed[support], expected[support]
    big = expected >= min_expected
    obs = observed[big].tolist()
    exp = expected[big].tolist()
    if bool((~big).any()):
        obs.append(float(observed[~big].sum()))
        exp.append(float(expected[~big].sum()))
    if len(obs) < 2:
        return 1.0
    return float(chisquare(obs, exp).pvalue)


# ---------------------------------------------------------------------------------------------- 1. greedy
@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculative_equals_plain_greedy_with_ragged_acceptance(arch, gamma):
    target = _tiny(arch, seed=0, layers=2)
    ids, mask, rows = _prompt()
    n = 24
    ref = _reference_greedy(target, rows, n)
    assert greedy_generate(target, ids, mask, n).tokens == ref
    lm = CachedLM(target)
    assert StepDecoder(lm).run(lm.feed(ids, mask), n).tokens == ref

    log = AcceptanceLog()
    res, t, d = _speculative(target, _perturbed(target), ids, mask, n, gamma, hooks=[log])
    assert res.tokens == ref
    _assert_ragged(res.stats, log, gamma)
    assert res.target_calls == len(log.steps) < n  # fewer target calls than tokens

    # an unrelated random draft: (almost) everything rejected, still the target's greedy sequence
    other = _tiny(arch, seed=7, layers=1)
    res2, _, _ = _speculative(target, other, ids, mask, n, gamma)
    assert res2.tokens == ref
    assert res2.stats["acceptance_rate"] < res.stats["acceptance_rate"]


def test_greedy_speculative_equals_greedy_on_smollm2_with_an_early_exit_draft(smollm2):
    model, tok = smollm2
    from lightning_modules.llm.decoding.drafts import early_exit_draft

    draft = early_exit_draft(model, 8)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids, mask = left_pad(rows)
    n = 16
    ref = greedy_generate(model, ids, mask, n).tokens
    log = AcceptanceLog()
    res, _, _ = _speculative(model, draft, ids, mask, n, 4, hooks=[log])
    assert res.tokens == ref
    assert 0 < res.stats["accepted"] < res.stats["proposed"]  # the 8-layer draft agrees only now and then
    assert res.target_calls == len(log.steps)


# ---------------------------------------------------------------------------------------------- 2. policy / compaction
def _snapkv():
    """A fresh SnapKV policy keeping 16 entries (window 4): small enough to evict from the test prompts."""
    return SnapKVConfig(keep=16, window=4).build()


def test_greedy_speculative_equals_greedy_under_a_snapkv_policy():
    target = _tiny("tiny-llama", seed=0, layers=2)
    ids, mask, _ = _prompt(lengths=(40, 33, 28), seed=3)
    n = 24

    with install_policy(target, _snapkv()):
        lm = CachedLM(target)
        ref = StepDecoder(lm).run(lm.feed(ids, mask), n).tokens
        ref_cache = lm.cache.get_seq_length()
    with install_policy(target, _snapkv()):
        ref2 = greedy_generate(target, ids, mask, n).tokens
    full = greedy_generate(target, ids, mask, n).tokens
    assert ref2 == ref
    assert full != ref  # the policy changed the output: the comparison is not vacuous
    assert ref_cache < ids.shape[1]  # evicted: the cache holds less than the prompt

    log = AcceptanceLog()
    draft = _perturbed(target)  # copied before the policy is installed: the draft runs without one
    with install_policy(target, _snapkv()):
        res, t, _ = _speculative(target, draft, ids, mask, n, 4, hooks=[log])
        held = t.cache.get_seq_length()
    assert res.tokens == ref
    _assert_ragged(res.stats, log, 4)
    assert held < ids.shape[1] + n


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_speculative_equals_greedy_with_compaction(gamma):
    target = _tiny("tiny-qwen2", seed=0, layers=2)
    ids, mask, rows = _prompt()
    n = 30
    ref = _reference_greedy(target, rows, n)
    compactions = []

    def counting(lm, name):
        inner = lm.compact

        def compact():
            before_live = lm.mask.bool().sum(-1)
            before_pos = [lm.positions[b][lm.mask[b].bool()].tolist() for b in range(lm.mask.shape[0])]
            inner()
            live = lm.mask.bool()
            # holes became left padding: every row is 0..0 1..1, the live entries kept in order
            assert bool((live.long().diff(dim=-1) >= 0).all()), lm.mask
            assert torch.equal(live.sum(-1), before_live)
            assert [lm.positions[b][live[b]].tolist() for b in range(live.shape[0])] == before_pos
            compactions.append(name)

        lm.compact = compact

    t, d = CachedLM(target, compact_after=2), CachedLM(_perturbed(target), compact_after=2)
    counting(t, "target")
    counting(d, "draft")
    logits = t.feed(ids, mask)
    d.feed(ids, mask)
    log = AcceptanceLog()
    res = SpeculativeDecoder(t, d, gamma=gamma, hooks=[log]).run(logits, n)
    assert res.tokens == ref
    _assert_ragged(res.stats, log, gamma)
    assert "target" in compactions
    if gamma > 1:
        assert "draft" in compactions


# ---------------------------------------------------------------------------------------------- 3. rollback
@torch.no_grad()
def _full_logits(model, seq, k):
    return model(input_ids=torch.tensor([seq])).logits[0, -k:].double()


@pytest.mark.parametrize("compact_after", [64, 0])
def test_rollback_equals_a_cache_that_never_saw_the_rejected_tokens(compact_after):
    model = _tiny("tiny-llama", seed=0, layers=2)
    ids, mask, rows = _prompt(seed=4)
    gen = torch.Generator().manual_seed(9)
    x1, x2, y = (torch.randint(0, 256, (3, w), generator=gen) for w in (4, 3, 2))
    n1, n2 = torch.tensor([0, 2, 4]), torch.tensor([1, 3, 0])
    lm = CachedLM(model, compact_after=compact_after)
    lm.feed(ids, mask)
    lm.feed(x1)
    lm.rollback(n1)
    lm.feed(x2)
    lm.rollback(n2)
    got = lm.feed_logits(y, None, 2).double()
    for b, row in enumerate(rows):
        kept = row + x1[b, :4 - n1[b]].tolist() + x2[b, :3 - n2[b]].tolist() + y[b].tolist()
        torch.testing.assert_close(got[b], _full_logits(model, kept, 2), atol=1e-6, rtol=0)  # float32 logits
    # the same rows fed without the rejected tokens, as one left-padded batch
    ref = CachedLM(model)
    ref.feed(ids, mask)
    ref.feed(*left_pad([x1[b, :4 - n1[b]].tolist() for b in range(3)]))
    ref.feed(*left_pad([x2[b, :3 - n2[b]].tolist() for b in range(3)]))
    torch.testing.assert_close(got, ref.feed_logits(y, None, 2).double(), atol=1e-9, rtol=0)
    assert torch.equal(lm.next_position, ref.next_position)


def test_rollback_under_a_policy_equals_a_cache_that_never_saw_the_rejected_tokens():
    model = _tiny("tiny-llama", seed=0, layers=2)
    ids, mask, _ = _prompt(lengths=(30, 24, 20), seed=4)
    gen = torch.Generator().manual_seed(9)
    x1, x2, y = (torch.randint(0, 256, (3, w), generator=gen) for w in (4, 3, 2))
    n1, n2 = torch.tensor([0, 2, 4]), torch.tensor([1, 3, 0])
    with install_policy(model, SnapKVConfig(keep=12, window=4).build()):
        lm = CachedLM(model)
        lm.feed(ids, mask)
        assert lm.cache.get_seq_length() < ids.shape[1]
        lm.feed(x1)
        lm.rollback(n1)
        lm.feed(x2)
        lm.rollback(n2)
        got = lm.feed_logits(y, None, 2).double()
    with install_policy(model, SnapKVConfig(keep=12, window=4).build()):
        ref = CachedLM(model)
        ref.feed(ids, mask)
        ref.feed(*left_pad([x1[b, :4 - n1[b]].tolist() for b in range(3)]))
        ref.feed(*left_pad([x2[b, :3 - n2[b]].tolist() for b in range(3)]))
        want = ref.feed_logits(y, None, 2).double()
    with install_policy(model, SnapKVConfig(keep=12, window=4).build()):
        plain = CachedLM(model)  # no rollback at all: what the n = 0 rows must see
        plain.feed(ids, mask)
        plain.feed(x1)
        plain.feed(x2[:, :2])
        untouched = plain.feed_logits(y, None, 2).double()
    torch.testing.assert_close(got, want, atol=1e-9, rtol=0)
    torch.testing.assert_close(got[0], untouched[0], atol=1e-9, rtol=0)  # row 0 rolled back x2[0, 2] only
    assert not torch.allclose(got[1], untouched[1], atol=1e-6)


def test_rollback_rejects_bad_counts_and_leaves_the_cache_unchanged():
    model = _tiny("tiny-llama", seed=0, layers=1)
    ids, mask, _ = _prompt(lengths=(5, 3, 4))
    lm = CachedLM(model)
    lm.feed(ids, mask)
    before = (lm.mask.clone(), lm.positions.clone(), lm.next_position.clone(), lm.cache.get_seq_length())
    with pytest.raises(ValueError, match=r"rollback counts \[-1, 0, 0\]"):
        lm.rollback(torch.tensor([-1, 0, 0]))
    with pytest.raises(ValueError, match=r"rollback counts \[0, 4, 0\].*\[5, 3, 4\]"):
        lm.rollback(torch.tensor([0, 4, 0]))
    with pytest.raises(ValueError, match=r"one count per row \(3\), got 2"):
        lm.rollback(torch.tensor([1, 1]))
    after = (lm.mask, lm.positions, lm.next_position, lm.cache.get_seq_length())
    for a, b in zip(before, after):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    with pytest.raises(ValueError, match="empty cache"):
        CachedLM(model).rollback(torch.tensor([1]))


# ---------------------------------------------------------------------------------------------- 4. distributions
V6 = 6


def _tables(seed=0):
    """Synthetic target logits ``L0 [V]``, ``L1 [V, V]`` (given the first token), ``L2 [V, V, V]`` (given the
    first two) and a draft that differs from them: ``q0 [V]``, ``q1 [V, V]``."""
    gen = torch.Generator().manual_seed(seed)
    L0 = torch.randn(V6, generator=gen, dtype=torch.float64) * 1.5
    L1 = torch.randn(V6, V6, generator=gen, dtype=torch.float64) * 1.5
    L2 = torch.randn(V6, V6, V6, generator=gen, dtype=torch.float64) * 1.5
    q0 = torch.softmax(torch.randn(V6, generator=gen, dtype=torch.float64) * 1.5, -1)
    q1 = torch.softmax(torch.randn(V6, V6, generator=gen, dtype=torch.float64) * 1.5, -1)
    return L0, L1, L2, q0.float(), q1.float()


def _two_tokens(sampling, lie_about_q=False, b=20000, seed=0):
    """Two tokens per row from ``accept_drafts`` (gamma = 2; rows that rejected the first draft run a second
    step with gamma = 1), with drafts drawn from the synthetic draft. ``lie_about_q`` passes the target's own
    distribution as the draft's: every draft is accepted (a biased sampler)."""
    L0, L1, L2, q0, q1 = _tables()
    gen = make_generator(seed, torch.device("cpu"))
    d1 = torch.multinomial(q0.expand(b, -1), 1, generator=gen).squeeze(-1)
    d2 = torch.multinomial(q1[d1], 1, generator=gen).squeeze(-1)
    drafts = torch.stack([d1, d2], 1)
    logits = torch.stack([L0.expand(b, -1), L1[d1], L2[d1, d2]], 1)
    probs = torch.stack([q0.expand(b, -1), q1[d1]], 1)
    if lie_about_q:
        probs = next_token_probs(logits[:, :2], sampling)
    acc, nxt = accept_drafts(logits, drafts, probs, sampling, gen)
    assert acc.min() >= 0 and acc.max() <= 2
    tok1 = torch.where(acc >= 1, d1, nxt)
    tok2 = torch.where(acc >= 2, d2, nxt)
    redo = acc == 0
    if bool(redo.any()):
        first = tok1[redo]
        e = torch.multinomial(q1[first], 1, generator=gen).squeeze(-1)
        logits2 = torch.stack([L1[first], L2[first, e]], 1)
        probs2 = q1[first].unsqueeze(1)
        if lie_about_q:
            probs2 = next_token_probs(logits2[:, :1], sampling)
        acc2, nxt2 = accept_drafts(logits2, e.unsqueeze(1), probs2, sampling, gen)
        tok2[redo] = torch.where(acc2 >= 1, e, nxt2)
    return tok1, tok2, acc, (L0, L1)


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=4),
                                      SamplingConfig(temperature=1.3, top_p=0.8)],
                         ids=["t1", "t0.7-topk4", "t1.3-topp0.8"])
def test_rejection_sampling_preserves_the_target_distribution(sampling):
    tok1, tok2, acc, (L0, L1) = _two_tokens(sampling)
    assert 0 < int((acc == 0).sum()) and 0 < int((acc == 2).sum())  # both branches ran
    p0 = next_token_probs(L0, sampling)
    assert _chisquare(torch.bincount(tok1, minlength=V6), p0) > 1e-3
    x = int(torch.bincount(tok1, minlength=V6).argmax())
    p1 = next_token_probs(L1[x], sampling)
    assert _chisquare(torch.bincount(tok2[tok1 == x], minlength=V6), p1) > 1e-3
    # tokens the filtered target excludes never appear
    assert bool((p0[tok1] > 0).all())


def test_chi_square_catches_a_biased_acceptance():
    sampling = SamplingConfig(temperature=1.0)
    tok1, _, acc, (L0, _) = _two_tokens(sampling, lie_about_q=True)
    assert bool((acc == 2).all())  # always accepted: the tokens follow the draft
    assert _chisquare(torch.bincount(tok1, minlength=V6), next_token_probs(L0, sampling)) < 1e-6


def test_greedy_acceptance_is_the_longest_prefix_matching_the_argmax():
    gen = torch.Generator().manual_seed(3)
    b, g, v = 64, 4, 5
    logits = torch.randn(b, g + 1, v, generator=gen)
    best = logits.argmax(-1)
    drafts = torch.where(torch.rand(b, g, generator=gen) < 0.7, best[:, :g], torch.randint(0, v, (b, g), generator=gen))
    acc, nxt = accept_drafts(logits, drafts, None, SamplingConfig())
    for r in range(b):
        k = 0
        while k < g and int(drafts[r, k]) == int(best[r, k]):
            k += 1
        assert int(acc[r]) == k and int(nxt[r]) == int(best[r, k])
    assert len(set(acc.tolist())) > 2
    with pytest.raises(ValueError, match=r"gamma \+ 1"):
        accept_drafts(logits[:, :g], drafts, None, SamplingConfig())
    with pytest.raises(ValueError, match="draft_probs"):
        accept_drafts(logits, drafts, None, SamplingConfig(temperature=1.0))


def _vocab8(seed, layers, head_scale):
    model = _tiny("tiny-llama", seed=seed, layers=layers, vocab_size=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)  # peaked, far from uniform next-token distributions
    return model


@torch.no_grad()
def test_speculative_sampling_end_to_end_matches_the_target_distribution():
    target, draft = _vocab8(0, 2, 15.0), _vocab8(1, 1, 10.0)
    assert target.config.vocab_size == 8 and target.lm_head.weight.shape[0] == 8
    b, prompt = 3000, 3
    ids = torch.full((b, 1), prompt, dtype=torch.long)
    sampling = SamplingConfig(temperature=1.0, seed=11)
    res, _, _ = _speculative(target, draft, ids, None, 3, 2, sampling=sampling)
    toks = torch.tensor(res.tokens)
    assert toks.shape == (b, 3)
    assert 0 < res.stats["accepted"] < res.stats["proposed"]

    def p(seq):
        return torch.softmax(target(input_ids=torch.tensor([seq])).logits[0, -1].double(), -1)

    assert _chisquare(torch.bincount(toks[:, 0], minlength=8), p([prompt])) > 1e-3
    a = int(torch.bincount(toks[:, 0], minlength=8).argmax())
    rows = toks[:, 0] == a
    assert _chisquare(torch.bincount(toks[rows, 1], minlength=8), p([prompt, a])) > 1e-3
    pairs = toks[:, 0] * 8 + toks[:, 1]
    ab = int(torch.bincount(pairs, minlength=64).argmax())
    rows = pairs == ab
    assert int(rows.sum()) > 100
    assert _chisquare(torch.bincount(toks[rows, 2], minlength=8), p([prompt, ab // 8, ab % 8])) > 1e-3
    # seeded: the same run repeats exactly
    again, _, _ = _speculative(target, draft, ids, None, 3, 2, sampling=sampling)
    assert again.tokens == res.tokens


@torch.no_grad()
def test_sampling_with_the_target_as_its_own_draft_accepts_everything():
    target = _vocab8(0, 2, 15.0)
    ids = torch.full((64, 1), 3, dtype=torch.long)
    res, _, _ = _speculative(target, copy.deepcopy(target), ids, None, 9, 4,
                             sampling=SamplingConfig(temperature=1.0, seed=2))
    assert res.stats["acceptance_rate"] == 1.0  # q == p: min(1, p/q) = 1


# ---------------------------------------------------------------------------------------------- 5. sampling
@pytest.mark.parametrize("field,value", [("temperature", -0.5), ("temperature", True), ("top_k", -1), ("top_k", 2.5),
                                         ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1)])
def test_sampling_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"sampling\.{field}="):
        SamplingConfig(**{field: value})


def _brute_keep(row, top_k, top_p):
    """Kept token ids of one row of logits: the ``top_k`` highest, then the smallest prefix (by probability
    renormalised over the top-k) whose mass reaches ``top_p``."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    if 0 < top_k < len(row):
        order = order[:top_k]
    z = torch.tensor([row[i] for i in order], dtype=torch.float64)
    probs = torch.softmax(z, -1).tolist()
    kept, mass = [], 0.0
    for i, pr in zip(order, probs):
        kept.append(i)
        mass += pr
        if top_p < 1.0 and mass >= top_p:
            break
    return set(kept)


@pytest.mark.parametrize("top_k", [0, 1, 3, 10, 12])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05])
def test_filter_logits_and_next_token_probs_against_brute_force(top_k, top_p):
    gen = torch.Generator().manual_seed(top_k * 10 + int(top_p * 100))
    logits = torch.randn(16, 10, generator=gen, dtype=torch.float64) * 2
    out = filter_logits(logits, top_k, top_p)
    temp = 0.6
    probs = next_token_probs(logits, SamplingConfig(temperature=temp, top_k=top_k, top_p=top_p))
    for r in range(logits.shape[0]):
        keep = _brute_keep(logits[r].tolist(), top_k, top_p)
        finite = set(torch.isfinite(out[r]).nonzero().flatten().tolist())
        assert finite == keep
        assert torch.equal(out[r, sorted(keep)], logits[r, sorted(keep)].float())
        keep_t = _brute_keep((logits[r] / temp).tolist(), top_k, top_p)
        want = torch.zeros(10, dtype=torch.float64)
        idx = sorted(keep_t)
        want[idx] = torch.softmax(logits[r, idx] / temp, -1)
        torch.testing.assert_close(probs[r].double(), want, atol=1e-6, rtol=0)


def test_greedy_is_argmax_and_sampling_repeats_with_its_seed():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 12, generator=gen)
    assert torch.equal(pick_tokens(logits, SamplingConfig()), logits.argmax(-1))
    one_hot = next_token_probs(logits, SamplingConfig())
    assert torch.equal(one_hot.argmax(-1), logits.argmax(-1)) and torch.equal(one_hot.sum(-1), torch.ones(50))
    cfg = SamplingConfig(temperature=1.0, top_k=5)
    a = pick_tokens(logits, cfg, make_generator(3, torch.device("cpu")))
    b = pick_tokens(logits, cfg, make_generator(3, torch.device("cpu")))
    c = pick_tokens(logits, cfg, make_generator(4, torch.device("cpu")))
    assert torch.equal(a, b) and not torch.equal(a, c)
    top5 = logits.topk(5, -1).indices
    assert bool((top5 == a.unsqueeze(-1)).any(-1).all())  # never outside the top-k


def test_pick_tokens_draws_from_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0]]).expand(20000, -1)
    cfg = SamplingConfig(temperature=0.8, top_k=5, top_p=0.9)
    toks = pick_tokens(logits, cfg, make_generator(1, torch.device("cpu")))
    keep = _brute_keep((logits[0] / 0.8).tolist(), 5, 0.9)
    want = torch.zeros(7, dtype=torch.float64)
    want[sorted(keep)] = torch.softmax(logits[0, sorted(keep)].double() / 0.8, -1)
    assert set(toks.unique().tolist()) <= keep
    assert _chisquare(torch.bincount(toks, minlength=7), want) > 1e-3


@torch.no_grad()
def test_sampled_step_decoding_repeats_with_its_seed():
    model = _tiny("tiny-llama", seed=0, layers=1)
    ids, mask, _ = _prompt()

    def run(seed):
        lm = CachedLM(model)
        return StepDecoder(lm, SamplingConfig(temperature=1.0, seed=seed)).run(lm.feed(ids, mask), 12).tokens

    assert run(4) == run(4)
    assert run(4) != run(5)


# ---------------------------------------------------------------------------------------------- 6. bad input
@pytest.mark.parametrize("gamma", [0, -2, True, 2.0])
def test_gamma_must_be_a_positive_integer(gamma):
    model = _tiny("tiny-llama", seed=0, layers=1)
    ids, mask, _ = _prompt()
    t, d = CachedLM(model), CachedLM(model)
    with pytest.raises(ValueError, match="gamma"):
        SpeculativeDecoder(t, d, gamma=gamma)
    with pytest.raises(ValueError, match="gamma"):
        speculative_generate(model, model, ids, mask, 4, gamma=gamma)
    assert not any(hasattr(m, RUNNER_ATTR) for m in attention_modules(model))


def test_target_and_draft_must_hold_the_same_rows():
    model = _tiny("tiny-llama", seed=0, layers=1)
    t, d = CachedLM(model), CachedLM(model)
    t.feed(torch.zeros(3, 4, dtype=torch.long))
    d.feed(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="2 rows, the target 3"):
        SpeculativeDecoder(t, d, gamma=2)


def test_a_draft_with_another_vocabulary_is_refused():
    from lightning_modules.llm.decoding import drafts

    target = _tiny("tiny-llama", seed=0, layers=1)
    other = _tiny("tiny-llama", seed=1, layers=1, vocab_size=300)
    with pytest.raises(ValueError, match=r"(?s)300.*256"):
        drafts.check_draft_compatible(target, other)
    drafts.check_draft_compatible(target, _tiny("tiny-qwen2", seed=1, layers=1))  # same vocabulary: fine


def test_speculative_generate_refuses_a_draft_with_another_vocabulary():
    target = _tiny("tiny-llama", seed=0, layers=1)
    other = _tiny("tiny-llama", seed=1, layers=1, vocab_size=300)
    with torch.no_grad():
        other.lm_head.weight[256:] += 10.0  # the draft prefers ids the target does not have
    ids, mask, _ = _prompt()
    with pytest.raises(ValueError, match=r"(?s)300.*256"):
        speculative_generate(target, other, ids, mask, 6, gamma=2)
    assert not any(hasattr(m, RUNNER_ATTR) for m in attention_modules(target))  # refused before installing


# ---------------------------------------------------------------------------------------------- 7. composition
def _sdpa_model():
    model, _ = load_causal_lm("tiny-llama", with_tokenizer=False, seed=0, tiny=dict(num_hidden_layers=2),
                              dtype="float64", attn_implementation="sdpa")
    return model


def _clean(model, impl):
    assert model.config._attn_implementation == impl
    assert not any(hasattr(m, RUNNER_ATTR) for m in attention_modules(model))
    assert not any(m._forward_pre_hooks for m in attention_modules(model))
    assert not hasattr(model, SESSION_ATTR)
    assert not [a for a in vars(model) if a.startswith("_litctx")]


def _installers(model):
    from lightning_modules.sparse_prefill.config import PrismConfig
    from lightning_modules.sparse_prefill.session import install_sparse_prefill

    return {
        "prefill": lambda: install_sparse_prefill(model, PrismConfig(block=16, top_p=0.3).build(), min_length=16),
        "policy": lambda: install_policy(model, SnapKVConfig(keep=24, window=4).build(), keep_log=True),
        "read": lambda: install_read_method(model, QuestRead(budget=12, page_size=4, sink=2, window=4)),
    }


@torch.no_grad()
def test_sparse_prefill_policy_and_read_method_act_on_the_same_calls():
    model = _sdpa_model()
    draft = _perturbed(model)
    impl = model.config._attn_implementation
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))  # unpadded: prefill goes sparse
    n = 12
    with torch.no_grad():
        before = model(input_ids=ids).logits
    inst = _installers(model)
    with inst["prefill"]() as sp, inst["policy"]() as pol, inst["read"]() as rd:
        log = AcceptanceLog()
        res, t, _ = _speculative(model, draft, ids, None, n, 3, hooks=[log])
        held = t.cache.get_seq_length()
    assert all(len(r) == n for r in res.tokens)
    # the sparse prefill computed the prefill of every layer
    assert sorted(r["layer"] for r in sp.records) == [0, 1] and all(r["n"] == 64 for r in sp.records)
    assert all(r["density"] < 1.0 for r in sp.records)
    # the policy evicted at that prefill
    assert any(d["phase"] == "prefill" and d["kept"] < d["valid"] for d in pol.decisions)
    assert held < 64
    # the read method chose the verification reads, under the policy's valid entries
    summ = rd.summary("verify")
    assert summ["calls"] == res.target_calls == len(log.steps)
    assert summ["kv_bytes_read"] < summ["dense_bytes"]
    assert {r["phase"] for r in rd.records} == {"verify"}
    assert all(r["entries_read"] <= 2 * 2 * 12 for r in rd.records)  # B x Hk x budget
    _clean(model, impl)
    torch.testing.assert_close(model(input_ids=ids).logits, before, atol=0, rtol=0)


@pytest.mark.parametrize("order", list(itertools.permutations(["prefill", "policy", "read"])),
                         ids=lambda o: "-".join(o))
@torch.no_grad()
def test_removing_runners_in_any_order_restores_the_model(order):
    model = _sdpa_model()
    impl = model.config._attn_implementation
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    before = model(input_ids=ids).logits
    inst = _installers(model)
    managers = {name: inst[name]() for name in ("prefill", "policy", "read")}
    for cm in managers.values():
        cm.__enter__()
    assert model.config._attn_implementation == "litctx"
    lm = CachedLM(model)
    lm.feed(ids)
    with call_phase(model, "verify"):
        lm.feed_logits(torch.tensor([[1, 2, 3]]), None, 3)
    for i, name in enumerate(order):
        managers[name].__exit__(None, None, None)
        if i < 2:  # what is left still runs a prefill and a decode step
            still = CachedLM(model)
            still.feed(ids)
            still.feed(torch.tensor([[4]]))
            assert model.config._attn_implementation == "litctx"
    _clean(model, impl)
    torch.testing.assert_close(model(input_ids=ids).logits, before, atol=0, rtol=0)


@torch.no_grad()
def test_two_runners_of_one_role_are_refused_naming_the_role():
    model = _sdpa_model()
    impl = model.config._attn_implementation
    inst = _installers(model)
    with install_read_method(model, DenseRead()):
        with pytest.raises(RuntimeError, match="a read runner"):
            with install_read_method(model, QuestRead(budget=12, page_size=4, sink=2, window=4)):
                pass
        with inst["policy"]():
            with pytest.raises(RuntimeError, match="policy"):
                with inst["policy"]():
                    pass
            with inst["prefill"]():
                with pytest.raises(RuntimeError, match="a prefill runner"):
                    with inst["prefill"]():
                        pass
                # the refused installs left the three installed runners working
                lm = CachedLM(model)
                lm.feed(torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0)))
                lm.feed(torch.tensor([[5]]))
    _clean(model, impl)


def test_prompt_lookup_draft_is_exact_and_proposes_what_followed_the_last_match():
    """A model-free draft: the tokens after the most recent earlier occurrence of the row's last n-gram."""
    from lightning_modules.llm.decoding.speculative import PROMPT_LOOKUP, PromptLookupDraft

    hist = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7])
    lookup = PromptLookupDraft([hist.tolist()], vocab_size=16, ngram_max=3, ngram_min=1)
    toks, src = lookup._match(hist, 3)
    assert toks == [1, 2, 5] and src == (5, 11)  # the later "5 6 7" (at 5) wins over the first (at 0)
    toks, src = lookup._match(torch.tensor([3, 4, 11]), 2)
    assert src is None and toks == []  # no match: nothing proposed
    toks, src = lookup._match(torch.tensor([1, 2, 3, 1, 2]), 4)
    assert toks == [3, 1, 2] and src == (0, 5)  # a candidate shorter than gamma (the history ends)
    target = _tiny("tiny-llama", seed=0, layers=2)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(4)).repeat(1, 4)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    want = greedy_generate(target, ids, mask, 24).tokens
    got = speculative_generate(target, PROMPT_LOOKUP, ids, mask, 24, gamma=4)
    assert got.tokens == want
    assert got.stats["accepted"] > 0


# ----------------------------------------------------------------------------------- held prompts (prefill once)
def test_a_held_prompt_decodes_like_its_own_prefill_and_can_be_reused():
    """One prefill, many decodes: greedy, dense speculative (model draft and prompt lookup) from a held prompt
    give the tokens of decodes that prefill on their own, in any order and repeatedly (the held tensors are
    never modified by a decode)."""
    from lightning_modules.llm.decoding.generate import hold_prompt
    from lightning_modules.llm.decoding.speculative import PROMPT_LOOKUP

    target = _tiny("tiny-llama", seed=0, layers=2)
    draft = _perturbed(target)
    ids, mask, _ = _prompt(lengths=(14, 9, 11), seed=7)
    n = 12
    want = greedy_generate(target, ids, mask, n).tokens
    spec = speculative_generate(target, draft, ids, mask, n, gamma=3)
    assert spec.tokens == want and 0 < spec.stats["accepted"] < spec.stats["proposed"]
    held, draft_held = hold_prompt(target, ids, mask), hold_prompt(draft, ids, mask)
    before = [t.clone() for t in held.recorded.snapshot["layers"][0]]
    for _ in range(2):
        got = speculative_generate(target, draft, ids, mask, n, gamma=3, held=held, draft_held=draft_held)
        assert got.tokens == want
        assert got.stats["accepted_per_row"] == spec.stats["accepted_per_row"]  # the draft resumed too
        assert greedy_generate(target, ids, mask, n, held=held).tokens == want
        assert speculative_generate(target, PROMPT_LOOKUP, ids, mask, n, gamma=3, held=held).tokens == want
    assert all(torch.equal(a, b) for a, b in zip(before, held.recorded.snapshot["layers"][0]))
    assert got.prefill_seconds >= held.seconds + draft_held.seconds


def test_a_held_prompt_under_a_policy_is_compressed_as_its_prefill_would_have_been():
    """Resumed under an installed SnapKV policy, a held prompt equals prefilling all but the last column under
    the policy and then feeding that column (the documented deviation: the window ends one token earlier)."""
    from lightning_modules.llm.decoding.generate import hold_prompt

    target = _tiny("tiny-llama", seed=0, layers=2)
    draft = _perturbed(target)
    ids, mask, _ = _prompt(lengths=(40, 33, 28), seed=3)
    n = 16

    with install_policy(target, _snapkv()):
        lm = CachedLM(target)
        lm.feed(ids[:, :-1], mask[:, :-1])
        ref = StepDecoder(lm).run(lm.feed(ids[:, -1:], mask[:, -1:]), n).tokens
        ref_len = lm.cache.get_seq_length()
    assert ref != greedy_generate(target, ids, mask, n).tokens  # the policy matters here
    held, draft_held = hold_prompt(target, ids, mask), hold_prompt(draft, ids, mask)
    with install_policy(target, _snapkv()):
        plain = greedy_generate(target, ids, mask, n, held=held)
    with install_policy(target, _snapkv()):
        spec = speculative_generate(target, draft, ids, mask, n, gamma=4, held=held, draft_held=draft_held)
    assert plain.tokens == ref and spec.tokens == ref
    full = greedy_generate(target, ids, mask, n)
    assert ref_len < ids.shape[1] and plain.cache_bytes < full.cache_bytes  # evicted
    # and without the policy the same held prompt is the full cache again
    again = greedy_generate(target, ids, mask, n, held=held)
    assert again.tokens == full.tokens and again.cache_bytes == full.cache_bytes


def test_held_prompt_errors_name_the_problem():
    from lightning_modules.llm.decoding.generate import hold_prompt

    target = _tiny("tiny-llama", seed=0, layers=2)
    other = _tiny("tiny-llama", seed=1, layers=2)
    ids, mask, _ = _prompt(lengths=(8, 6), seed=2)
    right = torch.flip(mask, [1])  # right padding: the last column of row 1 is padding
    with pytest.raises(ValueError, match=r"left padding.*rows \[1\]"):
        hold_prompt(target, ids, right)
    with pytest.raises(ValueError, match="n >= 2"):
        hold_prompt(target, ids[:, :1])
    held = hold_prompt(target, ids, mask)
    with pytest.raises(ValueError, match="another model"):
        greedy_generate(other, ids, mask, 4, held=held)
    with pytest.raises(ValueError, match="not the held prompt"):
        greedy_generate(target, ids[:, 1:], mask[:, 1:], 4, held=held)
    with pytest.raises(ValueError, match="includes its question"):
        greedy_generate(target, ids, mask, 4, question_ids=ids, held=held)
    with pytest.raises(ValueError, match="draft_held"):
        speculative_generate(target, _perturbed(target), ids, mask, 4, held=held)


def test_prompt_lookup_without_a_candidate_takes_plain_steps():
    """No n-gram of ngram_min tokens recurs: nothing is proposed, each verification is a one-token step, and
    the tokens are still plain greedy decoding (greedy and seeded sampling both accept zero-width steps)."""
    from lightning_modules.llm.decoding.drafts import PromptLookupSpec

    target = _tiny("tiny-llama", seed=0, layers=2)
    ids = torch.randperm(200, generator=torch.Generator().manual_seed(3))[:30].reshape(1, 30)  # no repeats
    want = greedy_generate(target, ids, None, 6).tokens
    log = AcceptanceLog()
    got = speculative_generate(target, PromptLookupSpec(ngram_max=8, ngram_min=8), ids, None, 6, gamma=4,
                               hooks=[log])
    assert got.tokens == want
    assert got.stats["proposed"] == 0 and got.stats["target_calls"] == 5  # the first token comes from the prefill
    sampled = speculative_generate(target, PromptLookupSpec(ngram_max=8, ngram_min=8), ids, None, 6, gamma=4,
                                   sampling=SamplingConfig(temperature=1.0, seed=3))
    assert len(sampled.tokens[0]) == 6 and sampled.stats["proposed"] == 0
