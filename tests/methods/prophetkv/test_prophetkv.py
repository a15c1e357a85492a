"""ProphetKV and its baselines on tiny Llama / Qwen2 / OLMo-2: recomputing every chunk token equals full prefill
for every selector, r = 0 equals naive reuse, ProphetKV's Stage-I scores equal the eager attention transformers
returns, CacheBlend keeps the tokens of highest value deviation (checked against a full prefill), EPIC takes
chunk-initial tokens, every selector spends exactly the budget, and a warm store serves every chunk."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_modules.llm.runtime.cache_surgery import assemble, compute_segments
from lightning_modules.llm.runtime.cached_lm import CachedLM
from lightning_modules.llm.runtime.kv_store import KVSegmentStore
from lightning_modules.llm.model.loading import load_causal_lm
from lightning_modules.prophetkv.reuse import ReuseConfig, question_focus
from lightning_modules.prophetkv.selectors import SELECTORS, budgets, question_attention, fuse_layers

pytestmark = pytest.mark.usefixtures("torch_seed")

ARCHS = ("llama", "qwen2", "olmo2")
REUSERS = ("naive", "random", "epic", "cacheblend", "prophetkv", "oracle")


def tiny(arch="llama", layers=3):
    model, _ = load_causal_lm(f"tiny-{arch}", with_tokenizer=False, dtype="float32", tiny={"num_hidden_layers": layers})
    return model


def toks(n, seed):
    return torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prompt(seed=0, n_chunks=3):
    return toks(4, seed), [toks(9 + 3 * i, seed + 10 + i) for i in range(n_chunks)], toks(5, seed + 50)


def full_logits(model, prefix, chunks, question):
    lm = CachedLM(model)
    return lm.feed(torch.tensor([prefix + sum(chunks, []) + question]))


@pytest.mark.parametrize("selector", REUSERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_recomputing_everything_equals_full_prefill(arch, selector, tmp_path):
    model = tiny(arch)
    prefix, chunks, question = prompt()
    run = ReuseConfig(selector=selector, ratio=1.0, store_dir=str(tmp_path)).build(model)
    res = run.prefill(prefix, [chunks], [question])
    ref = full_logits(model, prefix, chunks, question)
    if selector == "naive":  # ratio is ignored: nothing is recomputed, and stale chunks change the logits
        assert float((res.first_logits - ref).abs().max()) > 1e-3
        return
    assert torch.allclose(res.first_logits, ref, atol=1e-4), float((res.first_logits - ref).abs().max())
    assert res.stats["recomputed"] == [sum(map(len, chunks))]


@pytest.mark.parametrize("selector", REUSERS)
def test_ratio_zero_equals_naive_reuse(selector, tmp_path):
    model = tiny("qwen2")
    prefix, chunks, question = prompt(1)
    store = KVSegmentStore(str(tmp_path))
    naive = ReuseConfig(selector="naive").build(model, store).prefill(prefix, [chunks], [question])
    got = ReuseConfig(selector=selector, ratio=0.0).build(model, store).prefill(prefix, [chunks], [question])
    assert torch.allclose(got.first_logits, naive.first_logits, atol=1e-5)
    assert got.stats["recomputed"] == [0]


def test_full_prefill_matches_one_forward_and_a_ragged_batch(tmp_path):
    model = tiny("llama")
    rows = [prompt(0, 2), prompt(5, 3)]
    prefix = rows[0][0]
    run = ReuseConfig(selector="full").build(model, KVSegmentStore(str(tmp_path)))
    res = run.prefill(prefix, [r[1] for r in rows], [r[2] for r in rows])
    for b, (_, chunks, q) in enumerate(rows):
        assert torch.allclose(res.first_logits[b], full_logits(model, prefix, chunks, q)[0], atol=1e-4)
    pk = ReuseConfig(selector="prophetkv", ratio=1.0).build(model, KVSegmentStore(str(tmp_path)))
    got = pk.prefill(prefix, [r[1] for r in rows], [r[2] for r in rows])
    assert torch.allclose(got.first_logits, res.first_logits, atol=1e-4)


def eager_attentions(model, prefix, chunks, q):
    """The reference of Stage I: the question ``q [1, n]`` over a fresh copy of the stale cache with eager attention,
    transformers' attentions returned; ``(cache width, per-layer [1, H, n, width + n])``."""
    ref_ctx = assemble(model, [compute_segments(model, chunks, prefix)], prefix)
    width = ref_ctx.lm.mask.shape[1]
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=q, position_ids=torch.arange(width, width + q.shape[1]).unsqueeze(0),
                    cache=ref_ctx.lm.cache, use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation("litctx")
    return width, out.attentions


