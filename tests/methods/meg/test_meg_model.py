"""MEG-XL: tokenizer, masking, criss-cross backbone, SigLIP, retrieval metric, pre-train -> fine-tune hand-off."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_modules.meg.model import BackboneConfig, CrissCrossBlock, MEGBackbone, block_time_mask, masking_plan
from lightning_modules.meg.module import (
    MEGXLConfig,
    MEGXLPretrainModule,
    MEGXLWordDecoder,
    RetrievalTopK,
    pool_spans,
    siglip_loss,
    word_targets,
)
from lightning_modules.meg.tokenizer import RVQTokenizer, kmeans

TINY = dict(d_model=16, n_layers=1, n_heads=2, levels=2, codes=8, code_dim=4, fourier_features=8, dropout=0.0)


def _signals(n=20, t=1200, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, t, generator=g).cumsum(-1) * 0.1
    return base - base.mean(-1, keepdim=True)


# ------------------------------------------------------------------------------------------ tokenizer
def test_tokenizer_shapes_and_reconstruction_improves_per_level():
    tok = RVQTokenizer(stride=12, levels=4, codes=16, dim=6).fit(_signals())
    x = _signals(seed=1)[:5]
    codes = tok.encode(x.unsqueeze(1))
    assert codes.shape == (5, 4, 100) and codes.dtype == torch.int64
    assert int(codes.max()) < 16
    errors = [float(((tok.decode(codes, levels=q) - x) ** 2).mean()) for q in range(1, 5)]
    assert all(a > b for a, b in zip(errors, errors[1:]))
    assert errors[-1] < 0.5 * float(x.var())


def test_tokenizer_codes_are_greedy_nearest_residuals():
    tok = RVQTokenizer(stride=8, levels=3, codes=5, dim=8).fit(_signals(t=800))
    x = _signals(n=2, t=80, seed=2)
    codes = tok.encode(x)
    frames = x.reshape(2, 10, 8).double()
    z = (frames - tok.mean.double()) @ tok.proj.double()
    for q in range(3):  # brute force: the nearest codeword of the residual, level by level
        book = tok.codebooks[q].double()
        for n in range(2):
            for t in range(10):
                d = [float(((z[n, t] - book[c]) ** 2).sum()) for c in range(5)]
                assert codes[n, q, t] == min(range(5), key=d.__getitem__)
        z = z - book[codes[:, q]]


def test_tokenizer_is_frozen_and_refuses_before_fit():
    tok = RVQTokenizer()
    with pytest.raises(RuntimeError, match="before fit"):
        tok.encode(torch.zeros(1, 24))
    tok.train()
    assert not tok.training and not list(tok.parameters())


def test_kmeans_recovers_separated_clusters():
    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    x = torch.cat([c + 0.1 * torch.randn(50, 2, generator=g) for c in centres])
    found = kmeans(x, 3, generator=g)
    dist = torch.cdist(centres.double(), found).min(1).values
    assert float(dist.max()) < 0.1


# ------------------------------------------------------------------------------------------ masking
@pytest.mark.parametrize("n_tokens,n_sub,mask_tokens,ratio", [(625, 50, 12, 0.4), (125, 10, 12, 0.4),
                                                               (20, 1, 8, 0.4), (63, 5, 4, 0.6)])
def test_block_mask_covers_exactly_the_configured_blocks(n_tokens, n_sub, mask_tokens, ratio):
    n_sub_, sub_len, mask_len, n_masked = masking_plan(n_tokens, n_sub, mask_tokens, ratio)
    g = torch.Generator().manual_seed(0)
    mask = block_time_mask(16, n_tokens, n_sub, mask_tokens, ratio, generator=g)
    assert mask.shape == (16, n_tokens)
    for row in mask:
        assert int(row.sum()) == n_masked * mask_len
        assert not row[n_sub_ * sub_len:].any()  # the tail is never masked
        hit = [s for s in range(n_sub_) if row[s * sub_len:(s + 1) * sub_len].any()]
        assert len(hit) == n_masked
        for s in hit:  # one contiguous block per chosen sub-segment
            idx = torch.nonzero(row[s * sub_len:(s + 1) * sub_len]).flatten()
            assert int(idx[-1] - idx[0]) + 1 == mask_len == len(idx)


def test_megxl_full_scale_masking_numbers():
    # MEG-XL at 150 s: 625 tokens, 50 sub-segments of 12 tokens, 20 masked blocks of 12 (last 25 never)
    assert masking_plan(625, 50, 12, 0.4) == (50, 12, 12, 20)
    cfg = MEGXLConfig()
    assert cfg.subsegments(7500) == 50 and cfg.mask_tokens == 12
    assert 306 * (7500 // cfg.stride) == 191_250  # tokens per 150-s sample with 306 channels


def test_pretraining_loss_is_the_masked_cross_entropy_of_real_channels():
    torch.manual_seed(0)
    m = MEGXLPretrainModule(TINY)
    m.tokenizer.fit(_signals(n=30, t=600))
    B, C, S = 2, 5, 600
    batch = {"meg": torch.randn(B, C, S), "sensor_xyzdir": torch.randn(B, C, 6),
             "sensor_types": torch.randint(0, 2, (B, C)), "sensor_mask": torch.tensor([[1, 1, 1, 1, 0]] * B).bool()}
    g = torch.Generator().manual_seed(7)
    loss, acc, mask = m.masked_loss(batch, generator=g)
    assert not mask[:, 4].any()  # padded channel never masked
    assert bool((mask[:, :4] == mask[:, :1]).all())  # the same time blocks on every real channel
    # brute force: full logits everywhere, then the masked, valid positions only
    codes = m.codes(batch["meg"])
    logits = m.code_head(m.features(batch, mask, codes)).view(B, C, -1, 2, 8)
    ce = F.cross_entropy(logits.permute(0, 4, 1, 2, 3), codes, reduction="none")  # [B, C, T', Q]
    expected = ce[mask].mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


# ------------------------------------------------------------------------------------------ backbone
def test_backbone_runs_a_150_s_context_at_tiny_width():
    torch.manual_seed(0)
    cfg = BackboneConfig(d_model=16, n_layers=1, n_heads=2, fourier_features=8, dropout=0.0)
    bb = MEGBackbone(cfg, code_features=8)
    T = 7500 // 12
    out = bb(torch.randn(1, 4, T, 2, 4), torch.randn(1, 4, 6), torch.zeros(1, 4, dtype=torch.long),
             torch.ones(1, 4, dtype=torch.bool))
    assert out.shape == (1, 4, 625, 16) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for name, p in bb.named_parameters() if name != "mask_token")


def test_criss_cross_block_matches_a_direct_computation():
    """Temporal half over time per channel (RoPE), spatial half over channels per time, in float64."""
    torch.manual_seed(0)
    cfg = BackboneConfig(d_model=8, n_layers=1, n_heads=2, fourier_features=4, dropout=0.0)
    block = CrissCrossBlock(cfg).double().eval()
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    h = block.norm1(x)

    def attend(mod, seq, rope):
        N, L, w = seq.shape
        q, k, v = mod.qkv(seq).view(N, L, 3, w).unbind(2)
        if rope:
            pos = torch.arange(L, dtype=torch.float64)
            inv = 1.0 / (10000.0 ** (torch.arange(0, w, 2, dtype=torch.float64) / w))
            ang = torch.cat([torch.outer(pos, inv)] * 2, -1)

            def rot(t):
                t1, t2 = t[..., : w // 2], t[..., w // 2:]
                return t * ang.cos() + torch.cat([-t2, t1], -1) * ang.sin()
            q, k = rot(q), rot(k)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(w), -1)
        return mod.out(att @ v)

    t = torch.stack([attend(block.temporal, h[b, :, :, :4], True) for b in range(2)])
    s = torch.stack([attend(block.spatial, h[b, :, :, 4:].transpose(0, 1), False).transpose(0, 1) for b in range(2)])
    mid = x + torch.cat([t, s], -1)
    expected = mid + block.ffn(block.norm2(mid))
    torch.testing.assert_close(block(x), expected, atol=1e-10, rtol=1e-10)


def test_padded_channels_leak_into_spatial_attention_only_without_the_mask():
    torch.manual_seed(0)
    x = torch.randn(1, 4, 6, 16)
    mask = torch.tensor([[True, True, True, False]])
    changed = x.clone()
    changed[:, 3] += 5.0
    for flag, leaks in ((False, True), (True, False)):
        cfg = BackboneConfig(d_model=16, n_layers=1, n_heads=2, fourier_features=8, dropout=0.0,
                             mask_padded_channels=flag)
        torch.manual_seed(1)
        block = CrissCrossBlock(cfg).eval()
        with torch.no_grad():
            diff = (block(x, mask)[:, :3] - block(changed, mask)[:, :3]).abs().max()
        assert (float(diff) > 1e-4) == leaks


# ------------------------------------------------------------------------------------------ word decoding
def test_pool_spans_matches_a_loop():
    f = torch.randn(2, 3, 25, 4)
    spans = torch.tensor([[[0, 150], [150, 300]], [[12, 24], [290, 300]]])
    out = pool_spans(f, spans, stride=12)
    for b in range(2):
        for w in range(2):
            s, e = int(spans[b, w, 0]) // 12, min(25, math.ceil(int(spans[b, w, 1]) / 12))
            torch.testing.assert_close(out[b, w], f[b, :, s:e].mean(1))


def test_siglip_loss_equals_its_definition_in_float64():
    torch.manual_seed(0)
    pred, target = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    ids = torch.tensor([0, 1, 0, 2, 3, 1])
    t, b = torch.tensor(math.log(10.0), dtype=torch.float64), torch.tensor(-10.0, dtype=torch.float64)
    for reweigh in (False, True):
        total = 0.0
        for i in range(6):
            n_pos = sum(int(ids[i] == ids[j]) for j in range(6))
            for j in range(6):
                cos = float(F.cosine_similarity(pred[i], target[j], dim=0))
                z = math.exp(float(t)) * cos + float(b)
                y = float(ids[i] == ids[j])
                w = (1.0 / n_pos if reweigh else 1.0) if y else 1.0
                total += w * -(y * math.log(1 / (1 + math.exp(-z))) + (1 - y) * math.log(1 - 1 / (1 + math.exp(-z))))
        assert float(siglip_loss(pred, target, ids, t, b, reweigh)) == pytest.approx(total / 6, rel=1e-9)


@pytest.mark.parametrize("num_classes,k", [(12, 3), (50, 10), (7, 1), (4, 10)])
def test_retrieval_topk_against_brute_force(num_classes, k):
    """Per class and overall, over several updates, with labels outside the retrieval set ignored
    (``k >= num_classes`` makes every candidate a hit)."""
    gen = torch.Generator().manual_seed(num_classes * 100 + k)
    metric = RetrievalTopK(num_classes, k=k)
    hits = {c: [] for c in range(num_classes)}
    for n in (1, 17, 64):
        scores = torch.randn(n, num_classes, generator=gen)
        labels = torch.randint(-2, num_classes + 2, (n,), generator=gen)
        metric.update(scores, labels)
        for s, y in zip(scores, labels.tolist()):
            if 0 <= y < num_classes:
                hits[y].append(y in s.topk(min(k, num_classes)).indices.tolist())
    per_hits, per_counts = metric.per_class()
    assert per_hits.tolist() == [float(sum(v)) for v in hits.values()]
    assert per_counts.tolist() == [float(len(v)) for v in hits.values()]
    out = metric.compute()
    assert float(out["acc"]) == pytest.approx(sum(sum(v) for v in hits.values()) / sum(len(v) for v in hits.values()))
    per = [sum(v) / len(v) for v in hits.values() if v]
    assert float(out["balanced"]) == pytest.approx(sum(per) / len(per))
    assert (float(out["acc"]) == 1.0) == (k >= num_classes)


def test_word_targets_depend_on_the_word_not_the_order():
    a = word_targets(["baku", "dela", "fimo"], 8, seed=0)
    b = word_targets(["fimo", "baku"], 8, seed=0)
    torch.testing.assert_close(a[0], b[1])
    torch.testing.assert_close(a[2], b[0])
    assert torch.allclose(a.norm(dim=-1), torch.ones(3))
    assert not torch.allclose(a[0], word_targets(["baku"], 8, seed=1)[0])



def test_onehot_targets_are_orthogonal_axes_and_need_the_dimensions():
    t = word_targets(["baku", "dela", "fimo"], 5, path="onehot")
    assert t.shape == (3, 5)
    torch.testing.assert_close(t @ t.T, torch.eye(3))  # unit rows, every pair orthogonal
    assert t.argmax(dim=-1).tolist() == [0, 1, 2]  # word i of the vocabulary is axis i
    with pytest.raises(ValueError, match="3 words need target_dim >= 3"):
        word_targets(["baku", "dela", "fimo"], 2, path="onehot")
    with pytest.raises(ValueError, match="onehot"):
        MEGXLWordDecoder({**TINY, "targets": "glove"})


def test_a_linear_head_maps_pooled_features_to_targets_and_reloads_from_its_checkpoint():
    torch.manual_seed(0)
    dec = MEGXLWordDecoder({**TINY, "n_channels": 3, "head_hidden": 0, "target_dim": 4, "pool_chunks": 2})
    linears = [m for m in dec.word_head if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 1 and linears[0].weight.shape == (4, 2 * 3 * TINY["d_model"])
    fresh = MEGXLWordDecoder({**TINY, "head_hidden": 0, "target_dim": 4, "pool_chunks": 2})
    assert fresh.word_head is None
    fresh.on_load_checkpoint({"state_dict": dec.state_dict()})  # the head's width comes from the checkpoint
    assert fresh.n_channels == 3
    fresh.load_state_dict(dec.state_dict())
    torch.testing.assert_close(fresh.word_head[1].weight, dec.word_head[1].weight)
    with pytest.raises(ValueError, match="head_hidden >= 0"):
        MEGXLWordDecoder({**TINY, "head_hidden": -1})

def test_a_channel_mean_head_reads_the_mean_of_the_real_channels_only():
    """channel_pool=mean: the head's input is each pooled part's mean over the real channels (a loop by hand),
    its width has no channel count, and any sensor count fits one head."""
    torch.manual_seed(0)
    dec = MEGXLWordDecoder({**TINY, "channel_pool": "mean", "n_channels": 4, "head_hidden": 0, "target_dim": 4,
                            "pool_chunks": 2}).eval()
    assert dec.word_head[1].weight.shape == (4, 2 * TINY["d_model"])
    dec.tokenizer.fit(_signals(n=10, t=600))
    batch = _batch(B=2, C=4, S=600, seed=1, padded=1)
    batch["word_spans"] = torch.tensor([[[0, 150], [150, 420]], [[60, 300], [300, 600]]])
    with torch.no_grad():
        out = dec(batch)
        feats = pool_spans(dec.features(batch), batch["word_spans"], dec.cfg.stride, 2)  # [B, W, 2, C, d]
        for b in range(2):
            for w in range(2):
                real = feats[b, w][:, batch["sensor_mask"][b]]  # [2, C_real, d]
                torch.testing.assert_close(out[b, w], dec.word_head(real.mean(1).flatten()))
        assert not torch.allclose(out[0, 0], dec.word_head(feats[0, 0].mean(1).flatten()))  # padded one left out
    dec._adopt_vocab(type("DM", (), {"vocab": ["a", "b"], "n_channels": 7})())  # another sensor count: same head
    fresh = MEGXLWordDecoder({**TINY, "channel_pool": "mean", "head_hidden": 0, "target_dim": 4, "pool_chunks": 2})
    fresh.on_load_checkpoint({"state_dict": dec.state_dict()})
    fresh.load_state_dict(dec.state_dict())
    with pytest.raises(ValueError, match="channel_pool"):
        MEGXLWordDecoder({**TINY, "channel_pool": "max"})


def test_init_from_carries_tokenizer_and_backbone_only(tmp_path):
    from lightning_modules.io import load_weights

    torch.manual_seed(0)
    pre = MEGXLPretrainModule(TINY)
    pre.tokenizer.fit(_signals(n=10, t=600))
    path = tmp_path / "pre.ckpt"
    torch.save({"state_dict": pre.state_dict()}, path)
    torch.manual_seed(1)
    dec = MEGXLWordDecoder({**TINY, "n_channels": 3, "head_hidden": 8, "target_dim": 4})
    head_before = dec.word_head[0].weight.clone()
    load_weights(dec, path, strict=True, prefixes=dec.init_prefixes)
    for k, v in pre.state_dict().items():
        if k.startswith(("tokenizer.", "backbone.")):
            torch.testing.assert_close(dec.state_dict()[k], v)
    assert bool(dec.tokenizer.fitted)
    torch.testing.assert_close(dec.word_head[0].weight, head_before)  # the head stays fresh


# ------------------------------------------------------------------------------------------ per-level report (issue 23)
from lightning_modules.meg.module import code_counts, context_chunks, marginal_log_probs  # noqa: E402
from lightning_modules.meg.report import masked_code_summary  # noqa: E402


def _batch(B=2, C=5, S=600, seed=0, padded=1):
    g = torch.Generator().manual_seed(seed)
    sensor_mask = torch.ones(B, C, dtype=torch.bool)
    if padded:
        sensor_mask[:, C - padded:] = False
    return {"meg": torch.randn(B, C, S, generator=g), "sensor_xyzdir": torch.randn(B, C, 6, generator=g),
            "sensor_types": torch.randint(0, 2, (B, C), generator=g), "sensor_mask": sensor_mask}


def test_marginal_ce_equals_the_hand_computed_add_one_marginals():
    m = MEGXLPretrainModule({**TINY, "levels": 2, "codes": 3})
    m.code_counts.copy_(torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 2.0]]))
    target = torch.tensor([[0, 1], [2, 2]])  # two masked tokens, codes per level
    # level 0: p = (3+1, 1+1, 0+1) / (4+3) = 4/7, 2/7, 1/7; level 1: 1/7, 3/7, 3/7
    expected = torch.tensor([-(math.log(4 / 7) + math.log(1 / 7)) / 2, -(math.log(3 / 7) + math.log(3 / 7)) / 2])
    torch.testing.assert_close(m.marginal_ce(target), expected.float())
    torch.testing.assert_close(marginal_log_probs(m.code_counts).exp().sum(-1), torch.ones(2))


class _FakeMEGData:
    """``split("train")`` only: the marginals must never look at validation data."""

    def __init__(self, n=3, C=4, S=600):
        self.items = [{"meg": _signals(n=C, t=S, seed=10 + i), "sensor_mask": torch.tensor([True] * (C - 1) + [False])}
                      for i in range(n)]

    def split(self, name):
        if name != "train":
            raise AssertionError(f"the marginals read the {name} split")
        return self.items


def test_code_counts_are_the_training_codes_counted_at_tokenizer_fit_and_saved():
    m = MEGXLPretrainModule({**TINY, "tokenizer_fit_samples": 3})
    dm = _FakeMEGData()
    m.prepare_from_datamodule(dm)
    assert bool(m.tokenizer.fitted) and m.counted
    brute = torch.zeros(2, 8)
    for item in dm.items:  # every real channel's every token, level by level
        codes = m.tokenizer.encode(item["meg"][item["sensor_mask"]])  # [C', Q, T']
        for c in range(codes.shape[0]):
            for q in range(2):
                for t in range(codes.shape[2]):
                    brute[q, codes[c, q, t]] += 1
    torch.testing.assert_close(m.code_counts.float(), brute)
    assert float(m.code_counts.sum()) == 2 * 3 * 3 * (600 // 12)
    torch.testing.assert_close(code_counts(torch.tensor([[[0, 2, 2]], [[1, 2, 0]]]), 3).float(),
                               torch.tensor([[2.0, 1.0, 3.0]]))
    # the counts are a buffer: they travel in the state dict, and a checkpoint from before them still loads
    fresh = MEGXLPretrainModule({**TINY, "tokenizer_fit_samples": 3})
    fresh.load_state_dict(m.state_dict())
    torch.testing.assert_close(fresh.code_counts, m.code_counts)
    old = {"state_dict": {k: v for k, v in m.state_dict().items() if k != "code_counts"}}
    fresh.on_load_checkpoint(old)
    fresh.load_state_dict(old["state_dict"])
    assert not fresh.counted


def test_per_level_losses_are_the_masked_cross_entropy_of_each_level():
    torch.manual_seed(0)
    m = MEGXLPretrainModule(TINY).eval()
    m.tokenizer.fit(_signals(n=30, t=600))
    batch = _batch()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        codes, mask, logits, target = m.masked_forward(batch, generator=torch.Generator().manual_seed(3))
        level = m.level_ce(logits, target)
        full = m.code_head(m.features(batch, mask, codes)).view(*codes.shape[:3], 2, 8)
    for q in range(2):
        expected = F.cross_entropy(full[..., q, :][mask], codes[..., q][mask])
        assert float(level[q]) == pytest.approx(float(expected), rel=1e-5)
    loss, _, _ = m.masked_loss(batch, generator=g)
    assert float(loss.detach()) == pytest.approx(float(level.mean()), rel=1e-6)


def test_masked_code_summary_prints_both_numbers_and_the_levels():
    metrics = {"val/loss": 4.05, "val/marginal_ce": 4.10, "val/loss_l0": 3.9, "val/loss_l1": 4.2,
               "val/marginal_ce_l0": 4.0, "val/marginal_ce_l1": 4.2, "val/loss_short": 4.08}
    line = masked_code_summary(metrics, "val", 2, "pre-training", short_s=5.76)
    assert "masked-code CE 4.0500 nats vs 4.1000 for the training code marginals (0.0500 below)" in line
    assert "l0 3.9000 vs 4.0000 (+0.1000)" in line and "l1 4.2000 vs 4.2000 (+0.0000)" in line
    assert "4.0800 on 5.76-s chunks" in line and "0.0300 nats better" in line
    assert "(0.0500 above)" in masked_code_summary({**metrics, "val/loss": 4.15}, "val", 2)
    assert masked_code_summary({}, "val", 2) is None


# ------------------------------------------------------------------------------------------ context ablation (issue 23)
@pytest.mark.parametrize("n_tokens,n_sub,k", [(625, 50, 2), (625, 50, 1), (625, 50, 3), (125, 10, 4), (20, 1, 2),
                                              (63, 5, 50)])
def test_context_chunks_cover_each_maskable_token_once_and_never_cut_a_block(n_tokens, n_sub, k):
    chunks = context_chunks(n_tokens, n_sub, k, mask_tokens=12, mask_ratio=0.4)
    n_sub_, sub_len, _, _ = masking_plan(n_tokens, n_sub, 12, 0.4)
    covered = torch.zeros(n_tokens, dtype=torch.long)
    for s, e in chunks:
        covered[s:e] += 1
        assert s % sub_len == 0 and (e % sub_len == 0) and e - s <= k * sub_len  # on sub-segment boundaries
    assert covered[: n_sub_ * sub_len].eq(1).all() and covered[n_sub_ * sub_len:].eq(0).all()
    # masked blocks lie inside sub-segments (test_block_mask_covers_exactly_the_configured_blocks), and each
    # sub-segment lies inside one chunk: no block is cut
    for j in range(n_sub_):
        assert sum(s <= j * sub_len and (j + 1) * sub_len <= e for s, e in chunks) == 1
    mask = block_time_mask(32, n_tokens, n_sub, 12, 0.4, generator=torch.Generator().manual_seed(0))
    assert not mask[:, n_sub_ * sub_len:].any()  # what the chunks leave out is never masked


def test_short_context_chunk_size_rule_and_errors():
    assert MEGXLConfig(eval_short_context_s=5.0).short_context_subsegments == 2  # 6 s of 3-s sub-segments
    assert MEGXLConfig(eval_short_context_s=4.4).short_context_subsegments == 1
    assert MEGXLConfig(eval_short_context_s=4.5).short_context_subsegments == 2
    assert MEGXLConfig(eval_short_context_s=0.5).short_context_subsegments == 1
    assert MEGXLConfig().short_context_subsegments is None  # the method default: off
    with pytest.raises(ValueError, match="eval_short_context_s=0.0: must be > 0"):
        MEGXLConfig(eval_short_context_s=0.0)
    m = MEGXLPretrainModule({**TINY, "eval_short_context_s": 5.0})
    assert m.short_context_seconds(7500) == pytest.approx(2 * 12 * 12 / 50)  # 5.76 s at 50 Hz, stride 12


class _LocalBackbone(torch.nn.Module):
    """Each token's features from its own content (the mask token where masked) and its sensor only."""

    def __init__(self, bb):
        super().__init__()
        self.bb = bb

    def forward(self, code_vectors, xyzdir, types, sensor_mask, token_mask=None):
        content = self.bb.content(code_vectors.flatten(-2))
        if token_mask is not None:
            content = torch.where(token_mask.unsqueeze(-1), self.bb.mask_token, content)
        return self.bb.norm(torch.tanh(content + self.bb.sensors(xyzdir, types).unsqueeze(2)))


