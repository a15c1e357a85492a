"""The block-diffusion LM: block-causal masks against brute force, the training layout against per-block cached
inference, the masked-diffusion loss against a per-token reference, the mask token, the sampler (unmasking
schedule, determinism, exact prefix cache), save / reload, the multi-key data, and the recipe end to end."""

from __future__ import annotations

import random

import pytest
import torch

from litctx_kernels.testing import assert_close

pytest.importorskip("transformers")

from datamodules.synth.multi_key import (MASK, MultiKeyConfig, MultiKeyDataModule, Vocabulary,  # noqa: E402
                                         collate_multi_key, make_sample)
from lightning_modules.bdlm.block_attention import (BlockAttention, BlockDiffusionSetting,  # noqa: E402
                                                   apply_block_diffusion, block_causal_mask, block_diffusion_attention,
                                                   block_setting, training_forward, training_layout)

pytestmark = pytest.mark.usefixtures("torch_seed", "two_torch_threads")


def _brute_mask(n_q, n_k, block):
    """By loops: query column i (of the last n_q) reads key column j iff j // block <= i // block."""
    m = torch.zeros(n_q, n_k, dtype=torch.bool)
    for a in range(n_q):
        i = n_k - n_q + a
        for j in range(n_k):
            m[a, j] = (j // block) <= (i // block)
    return m


def _brute_training_mask(n_clean, blocks, block):
    """By loops over the [x_0 ; x_t] columns: clean c reads clean j iff blk(j) <= blk(c); the copy of block b at
    offset r reads clean j iff blk(j) < b, and copy columns of the same block only."""
    cols = [("c", j // block) for j in range(n_clean)]
    cols += [("t", b) for b in blocks for _ in range(block)]
    copy_id = [None] * n_clean + [k for k in range(len(blocks)) for _ in range(block)]
    n = len(cols)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, (kind_i, b_i) in enumerate(cols):
        for j, (kind_j, b_j) in enumerate(cols):
            if kind_i == "c":
                m[i, j] = kind_j == "c" and b_j <= b_i
            else:
                m[i, j] = (kind_j == "c" and b_j < b_i) or (kind_j == "t" and copy_id[j] == copy_id[i])
    return m


def _dense(q, k, v, mask, key_mask=None):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    full = mask[None, None].expand(q.shape[0], 1, -1, -1)
    if key_mask is not None:
        full = full & key_mask[:, None, None, :]
    return torch.softmax(s.masked_fill(~full, float("-inf")), -1).nan_to_num(0.0) @ v


@pytest.mark.parametrize("n_old,n_q,block", [(0, 32, 8), (16, 8, 8), (24, 16, 4), (0, 12, 4)])
def test_block_causal_mask_and_call_attention_equal_brute_force(n_old, n_q, block):
    n_k = n_old + n_q
    assert torch.equal(block_causal_mask(n_q, n_k, block), _brute_mask(n_q, n_k, block))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, n_q, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, n_k, 8, generator=g, dtype=torch.float64) for _ in range(2))
    state = BlockAttention(BlockDiffusionSetting(block, 0))
    out = block_diffusion_attention(state, q, k, v, None, q.shape[-1] ** -0.5)
    assert_close(out, _dense(q, k, v, _brute_mask(n_q, n_k, block)), ratio=1e-10)


def test_unaligned_calls_are_refused_with_the_sizes():
    state = BlockAttention(BlockDiffusionSetting(8, 0))
    q, k = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 11, 4)
    with pytest.raises(ValueError, match="3 new columns after 8 cached.*multiples of 8"):
        block_diffusion_attention(state, q, k, k, None, 0.5)