def test_stage_one_scores_equal_transformers_eager_attentions():
    model = tiny("llama")
    prefix, chunks, question = prompt(2)
    ctx = assemble(model, [compute_segments(model, chunks, prefix)], prefix)
    q = torch.tensor([question])
    alpha = question_attention(ctx, q, torch.ones_like(q))
    width, attentions = eager_attentions(model, prefix, chunks, q)
    for layer, att in enumerate(attentions):
        want = att.float().mean(dim=(1, 2))[:, :width]  # heads, question tokens
        assert torch.allclose(alpha[layer], want, atol=1e-5), layer
    assert ctx.lm.mask.shape[1] == width  # Stage I was taken back
    # Stage II recomputes the top of the fused scores
    fused = fuse_layers(alpha, width)
    k = budgets(ctx, 0.3)[0]
    cols = ctx.chunk_columns[0]
    top = sorted(sorted(cols, key=lambda c: (-float(fused[0, c]), c))[:k])
    plan = SELECTORS["prophetkv"]().build().plan(ctx, 0.3, q, torch.ones_like(q))
    assert plan.slots[0].tolist() == top


def test_stage_one_reads_only_the_questions_own_rows_when_asked():
    """``query_span: question`` averages the rows the focus marks (checked against eager attentions of those rows
    alone); ``tail`` ignores the focus; a row without focus falls back to every real row."""
    model = tiny("llama")
    prefix, chunks, question = prompt(4)
    q = torch.tensor([question])
    focus = torch.zeros_like(q, dtype=torch.float)
    focus[0, 1:3] = 1.0
    ctx = assemble(model, [compute_segments(model, chunks, prefix)], prefix)
    alpha = question_attention(ctx, q, torch.ones_like(q), focus)
    width, attentions = eager_attentions(model, prefix, chunks, q)
    for layer, att in enumerate(attentions):
        want = att.float()[:, :, 1:3].mean(dim=(1, 2))[:, :width]
        assert torch.allclose(alpha[layer], want, atol=1e-5), layer
    every = question_attention(ctx, q, torch.ones_like(q))
    assert any(not torch.allclose(every[i], alpha[i], atol=1e-4) for i in alpha)  # the rows matter
    k = budgets(ctx, 0.3)[0]
    top = lambda a: sorted(sorted(ctx.chunk_columns[0], key=lambda c: (-float(fuse_layers(a, width)[0, c]), c))[:k])
    asked = SELECTORS["prophetkv"]().build().plan(ctx, 0.3, q, torch.ones_like(q), focus)
    tail = SELECTORS["prophetkv"](query_span="tail").build().plan(ctx, 0.3, q, torch.ones_like(q), focus)
    assert asked.slots[0].tolist() == top(alpha) and asked.stats["stage1_rows"] == "question"
    assert tail.slots[0].tolist() == top(every) and tail.stats["stage1_rows"] == "tail"
    unmarked = question_attention(ctx, q, torch.ones_like(q), torch.zeros_like(focus))
    assert all(torch.allclose(unmarked[i], every[i]) for i in every)