def test_short_context_loss_equals_the_full_one_for_a_local_model_and_restricts_the_real_one():
    torch.manual_seed(0)
    m = MEGXLPretrainModule({**TINY, "eval_short_context_s": 5.0}).eval()
    m.tokenizer.fit(_signals(n=30, t=3000))
    batch = _batch(S=3000)  # 60 s: 250 tokens, 20 sub-segments of 12, chunks of 24 (the tail of 10 never masked)
    chunks = m.short_context_chunks(3000, 250)
    assert chunks[0] == (0, 24) and chunks[-1] == (216, 240) and len(chunks) == 10
    with torch.no_grad():
        codes, mask, logits, target = m.masked_forward(batch, generator=torch.Generator().manual_seed(1))
        short = m.short_context_logits(batch, codes, mask, chunks)
        assert short.shape == logits.shape
        # the real backbone: the same as running it on each chunk by hand, and not the same as the full window
        vectors = m.tokenizer.embed(codes)
        h = torch.zeros(*codes.shape[:3], 16)
        for s, e in chunks:
            h[:, :, s:e] = m.backbone(vectors[:, :, s:e], batch["sensor_xyzdir"], batch["sensor_types"],
                                      batch["sensor_mask"], mask[:, :, s:e])
        torch.testing.assert_close(short, m.code_head(h[mask]).view(-1, 2, 8), atol=1e-5, rtol=1e-5)
        assert float((short - logits).abs().max()) > 1e-3
        # a model that only looks at each token itself: both losses agree exactly
        m.backbone = _LocalBackbone(m.backbone)
        _, _, logits_local, _ = m.masked_forward(batch, generator=torch.Generator().manual_seed(1))
        short_local = m.short_context_logits(batch, codes, mask, chunks)
        torch.testing.assert_close(short_local, logits_local, atol=1e-6, rtol=1e-6)
        assert float(m.level_ce(short_local, target).mean()) == pytest.approx(
            float(m.level_ce(logits_local, target).mean()), abs=1e-6)