@pytest.mark.parametrize("blocks", [[0, 1, 2, 3], [2], [1, 3]])
def test_training_layout_equals_the_brute_force_mask_and_attention(blocks):
    block, n_clean = 4, 16
    layout = training_layout(n_clean, blocks, block)
    n = n_clean + block * len(blocks)
    want = _brute_training_mask(n_clean, blocks, block)
    got = torch.zeros(n, n, dtype=torch.bool)  # the layout's element mask (non-causal inside listed tiles)
    bm = layout.to_block_mask()[0, 0]
    for a in range(bm.shape[0]):
        for b in range(bm.shape[1]):
            got[a * block:(a + 1) * block, b * block:(b + 1) * block] = bool(bm[a, b])
    assert torch.equal(got, want)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(2))
    key_mask = torch.ones(2, n, dtype=torch.bool)
    key_mask[1, :3] = False  # left padding of row 1, and its copies (none here: block 0 holds it)
    state = BlockAttention(BlockDiffusionSetting(block, 0))
    state.layout, state.key_mask = layout, key_mask
    out = block_diffusion_attention(state, q, k, v, None, q.shape[-1] ** -0.5)
    ref = _dense(q, k, v, want, key_mask)
    live = key_mask[:, None, :, None].expand_as(ref)  # padded query rows are never read
    assert_close(out[live], ref[live], ratio=1e-10)


def _tiny_bdlm(block=4, shift=True, vocab=40, mask_id=3, layers=2):
    from lightning_modules.llm.model.loading import load_causal_lm

    model, _ = load_causal_lm("tiny-llama", with_tokenizer=False,
                              tiny={"vocab_size": vocab, "num_hidden_layers": layers}, seed=0)
    model = model.double()
    apply_block_diffusion(model, BlockDiffusionSetting(block, mask_id, shift))
    return model


@pytest.mark.parametrize("shift", [True, False])
def test_vectorised_training_forward_equals_block_by_block_cached_inference(shift):
    """The [x_0 ; x_t] forward gives, at each noised copy, the logits that inference computes: the clean blocks
    before it prefilled into a cache, then the noised block peeked against that cache."""
    from lightning_modules.bdlm.module import noise_blocks
    from lightning_modules.llm.runtime.cached_lm import CachedLM

    block, n = 4, 16
    model = _tiny_bdlm(block, shift)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 40, (2, n), generator=g)
    loss_mask = torch.zeros(2, n, dtype=torch.bool)
    loss_mask[:, 8:] = True
    nz = noise_blocks(ids, loss_mask, block, 3, 0.3, generator=g)
    assert nz["blocks"].tolist() == [2, 3] and bool(nz["masked"].any())
    layout = training_layout(n, nz["blocks"].tolist(), block)
    inp = torch.cat([ids, nz["x_t"]], 1)
    pos = torch.cat([torch.arange(n), torch.arange(n)[nz["cols"]]]).expand(2, -1)
    with torch.no_grad(), training_forward(model, layout, None):
        logits = model(input_ids=inp, position_ids=pos, use_cache=False).logits
    for j, c in enumerate(nz["blocks"].tolist()):
        lm = CachedLM(model)
        with torch.no_grad():
            lm.feed(ids[:, :c * block])
            want = lm.peek(nz["x_t"][:, j * block:(j + 1) * block])
        got = logits[:, n + j * block:n + (j + 1) * block]
        assert_close(got.float(), want, ratio=1e-5)


