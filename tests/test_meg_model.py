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