def test_masked_ce_scores_every_window_on_validation_masks_with_full_or_chunked_context():
    """Against a hand loop: each window masked as validation batch i is (stable seed), cross-entropies weighted by
    masked tokens; with context_s the backbone sees 2-sub-segment chunks (the context ablation's logits); a second
    model with the same masking scores exactly the same tokens (what makes long and short models comparable)."""
    from litctx_common.seeding import stable_seed

    torch.manual_seed(0)
    m = MEGXLPretrainModule(TINY)
    m.tokenizer.fit(_signals(n=30, t=3000))
    batches = [_batch(B=1, S=3000, seed=s) for s in range(3)]
    windows = [{k: v[0] for k, v in b.items()} for b in batches]
    full, short = m.masked_ce(windows), m.masked_ce(windows, context_s=5.0)
    want_full = want_short = 0.0
    n = 0
    with torch.no_grad():
        for i, b in enumerate(batches):
            codes, mask, logits, target = m.masked_forward(
                b, generator=torch.Generator().manual_seed(stable_seed("meg-eval-mask", "val", i)))
            chunked = m.short_context_logits(b, codes, mask, context_chunks(250, 20, 2, m.cfg.mask_tokens, 0.4))
            want_full += float(m.level_ce(logits, target).mean()) * len(target)
            want_short += float(m.level_ce(chunked, target).mean()) * len(target)
            n += len(target)
    assert full["tokens"] == short["tokens"] == n
    assert full["ce"] == pytest.approx(want_full / n, rel=1e-6)
    assert short["ce"] == pytest.approx(want_short / n, rel=1e-6)
    assert abs(full["ce"] - short["ce"]) > 1e-4 and math.isnan(full["marginal"])  # no counts yet
    torch.manual_seed(1)
    other = MEGXLPretrainModule(TINY)
    other.tokenizer.load_state_dict(m.tokenizer.state_dict())
    assert other.masked_ce(windows)["tokens"] == n