def test_diffusion_loss_equals_a_per_token_reference():
    """The loss of one batch equals sum over masked tokens of CE / t, divided by the scored tokens, computed
    from full logits of the same forward; token_shift takes the prediction from the column before."""
    from lightning_modules.bdlm.module import diffusion_loss, noise_blocks

    block, n = 4, 12
    model = _tiny_bdlm(block, shift=True)
    setting = block_setting(model)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, 40, (2, n), generator=g)
    loss_mask = torch.zeros(2, n, dtype=torch.bool)
    loss_mask[:, 4:] = True
    batch = {"input_ids": ids, "loss_mask": loss_mask}
    loss, info = diffusion_loss(model, batch, setting, 0.2, generator=torch.Generator().manual_seed(9))
    nz = noise_blocks(ids, loss_mask, block, 3, 0.2, generator=torch.Generator().manual_seed(9))
    layout = training_layout(n, nz["blocks"].tolist(), block)
    inp = torch.cat([ids, nz["x_t"]], 1)
    pos = torch.cat([torch.arange(n), torch.arange(n)[nz["cols"]]]).expand(2, -1)
    with torch.no_grad(), training_forward(model, layout, None):
        logits = model(input_ids=inp, position_ids=pos, use_cache=False).logits.double()
    logits[..., 3] = float("-inf")
    total, scored = 0.0, 0
    for b in range(2):
        for j, c in enumerate(nz["blocks"].tolist()):
            for r in range(block):
                col = c * block + r
                scored += int(loss_mask[b, col])
                if not nz["masked"][b, j, r]:
                    continue
                src = (col - 1) if r == 0 else (n + j * block + r - 1)
                ce = -torch.log_softmax(logits[b, src], -1)[ids[b, col]]
                total += float(ce) / float(nz["t"][b, j])
    assert info["scored"] == scored and info["masked"] == int(nz["masked"].sum())
    assert abs(float(loss.detach()) - total / scored) < 1e-6 * max(1.0, total / scored)


def test_mask_ratio_follows_t_and_only_scored_tokens_are_masked():
    from lightning_modules.bdlm.module import noise_blocks

    ids = torch.randint(4, 40, (64, 32))
    loss_mask = torch.zeros(64, 32, dtype=torch.bool)
    loss_mask[:, 16:] = True
    loss_mask[:, 20] = False
    nz = noise_blocks(ids, loss_mask, 8, 3, 0.01, generator=torch.Generator().manual_seed(0))
    assert nz["blocks"].tolist() == [2, 3]
    xt = nz["x_t"].view(64, 2, 8)
    assert not bool((xt[:, 0, 4] == 3).any())  # column 20 is not scored: never masked
    frac = nz["masked"].float().sum(-1) / loss_mask[:, 16:].view(64, 2, 8).sum(-1)
    corr = torch.corrcoef(torch.stack([frac.flatten(), nz["t"].flatten()]))[0, 1]
    assert corr > 0.8  # the masked share tracks t per (row, block)


def test_unmask_schedule_and_threshold():
    from lightning_modules.bdlm.block_sampler import unmask_counts

    assert unmask_counts(16, 8) == [2] * 8
    assert unmask_counts(16, 5) == [4, 3, 3, 3, 3]
    assert unmask_counts(4, 8) == [1, 1, 1, 1]
    assert sum(unmask_counts(13, 4)) == 13


def _sample(model, prompt, steps=2, threshold=None, temperature=0.0, seed=0, new=8, hooks=()):
    from lightning_modules.bdlm.block_sampler import BlockSamplerConfig, block_generate

    cfg = BlockSamplerConfig(steps=steps, threshold=threshold, temperature=temperature, seed=seed)
    return block_generate(model, prompt, None, new, cfg=cfg, hooks=hooks)


def test_sampler_unmasks_by_confidence_and_never_emits_the_mask():
    """Greedy, 2 steps per block of 4: the first step reveals the 2 most confident positions of the peeked block
    (checked against the model's own probabilities), and no output token is the mask id."""
    from lightning_modules.bdlm.block_sampler import BlockHook
    from lightning_modules.llm.runtime.cached_lm import CachedLM

    model = _tiny_bdlm(4, shift=False)
    prompt = torch.randint(4, 40, (1, 8), generator=torch.Generator().manual_seed(1))
    seen = []

    class Spy(BlockHook):
        def on_logits(self, decoder, state, logits):
            seen.append((state.extras["block"], state.extras["block_step"], logits.clone(),
                         state.extras["masked"].clone()))

    res = _sample(model, prompt, hooks=[Spy()])
    toks = res.tokens[0]
    assert len(toks) == 8 and 3 not in toks
    assert [(b, s) for b, s, _, _ in seen] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _, _, logits0, masked0 = seen[0]
    assert bool(masked0.all())
    lm = CachedLM(model)
    with torch.no_grad():
        lm.feed(prompt)
        ref = lm.peek(torch.full((1, 4), 3))
    ref[..., 3] = float("-inf")
    assert_close(logits0, ref, ratio=1e-6)
    conf = torch.softmax(ref[0], -1).max(-1).values
    first = set(conf.topk(2).indices.tolist())
    _, _, _, masked1 = seen[1]
    assert set((~masked1[0]).nonzero().flatten().tolist()) == first
    assert [toks[i] for i in sorted(first)] == [int(ref[0, i].argmax()) for i in sorted(first)]


