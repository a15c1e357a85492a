"""LoSA and its baselines on a block-diffusion LM: the split-and-merge attention against full attention, per-query
Quest and union attention against brute force, the union density against a brute-force count, LoSA = dense at
k_a = B and a full budget, cached prefix results equal recomputed ones when nothing changed, the fixed pattern's
reuse, the configs (method pattern) and the callbacks on a trained-module evaluation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import litctx_kernels
from litctx_kernels.testing import assert_close

pytest.importorskip("transformers")

from lightning_modules.bdlm.block_attention import BlockDiffusionSetting, apply_block_diffusion  # noqa: E402
from lightning_modules.bdlm.block_sampler import BlockSamplerConfig, block_generate  # noqa: E402
from lightning_modules.losa.config import (BLOCK_SPARSE_METHODS, BlockDenseConfig, BlockFixedConfig,  # noqa: E402
                                           BlockQuestConfig, LoSAConfig)
from lightning_modules.losa.config import prefix_grid  # noqa: E402
from lightning_modules.losa.method import LayerState, install_block_sparse  # noqa: E402
from lightning_modules.losa.sparse import page_density, quest_per_query, union_attention  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_seed", "two_torch_threads")


def _qkv(b=2, hq=4, hk=2, n=5, p=40, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hk, p, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hk, p, d, generator=g, dtype=torch.float64)
    return q, k, v


def _masked_reference(q, k, v, read, scale):
    """Softmax of each query over its own read entries, materialised (float64)."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    m = read.repeat_interleave(g, 1)
    s = s.masked_fill(~m, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ vv, torch.logsumexp(s, -1)


def test_prefix_and_block_parts_merged_by_lse_equal_full_attention():
    q, k, v = _qkv(n=8, p=48)
    kb, vb = _qkv(n=8, p=8, seed=1)[1:]
    scale = 8 ** -0.5
    o_p, lse_p = litctx_kernels.attention(q, k, v, scale=scale, causal=False)
    o_b, lse_b = litctx_kernels.attention(q, kb, vb, scale=scale, causal=False)
    o, lse = litctx_kernels.merge_lse(o_p, lse_p, o_b, lse_b)
    full, full_lse = litctx_kernels.attention(q, torch.cat([k, kb], 2), torch.cat([v, vb], 2), scale=scale, causal=False)
    assert_close(o, full, ratio=1e-12)
    assert_close(lse, full_lse, ratio=1e-12)


def test_union_attention_equals_per_query_masked_softmax():
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(3)
    read = torch.rand(2, 2, 5, 40, generator=g) < 0.3
    read[0, 1, 2] = False  # an empty read set: o = 0, lse = -inf
    o, lse = union_attention(q, k, v, read, 0.3)
    ro, rlse = _masked_reference(q, k, v, read, 0.3)
    assert_close(o, ro, ratio=1e-12)
    finite = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert_close(lse[finite], rlse[finite], ratio=1e-12)


def test_quest_per_query_reads_each_querys_best_pages_up_to_the_budget():
    q, k, v = _qkv(p=37)
    valid = torch.ones(2, 2, 37, dtype=torch.bool)
    valid[1, :, :5] = False  # left padding of row 1
    read, meta = quest_per_query(q, k, valid, budget=10, page_size=4)
    assert torch.equal(read.sum(-1), torch.full((2, 2, 5), 10))
    assert not bool((read & ~valid.unsqueeze(2)).any())
    # brute force: per query the page bound max_c max(q_c kmax_c, q_c kmin_c), max over the group's heads
    for b in range(2):
        for h in range(2):
            pages = [list(range(s, min(s + 4, 37))) for s in range(0, 37, 4)]
            live = [[j for j in pg if valid[b, h, j]] for pg in pages]
            for i in range(5):
                bounds = []
                for pg in live:
                    if not pg:
                        bounds.append(float("-inf"))
                        continue
                    kk = k[b, h, pg]
                    bound = max(float(torch.maximum(q[b, hh, i] * kk.max(0).values,
                                                    q[b, hh, i] * kk.min(0).values).sum())
                                for hh in (2 * h, 2 * h + 1))
                    bounds.append(bound)
                order = sorted(range(len(pages)), key=lambda p: (-bounds[p], p))
                want, left = set(), 10
                for p in order:
                    take = live[p][:left]
                    want.update(take)
                    left -= len(take)
                    if left == 0:
                        break
                assert set(read[b, h, i].nonzero().flatten().tolist()) == want
    assert meta == int(sum(1 for b in range(2) for h in range(2) for s in range(0, 37, 4)
                           if valid[b, h, s:s + 4].any())) * 2 * 8 * 8


def test_union_density_equals_a_brute_force_count():
    g = torch.Generator().manual_seed(4)
    read = torch.rand(3, 2, 6, 50, generator=g) < 0.05
    valid = torch.ones(3, 2, 50, dtype=torch.bool)
    valid[2, :, :13] = False
    read &= valid.unsqueeze(2)
    got = page_density(read, valid, 8)
    for b in range(3):
        for h in range(2):
            touched = {j // 8 for i in range(6) for j in range(50) if read[b, h, i, j]}
            total = {j // 8 for j in range(50) if valid[b, h, j]}
            assert abs(float(got[b, h]) - len(touched) / len(total)) < 1e-6


def _model(block=4, layers=2, seed=0):
    from lightning_modules.llm.model.loading import load_causal_lm

    model, _ = load_causal_lm("tiny-llama", with_tokenizer=False, tiny={"vocab_size": 40, "num_hidden_layers": layers},
                              seed=seed)
    apply_block_diffusion(model.double(), BlockDiffusionSetting(block, 3, False))
    return model


def _generate(model, prompt, arm=None, steps=4, new=8):
    cfg = BlockSamplerConfig(steps=steps)
    if arm is None:
        return block_generate(model, prompt, None, new, cfg=cfg).tokens, None
    with install_block_sparse(model, arm) as (session, hook):
        tokens = block_generate(model, prompt, None, new, cfg=cfg, hooks=[hook]).tokens
    return tokens, session


def test_losa_with_every_token_active_and_a_full_budget_equals_dense():
    model = _model()
    prompt = torch.randint(4, 40, (2, 32), generator=torch.Generator().manual_seed(5))
    dense, _ = _generate(model, prompt)
    for arm in (LoSAConfig(active=4, budget=10_000, page_size=4), BlockQuestConfig(budget=10_000, page_size=4),
                BlockFixedConfig(budget=10_000, page_size=4), BlockDenseConfig(page_size=4)):
        tokens, session = _generate(model, prompt, arm)
        assert tokens == dense, arm.label
        s = session.summary()
        assert abs(s["density"] - 1.0) < 1e-9, arm.label


def test_losa_layer_outputs_equal_dense_at_full_activity():
    """Per call, not only the sampled tokens: the runner's attention output equals the stock block attention."""
    from lightning_modules.losa.method import LoSAPrefix

    q, k, v = _qkv(n=4, p=24)
    valid = torch.ones(2, 2, 24, dtype=torch.bool)
    strat = LoSAPrefix(LoSAConfig(active=4, budget=24, page_size=4))
    st = LayerState()
    h0 = torch.randn(2, 4, 16, dtype=torch.float64)
    o0, lse0, _, _, _ = strat.prefix(st, 0, q, k, v, valid, 0.3, h0)
    q2 = q + 0.1 * torch.randn_like(q)
    o1, lse1, _, act, _ = strat.prefix(st, 1, q2, k, v, valid, 0.3, h0 + 1.0)
    ref, ref_lse = litctx_kernels.attention(q2, k, v, scale=0.3, causal=False)
    assert act == 4
    assert_close(o1, ref, ratio=1e-12)
    assert_close(lse1, ref_lse, ratio=1e-12)


def test_cached_prefix_results_equal_recomputed_ones_when_nothing_changes():
    """No hidden-state change: whatever LoSA selects, the outputs at step 1 equal a dense recomputation (the stable
    tokens' cache holds step 0's dense results, and the queries are unchanged)."""
    from lightning_modules.losa.method import LoSAPrefix

    q, k, v = _qkv(n=4, p=24)
    valid = torch.ones(2, 2, 24, dtype=torch.bool)
    h = torch.randn(2, 4, 16, dtype=torch.float64)
    strat = LoSAPrefix(LoSAConfig(active=1, budget=24, page_size=4))  # the one active token reads everything
    st = LayerState()
    strat.prefix(st, 0, q, k, v, valid, 0.3, h)
    o1, lse1, read, act, _ = strat.prefix(st, 1, q, k, v, valid, 0.3, h.clone())
    ref, ref_lse = litctx_kernels.attention(q, k, v, scale=0.3, causal=False)
    assert_close(o1, ref, ratio=1e-12)
    assert_close(lse1, ref_lse, ratio=1e-12)
    assert act == 1 and int(read.any(-1).sum(-1).max()) == 1  # one query read the prefix


def test_losa_reads_for_the_most_changed_tokens_and_reuses_the_rest():
    from lightning_modules.losa.method import LoSAPrefix

    q, k, v = _qkv(n=4, p=32)
    valid = torch.ones(2, 2, 32, dtype=torch.bool)
    strat = LoSAPrefix(LoSAConfig(active=2, budget=8, page_size=4))
    st = LayerState()
    h = torch.zeros(2, 4, 16, dtype=torch.float64)
    o0, lse0, *_ = strat.prefix(st, 0, q, k, v, valid, 0.3, h)
    h1 = h.clone()
    h1[0, 1] += 2.0
    h1[0, 3] += 1.0
    h1[0, 0] += 0.5
    h1[1, 2] += 3.0
    h1[1, 0] += 1.0
    q1 = q + 1.0
    o1, lse1, read, act, _ = strat.prefix(st, 1, q1, k, v, valid, 0.3, h1)
    assert act == 2
    active = {0: {1, 3}, 1: {0, 2}}
    for b in range(2):
        for i in range(4):
            if i in active[b]:
                rd, _ = quest_per_query(q1[b:b + 1, :, i:i + 1], k[b:b + 1], valid[b:b + 1], 8, 4)
                ro, _ = _masked_reference(q1[b:b + 1, :, i:i + 1], k[b:b + 1], v[b:b + 1], rd, 0.3)
                assert_close(o1[b, :, i], ro[0, :, 0], ratio=1e-12)
            else:
                assert torch.equal(o1[b, :, i], o0[b, :, i])  # stable: the cached dense result


def test_threshold_selects_relative_to_the_largest_change():
    from lightning_modules.losa.method import LoSAPrefix

    strat = LoSAPrefix(LoSAConfig(threshold=0.5))
    act = strat.select_active(torch.tensor([[1.0, 0.6, 0.4, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert act[0].tolist() == [True, True, False, False]
    assert int(act[1].sum()) >= 1


def test_fixed_pattern_is_chosen_at_the_first_step_and_reused():
    from lightning_modules.losa.method import FixedPrefix

    q, k, v = _qkv(n=4, p=32)
    valid = torch.ones(2, 2, 32, dtype=torch.bool)
    strat = FixedPrefix(BlockFixedConfig(budget=8, page_size=4))
    st = LayerState()
    strat.prefix(st, 0, q, k, v, valid, 0.3, None)
    first = st.read.clone()
    assert torch.equal(first.sum(-1), torch.full((2, 2, 4), 8))
    # the pages are each query's top pages by the dense step's attention mass (max over the group's heads)
    g = 2
    p = torch.softmax((q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * 0.3, -1)
    mass = p.view(2, 2, g, 4, 8, 4).sum(-1).amax(2)  # [B, Hk, n, pages]
    top = mass.topk(2, -1).indices
    for b in range(2):
        for h in range(2):
            for i in range(4):
                pages = set((first[b, h, i].nonzero().flatten() // 4).tolist())
                assert pages == set(top[b, h, i].tolist())
    o1, _, read, _, _ = strat.prefix(st, 1, q + 1.0, k, v, valid, 0.3, None)
    assert torch.equal(read, first)
    ro, _ = _masked_reference(q + 1.0, k, v, first, 0.3)
    assert_close(o1, ro, ratio=1e-12)


def test_quest_union_inflates_and_losa_union_is_smaller_at_equal_budget():
    """The accounting on a real sampler run: with 1 active token per later step, LoSA's union over the later steps
    is at most Quest's (the union over all block queries) at the same per-query budget."""
    model = _model(block=8)
    prompt = torch.randint(4, 40, (2, 128), generator=torch.Generator().manual_seed(6))
    _, quest = _generate(model, prompt, BlockQuestConfig(budget=8, page_size=8), new=8)
    _, losa = _generate(model, prompt, LoSAConfig(active=1, budget=8, page_size=8), new=8)
    q, s = quest.summary(), losa.summary()
    assert s["density_later"] <= q["density_later"] + 1e-9
    assert q["density_later"] > 1 / 16  # one page per query, but the union over 8 queries spans more
    assert all(abs(v - 1 / 8) < 1e-9 for v in s["active_share_by_layer"].values())


def test_configs_validate_every_field_and_build_what_they_say():
    for name, cls in BLOCK_SPARSE_METHODS.items():
        default = cls()
        assert default.build().cfg is default
        for f in dataclasses.fields(cls):
            with pytest.raises(ValueError, match=f"{name}.{f.name}"):
                cls(**{f.name: 0 if f.name != "threshold" else 1.5})
    arms = prefix_grid([16, 32], actives=(1, 5))
    labels = [a.label for a in arms]
    assert labels[0] == "dense" and "quest_b16" in labels and "fixed_b32" in labels and "losa_ka5_b32" in labels
    assert len(labels) == len(set(labels)) == 1 + 2 * 4


def test_registered_callbacks_build_from_config():
    from recipes.registry import CALLBACKS, create_callback

    names = [n for n, spec in CALLBACKS.items() if spec.target.endswith("losa.callback:BlockSparseCallback")]
    assert sorted(names) == sorted(BLOCK_SPARSE_METHODS)
    cb = create_callback("losa", {"active": 3, "budget": 32, "page_size": 8})
    assert (cb.cfg.active, cb.cfg.budget, cb.cfg.page_size) == (3, 32, 8)
    with pytest.raises(Exception, match="budget"):
        create_callback("block_quest", {"budget": -1})


def test_losa_callback_on_the_bdlm_recipe_logs_density():
    from recipes.api import build

    run = build("bdlm_tiny", ["callbacks.sparse={name: losa, args: {active: 2, budget: 8, page_size: 4}}"], ["tiny"])
    run.fit()
    metrics = run.test("last")
    for key in ("test/density", "test/density_later", "test/kv_bytes_per_step", "test/exact_match"):
        assert key in metrics and math.isfinite(metrics[key]), key
    assert metrics["test/kv_bytes_per_step"] < metrics["test/dense_kv_bytes_per_step"]


def test_bench_runs_every_arm_from_one_prefill_and_reports_the_comparison(tmp_path):
    """bench.losa end to end on a small saved model: every arm gets a record, the dense arm matches a plain sampler
    run, and the report has the LoSA - Quest rows."""
    from bench import losa as bench

    model = _model(block=4)
    model.resize_token_embeddings(264)
    from lightning_modules.bdlm.block_attention import block_setting

    model.float().save_pretrained(tmp_path / "hf")
    loaded, tok, setting = bench.load(str(tmp_path / "hf"))
    assert tok is None and setting == block_setting(model)
    batches = bench.samples(None, setting, 64, 2, seed=0)
    arms = prefix_grid([8], actives=(1,), page_size=4)
    out = tmp_path / "rec.jsonl"
    for b in batches:
        bench.run_sample(loaded, b, arms, 2, set(), out)
    from litctx_common.io import read_jsonl

    recs = list(read_jsonl(out))
    assert len(recs) == 2 * len(arms)
    plain = block_generate(loaded, batches[0]["input_ids"][:, :batches[0]["prompt_len"]],
                           batches[0]["attention_mask"][:, :batches[0]["prompt_len"]], batches[0]["answer_len"],
                           stop_ids=[batches[0]["eos_id"]], cfg=BlockSamplerConfig(steps=2)).tokens[0]
    dense0 = [r for r in recs if r["arm"] == "dense" and r["id"] == batches[0]["id"][0]][0]
    assert dense0["tokens"] == plain and abs(dense0["density"] - 1.0) < 1e-9
    text = bench.report(recs, "hf", None)
    assert "| 8 | ka1 |" in text and "quest_b8" in text and "fixed_b8" in text


def test_bench_verdict_requires_less_reading_and_no_significant_accuracy_loss():
    """The LoSA - Quest verdict: fewer pages read and no lower accuracy is ``yes``; a lower accuracy inside a
    0-including interval is a ``tie``; reading as much, or an interval below 0, is ``no``."""
    from bench.losa import losa_verdict

    up = {"diff": 0.02, "lo": -0.01, "hi": 0.05}
    down_ns = {"diff": -0.02, "lo": -0.06, "hi": 0.01}
    down = {"diff": -0.05, "lo": -0.09, "hi": -0.01}
    assert losa_verdict(0.5, [up, up]) == "yes"
    assert losa_verdict(0.5, [up, down_ns]) == "tie"
    assert losa_verdict(0.5, [up, down]) == "**no**"
    assert losa_verdict(1.0, [up, up]) == "**no**"