def test_question_spans_reach_stage_one_through_a_ragged_batch(tmp_path):
    """Spans given to ``prefill`` land on each row's own tokens after left padding; a span outside its row is an
    error naming the row."""
    model = tiny("llama")
    rows = [prompt(0, 2), (prompt(5, 3)[0], prompt(5, 3)[1], toks(8, 77))]
    prefix = rows[0][0]
    spans = [(1, 3), (2, 6)]
    focus = question_focus([r[2] for r in rows], spans, 8)
    assert focus.tolist() == [[0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 0, 0]]
    assert question_focus([r[2] for r in rows], None, 8) is None
    with pytest.raises(ValueError, match="row 1's question span \\(2, 9\\)"):
        question_focus([r[2] for r in rows], [(1, 3), (2, 9)], 8)
    seen = {}
    real = SELECTORS["prophetkv"]().build()

    class Spy:
        def plan(self, ctx, ratio, q, mask, focus=None):
            seen["focus"] = focus
            return real.plan(ctx, ratio, q, mask, focus)

    run = ReuseConfig(selector="prophetkv", ratio=0.5).build(model, KVSegmentStore(str(tmp_path)))
    run.selector = Spy()
    res = run.prefill(prefix, [r[1] for r in rows], [r[2] for r in rows], spans)
    assert seen["focus"].tolist() == focus.tolist() and res.stats["stage1_rows"] == "question"
    res = run.prefill(prefix, [r[1] for r in rows], [r[2] for r in rows])
    assert seen["focus"] is None and res.stats["stage1_rows"] == "tail"


def test_cacheblend_keeps_the_tokens_whose_values_deviate_most():
    model = tiny("llama", layers=4)
    prefix, chunks, question = prompt(3)
    ctx = assemble(model, [compute_segments(model, chunks, prefix)], prefix)
    stale_v1 = ctx.lm.cache.layers[1].values.clone()
    full = CachedLM(model)
    full.feed(torch.tensor([prefix + sum(chunks, [])]))
    dev = (full.cache.layers[1].values - stale_v1).pow(2).sum(dim=(1, 3)).sqrt()[0]  # layer-1 deviation per column
    cols = ctx.chunk_columns[0]
    k = budgets(ctx, 0.25)[0]
    want = sorted(sorted(cols, key=lambda c: (-float(dev[c]), c))[:k])
    run = ReuseConfig(selector="cacheblend", ratio=0.25, selector_args={"check_layer": 1, "filter_layers": 0})
    plan = SELECTORS["cacheblend"](check_layer=1, filter_layers=0).build().plan(ctx, 0.25, None, None)
    from lightning_modules.llm.runtime.cache_surgery import selective_forward

    before = [layer.values.clone() for layer in ctx.lm.cache.layers]
    selective_forward(ctx, plan.slots, torch.tensor([question]), layer_hook=plan.layer_hook)
    assert plan.stats["rows_per_layer"] == {0: len(cols), 1: len(cols), 2: k, 3: k}
    changed = [c for c in cols if not torch.equal(ctx.lm.cache.layers[3].values[0, :, c], before[3][0, :, c])]
    assert sorted(changed) == want
    assert run.name == "cacheblend@0.25"


def test_epic_takes_chunk_initial_tokens_and_every_selector_spends_the_budget(tmp_path):
    model = tiny("llama")
    prefix, chunks, question = prompt(4)
    ctx = assemble(model, [compute_segments(model, chunks, prefix)], prefix)
    q = torch.tensor([question])
    k = budgets(ctx, 0.2)[0]
    assert k == math.ceil(0.2 * sum(map(len, chunks)))
    plan = SELECTORS["epic"]().build().plan(ctx, 0.2, q, torch.ones_like(q))
    picked = plan.slots[0].tolist()
    assert len(picked) == k
    for s, e in ctx.spans[0]:
        mine = [c for c in picked if s <= c < e]
        assert mine == list(range(s, s + len(mine)))  # a prefix of the chunk
    fixed = SELECTORS["epic"](tokens_per_chunk=2).build().plan(ctx, 0.2, q, torch.ones_like(q))
    assert fixed.slots[0].tolist() == [c for s, _ in ctx.spans[0] for c in (s, s + 1)]
    for name in ("random", "prophetkv", "oracle"):
        plan = SELECTORS[name]().build().plan(ctx, 0.2, q, torch.ones_like(q))
        cols = plan.slots[0].tolist()
        assert len(cols) == k and len(set(cols)) == k and set(cols) <= set(ctx.chunk_columns[0]), name
    a = SELECTORS["random"](seed=1).build().plan(ctx, 0.2, q, None).slots
    b = SELECTORS["random"](seed=1).build().plan(ctx, 0.2, q, None).slots
    assert torch.equal(a, b)