def test_sampler_is_deterministic_with_a_seed_and_the_prefix_cache_is_exact():
    model = _tiny_bdlm(4, shift=True)
    prompt = torch.randint(4, 40, (2, 8), generator=torch.Generator().manual_seed(2))
    a = _sample(model, prompt, temperature=1.0, seed=7, new=12).tokens
    b = _sample(model, prompt, temperature=1.0, seed=7, new=12).tokens
    c = _sample(model, prompt, temperature=1.0, seed=8, new=12).tokens
    assert a == b and a != c
    # the cache after the run (prompt + every block but the last, which ends the run uncommitted) equals a fresh
    # prefill of those tokens: block-causal attention makes the prefix cache exact
    from lightning_modules.bdlm.block_sampler import BlockDiffusionSampler, BlockSamplerConfig
    from lightning_modules.llm.runtime.cached_lm import CachedLM

    lm = CachedLM(model)
    with torch.no_grad():
        first = lm.feed(prompt)
        out = BlockDiffusionSampler(lm, BlockSamplerConfig(steps=2)).run(first, 8).tokens
        fresh = CachedLM(model)
        fresh.feed(torch.cat([prompt, torch.tensor(out)[:, :4]], 1))
    for la, lb in zip(lm.cache.layers, fresh.cache.layers):
        assert_close(la.keys, lb.keys, ratio=1e-10)
        assert_close(la.values, lb.values, ratio=1e-10)


def test_threshold_sampler_reveals_at_least_one_per_step():
    model = _tiny_bdlm(4, shift=False)
    prompt = torch.randint(4, 40, (1, 8), generator=torch.Generator().manual_seed(4))
    res = _sample(model, prompt, steps=2, threshold=1.0, new=4)  # nothing reaches 1.0: one position per step
    assert res.stats["steps_per_block"] == [4]
    res = _sample(model, prompt, steps=2, threshold=1e-9, new=4)  # everything reaches it: one step
    assert res.stats["steps_per_block"] == [1]


def test_runners_that_compute_causal_attention_are_refused():
    from lightning_modules.kv_eviction.config import SnapKVConfig
    from lightning_modules.llm.kv_policy.runner import install_policy

    model = _tiny_bdlm()
    with pytest.raises(RuntimeError, match="block-diffusion attention"):
        with install_policy(model, SnapKVConfig(keep=8).build()):
            pass


def test_setting_survives_save_and_reload(tmp_path):
    from lightning_modules.bdlm.block_sampler import BlockSamplerConfig, block_generate
    from lightning_modules.llm.model.loading import load_causal_lm

    model = _tiny_bdlm(4, shift=True).float()
    model.save_pretrained(tmp_path / "m")
    again, _ = load_causal_lm(str(tmp_path / "m"), with_tokenizer=False)
    assert block_setting(again) == block_setting(model)
    prompt = torch.randint(4, 40, (1, 8), generator=torch.Generator().manual_seed(6))
    cfg = BlockSamplerConfig(steps=2)
    assert block_generate(model, prompt, None, 8, cfg=cfg).tokens == block_generate(again, prompt, None, 8,
                                                                                   cfg=cfg).tokens


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="block_size"):
        BlockDiffusionSetting(0, 1)
    model = _tiny_bdlm()
    with pytest.raises(ValueError, match="mask_token_id=99 is outside"):
        apply_block_diffusion(model, BlockDiffusionSetting(4, 99))
    from lightning_modules.bdlm.module import BlockDiffusionLMConfig

    with pytest.raises(ValueError, match="bdlm.t_min"):
        BlockDiffusionLMConfig(model="tiny-llama", t_min=0.0)
    with pytest.raises(ValueError, match="sampler.steps"):
        BlockDiffusionLMConfig(model="tiny-llama", sampler={"steps": 0})