def test_seen_tokens_drops_the_masked_tokens_of_chunks_with_nothing_visible():
    """Brute force per token: a masked token is kept unless every token of its chunk (same sample and channel) is
    masked; the order is codes[mask]'s."""
    from lightning_modules.meg.module import seen_tokens

    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 3, 20, generator=g) < 0.6
    mask[0, 1, 4:8] = True  # one chunk certainly blind
    chunks = [(0, 4), (4, 8), (8, 12), (12, 16)]  # tokens 16-19 in no chunk: kept
    keep = seen_tokens(mask, chunks)
    want = []
    for b in range(2):
        for c in range(3):
            for t in range(20):
                if mask[b, c, t]:
                    chunk = next(((a, e) for a, e in chunks if a <= t < e), None)
                    want.append(chunk is None or not bool(mask[b, c, chunk[0]:chunk[1]].all()))
    assert keep.tolist() == want and not all(want) and any(want)


def test_masked_ce_seen_within_scores_the_same_reduced_tokens_for_any_context():
    from litctx_common.seeding import stable_seed
    from lightning_modules.meg.module import seen_tokens

    torch.manual_seed(0)
    m = MEGXLPretrainModule(TINY)
    m.tokenizer.fit(_signals(n=30, t=3000))
    batches = [_batch(B=1, S=3000, seed=s) for s in range(3)]
    windows = [{k: v[0] for k, v in b.items()} for b in batches]
    full = m.masked_ce(windows, seen_within_s=5.0)
    short = m.masked_ce(windows, context_s=5.0, seen_within_s=5.0)
    want, n, all_tokens = 0.0, 0, 0
    with torch.no_grad():
        for i, b in enumerate(batches):
            codes, mask, logits, target = m.masked_forward(
                b, generator=torch.Generator().manual_seed(stable_seed("meg-eval-mask", "val", i)))
            keep = seen_tokens(mask, context_chunks(250, 20, 2, m.cfg.mask_tokens, 0.4))
            want += float(m.level_ce(logits[keep], target[keep]).mean()) * int(keep.sum())
            n += int(keep.sum())
            all_tokens += len(target)
    assert full["tokens"] == short["tokens"] == n and 0 < n < all_tokens == m.masked_ce(windows)["tokens"]
    assert full["ce"] == pytest.approx(want / n, rel=1e-6)