def test_the_run_names_the_chunk_positions_it_recomputed(tmp_path):
    """``stats["selected"]``: per row, positions over the row's chunk tokens (prompt order): EPIC with two tokens
    per chunk picks each document's first two; a ragged batch keeps each row's own positions."""
    model = tiny("llama")
    prefix, chunks, question = prompt(4)
    _, other, question2 = prompt(5, n_chunks=2)
    store = KVSegmentStore(str(tmp_path))
    res = ReuseConfig(selector="epic", ratio=0.2, selector_args={"tokens_per_chunk": 2}).build(model, store).prefill(
        prefix, [chunks, other], [question, question2])
    starts = lambda cs: [sum(map(len, cs[:i])) for i in range(len(cs))]  # noqa: E731
    assert res.stats["selected"] == [[p + d for p in starts(chunks) for d in (0, 1)],
                                     [p + d for p in starts(other) for d in (0, 1)]]
    pk = ReuseConfig(selector="prophetkv", ratio=0.2).build(model, store).prefill(prefix, [chunks], [question])
    assert len(pk.stats["selected"][0]) == pk.stats["recomputed"][0] == math.ceil(0.2 * sum(map(len, chunks)))


def test_a_warm_store_serves_every_chunk_and_gives_the_same_answer(tmp_path):
    model = tiny("llama")
    prefix, chunks, question = prompt(6)
    store = KVSegmentStore(str(tmp_path))
    run = ReuseConfig(selector="prophetkv", ratio=0.2).build(model, store)
    run.warm(prefix, [chunks])
    first = run.prefill(prefix, [chunks], [question])
    assert first.stats["store_hits"] == len(chunks) + 1 and first.stats["store_misses"] == 0
    again = run.prefill(prefix, [chunks], [question])
    assert torch.equal(first.first_logits, again.first_logits)
    tokens = again.lm.greedy(again.first_logits, 4)
    assert len(tokens[0]) == 4


def test_bad_settings_fail_in_one_line():
    with pytest.raises(ValueError, match="kv_reuse.selector='magic'.*valid selectors"):
        ReuseConfig(selector="magic")
    with pytest.raises(ValueError, match="kv_reuse.ratio"):
        ReuseConfig(ratio=1.5)
    with pytest.raises(ValueError, match="check_layer"):
        ReuseConfig(selector="cacheblend", selector_args={"check_layer": 0})
    with pytest.raises(ValueError, match="selector_args"):
        ReuseConfig(selector="epic", selector_args={"layers": 2})


# ---------------------------------------------------------------------------------------------- the papers' own configs
@pytest.mark.parametrize("name, args, selector_args", [
    ("prophetkv", {"ratio": 0.3, "layer_fusion": "max"}, {"layer_fusion": "max"}),
    ("cacheblend", {"ratio": 0.3, "check_layer": 2, "filter_layers": 0}, {"check_layer": 2, "filter_layers": 0}),
    ("epic", {"ratio": 0.3, "tokens_per_chunk": 2}, {"tokens_per_chunk": 2}),
])
def test_each_papers_config_selects_what_kv_reuse_selects_by_name(name, args, selector_args, tmp_path):
    from recipes import registry

    own = registry.create_callback(name, args).cfg
    generic = ReuseConfig(selector=name, selector_args=selector_args, ratio=0.3)
    assert own.reuse_config().selector == name and own.reuse_config().ratio == 0.3
    assert own.name == generic.name
    model = tiny(layers=3)
    store = KVSegmentStore(str(tmp_path))
    prefix, chunks, question = prompt(seed=3)
    a = own.build(model, store).prefill(prefix, [chunks], [question])
    b = generic.build(model, store).prefill(prefix, [chunks], [question])
    assert a.stats["recomputed"] == b.stats["recomputed"]
    assert torch.equal(a.first_logits, b.first_logits)


def test_each_papers_config_records_its_ratio_and_refuses_a_foreign_knob():
    from recipes import registry
    from recipes.configio import ConfigError

    done = registry.complete_args(registry.callback_spec("prophetkv").config, "", {}, "callbacks.reuse.args")
    assert done == {"layer_fusion": "mean", "query_span": "question", "ratio": 0.2, "store_dir": None,
                    "store_max_bytes": None}
    with pytest.raises(ConfigError, match="check_layer"):
        registry.create_callback("prophetkv", {"check_layer": 2})
    with pytest.raises(ConfigError, match=r"epic\.ratio"):
        registry.create_callback("epic", {"ratio": 2.0})