def test_mask_token_is_added_to_a_tokenizer_and_the_embeddings_resized():
    from lightning_modules.bdlm.module import BlockDiffusionLM

    m = BlockDiffusionLM({"model": "tiny-llama", "block_size": 4})
    tok = m.tokenizer
    mask_id = block_setting(m.model).mask_token_id
    assert tok.convert_ids_to_tokens(mask_id) == "<|mask|>" and tok.mask_token_id == mask_id
    assert m.model.get_input_embeddings().weight.shape[0] == mask_id + 1 == len(tok)
    assert m.model.get_output_embeddings().weight.shape[0] == mask_id + 1


def test_multi_key_samples_read_back_their_values():
    cfg = MultiKeyConfig(symbols=40, keys_per_question=3, value_tokens=2, block_size=8, context_tokens=96)
    vocab = Vocabulary(cfg)
    s = make_sample(cfg, vocab, 96, random.Random(0))
    assert len(s["prompt"]) <= 96 and s["n_answer"] == 6 and len(s["answer"]) == 8
    assert s["answer"][6:] == [vocab.eos, vocab.eos]
    p = s["prompt"]
    records = {p[i]: p[i + 2:i + 4] for i in range(1, len(p) - 4) if p[i + 1] == vocab.colon[0]}
    asked = p[p.index(vocab.question[0]) + 1:-1]
    assert [t for k in asked for t in records[k]] == s["answer"][:6]
    batch = collate_multi_key([s, make_sample(cfg, vocab, 80, random.Random(1))], 8, vocab.pad, vocab.eos)
    assert batch["prompt_len"] % 8 == 0 and batch["input_ids"].shape[1] == batch["prompt_len"] + 8
    p = batch["prompt_len"]
    assert bool(batch["loss_mask"][:, p:].all()) and not bool(batch["loss_mask"][:, :p].any())
    dm = MultiKeyDataModule(cfg)
    assert dm.method_hints() == {"block_size": 8, "vocab_size": 48, "mask_token_id": MASK}
    with pytest.raises(ValueError, match="context length 20"):
        MultiKeyConfig(context_tokens=20)


def test_multi_key_further_questions_are_block_aligned_and_answer_their_own_keys():
    cfg = MultiKeyConfig(symbols=40, keys_per_question=3, value_tokens=2, block_size=8, context_tokens=96,
                         questions=3)
    vocab = Vocabulary(cfg)
    one = make_sample(cfg, vocab, 96, random.Random(5))
    s = make_sample(cfg, vocab, 96, random.Random(5), questions=3)
    assert s["prompt"] == one["prompt"] and s["answer"] == one["answer"]  # the first question is the eval form
    p = s["prompt"]
    records = {p[i]: p[i + 2:i + 4] for i in range(1, len(p) - 4) if p[i + 1] == vocab.colon[0]}
    asked = [p[p.index(vocab.question[0]) + 1:-1]] + [q[1:-1] for q, _ in s["extra"]]
    assert len(s["extra"]) == 2 and len({k for ks in asked for k in ks}) == 9  # distinct keys while they last
    for keys, (_, answer) in zip(asked[1:], s["extra"]):
        assert answer[:6] == [t for k in keys for t in records[k]] and answer[6:] == [vocab.eos, vocab.eos]
    other = make_sample(cfg, vocab, 80, random.Random(6), questions=3)
    batch = collate_multi_key([s, other], 8, vocab.pad, vocab.eos)
    ids, attn, loss = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    pl, a = batch["prompt_len"], batch["answer_len"]
    assert ids.shape[1] == pl + a + 2 * (8 + a)  # a 5-token question padded in front to one block, then 8
    for row, sample in enumerate([s, other]):
        scored = loss[row].nonzero().flatten().tolist()
        assert len(scored) == 3 * a and all(c % 8 == 0 for c in scored[::a])  # answers start on blocks
        assert ids[row, scored].tolist() == sample["answer"] + sample["extra"][0][1] + sample["extra"][1][1]
        for j, (q, _) in enumerate(sample["extra"], start=1):
            start = scored[j * a] - len(q)  # the question ends where its answer starts
            assert ids[row, start:start + len(q)].tolist() == q and bool(attn[row, start:start + len(q)].all())
            assert not bool(attn[row, start - (8 - len(q)):start].any())  # the padding in front is masked
    with pytest.raises(ValueError, match="as many questions"):
        collate_multi_key([s, one], 8, vocab.pad, vocab.eos)
    with pytest.raises(ValueError, match="questions=0"):
        MultiKeyConfig(questions=0)