def test_pretraining_init_from_also_carries_the_code_counts(tmp_path):
    from lightning_modules.io import load_weights

    torch.manual_seed(0)
    pre = MEGXLPretrainModule(TINY)
    pre.tokenizer.fit(_signals(n=10, t=600))
    pre.count_codes(_signals(n=10, t=600))
    path = tmp_path / "init.pt"
    torch.save(pre.state_dict(), path)
    torch.manual_seed(1)
    again = MEGXLPretrainModule(TINY)
    head_before = again.code_head.weight.clone()
    load_weights(again, path, strict=True, prefixes=again.init_prefixes)
    torch.testing.assert_close(again.code_counts, pre.code_counts)
    assert again.counted and bool(again.tokenizer.fitted)
    torch.testing.assert_close(again.code_head.weight, head_before)


def test_word_hits_are_the_top_k_metric_word_by_word():
    """word_hits' mean over a set of samples equals RetrievalTopK's accuracy on the same predictions, words outside
    the retrieval set are left out of both, and each hit is the label among the k best cosine scores (by hand)."""
    torch.manual_seed(0)
    dec = MEGXLWordDecoder({**TINY, "n_channels": 5, "head_hidden": 8, "target_dim": 6, "retrieval_size": 12,
                            "top_k": 3, "pool_chunks": 1, "head_norm": "none"}).eval()
    dec.tokenizer.fit(_signals(n=10, t=600))
    dec.set_vocab([f"w{i}" for i in range(14)])  # 14 words, 12 in the retrieval set
    g = torch.Generator().manual_seed(3)
    samples = []
    for s in range(3):
        item = {k: v[0] for k, v in _batch(B=1, C=5, S=600, seed=s, padded=0).items()}
        item["word_spans"] = torch.tensor([[k * 100, (k + 1) * 100] for k in range(6)])
        item["word_ids"] = torch.randint(0, 14, (6,), generator=g)
        samples.append(item)
    hits, ids = dec.word_hits(samples)
    metric = RetrievalTopK(12, 3)
    manual = []
    with torch.no_grad():
        for item in samples:
            pred = dec({k: v.unsqueeze(0) for k, v in item.items()}).flatten(0, 1)
            metric.update(dec.retrieval_scores(pred), item["word_ids"])
            cos = F.normalize(pred, dim=-1) @ F.normalize(dec.targets[:12], dim=-1).T * dec.targets[:12].norm(dim=-1)
            for row, w in zip(cos, item["word_ids"].tolist()):
                if w < 12:
                    manual.append(int((row > row[w]).sum()) < 3)
    assert len(hits) == len(ids) == len(manual) == int((torch.cat([s["word_ids"] for s in samples]) < 12).sum())
    assert hits.tolist() == manual
    assert float(hits.mean()) == pytest.approx(float(metric.compute()["acc"]))