def test_multi_question_batches_train_every_answer_block():
    from lightning_modules.bdlm.module import noise_blocks

    cfg = MultiKeyConfig(symbols=40, keys_per_question=2, value_tokens=2, block_size=4, context_tokens=48,
                         questions=2, batch_size=2, train_batches=1)
    dm = MultiKeyDataModule(cfg)
    batch = next(iter(dm.train_dataloader()))
    nz = noise_blocks(batch["input_ids"], batch["loss_mask"], 4, MASK, 0.999)
    answer_blocks = sorted({c // 4 for c in batch["loss_mask"][0].nonzero().flatten().tolist()})
    assert nz["blocks"].tolist() == answer_blocks and len(answer_blocks) == 2
    assert dm.split("val")[0].get("extra") is None  # evaluation samples ask one question


def test_multi_key_text_form_uses_single_token_words():
    from lightning_modules.llm.model.loading import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    cfg = MultiKeyConfig(tokenizer="smollm2-135m", symbols=64, context_tokens=200)
    dm = MultiKeyDataModule(cfg, tokenizer=tok)
    s = dm.split("val")[0]
    text = tok.decode(s["prompt"])
    assert text.startswith("Records:") and "Give the values of" in text
    words = tok.decode(s["answer"][:s["n_answer"]]).split()
    assert len(words) == s["n_answer"] == 16
    assert dm.method_hints() == {"block_size": 16}


def test_bdlm_tiny_recipe_trains_and_evaluates(tmp_path):
    from recipes.api import build

    run = build("bdlm_tiny", [], ["tiny"])
    run.fit()
    metrics = run.test("last")
    assert {"test/exact_match", "test/token_acc", "test/loss", "test/exact_match_len96"} <= set(metrics)


def test_induction_head_scores_equal_a_loop_over_the_attention_maps():
    from bench.induction_heads import report, scores
    from lightning_modules.llm.model.loading import load_causal_lm

    model, _ = load_causal_lm("tiny-llama", attn_implementation="eager", with_tokenizer=False,
                              tiny={"num_hidden_layers": 2, "vocab_size": 64})
    rows = scores(model, 6, 2, seed=3, low=4)
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(4, 64, (2, 6), generator=gen)
    with torch.no_grad():
        att = model(input_ids=torch.cat([x, x], 1), output_attentions=True).attentions
    for layer, r in enumerate(rows):
        heads = att[layer].shape[1]
        ind = [sum(float(att[layer][b, h, 6 + i, i + 1]) for b in range(2) for i in range(1, 5)) / 8
               for h in range(heads)]
        prev = [sum(float(att[layer][b, h, t, t - 1]) for b in range(2) for t in range(1, 12)) / 22
                for h in range(heads)]
        assert abs(r["induction"] - max(ind)) < 1e-6 and r["induction_head"] == ind.index(max(ind))
        assert abs(r["previous"] - max(prev)) < 1e-6 and r["previous_head"] == prev.index(max(prev))
    assert "| 1 |" in report("tiny", rows, 6, 2)
