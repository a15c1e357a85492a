"""The chunked torch references against SDPA and float64 brute force; gradcheck; mask properties."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from litctx_kernels import BlockLayout, QueryIndex, TokenIndex, merge_lse, merge_lse_many
from litctx_kernels.layouts import causal_block_mask
from litctx_kernels.reference import (
    attention_colstats_reference,
    attention_reference,
    gather_attention_reference,
    lowbit_block_estimate_reference,
    lowbit_scores_reference,
    quantize_lowbit,
    quantize_qk_lowbit,
)
from litctx_kernels.testing import assert_close
from tests.kernels._brute import brute_attention, brute_mask, row_lengths


def qkv(b=2, hq=4, hk=2, nq=40, nk=None, d=16, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    nk = nq if nk is None else nk
    q = torch.randn(b, hq, nq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hk, nk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hk, nk, d, generator=g, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def random_layout(nq, nk, bq, bk, b, h, density, seed=0, causal=True, q_offset=None, window=None):
    g = torch.Generator().manual_seed(seed)
    mq, mk = math.ceil(nq / bq), math.ceil(nk / bk)
    m = torch.rand(b, h, mq, mk, generator=g) < density
    if causal:
        m &= causal_block_mask(nq, nk, bq, bk, q_offset=q_offset, window=window)
    return BlockLayout.from_block_mask(m, bq, bk, (nq, nk))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_sdpa(causal, dtype):
    q, k, v = qkv(b=2, hq=4, hk=4, nq=100, d=32, dtype=dtype)
    o, lse = attention_reference(q, k, v, causal=causal, chunk=17)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert_close(o, ref, ratio=1e-6 if dtype == torch.float32 else 1e-12)


def test_matches_sdpa_gqa_and_window_mask():
    q, k, v = qkv(b=1, hq=4, hk=2, nq=64, d=16)
    w = 10
    i, j = torch.arange(64).view(-1, 1), torch.arange(64).view(1, -1)
    mask = (j <= i) & (j > i - w)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    o, _ = attention_reference(q, k, v, window=w, chunk=9)
    assert_close(o, ref, ratio=1e-12)


@pytest.mark.parametrize("nq,nk,off", [(24, 60, None), (24, 60, 5), (60, 24, None), (33, 33, -4)])
def test_bottom_right_alignment_and_offsets(nq, nk, off):
    q, k, v = qkv(nq=nq, nk=nk)
    o, lse = attention_reference(q, k, v, q_offset=off, chunk=7)
    bo, blse, _ = brute_attention(q, k, v, brute_mask(nq, nk, q_offset=off))
    assert_close(o, bo, ratio=1e-12)
    fin = torch.isfinite(blse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert_close(lse[fin], blse[fin], ratio=1e-12)
    # rows that see no key: O = 0 and LSE = -inf
    assert (o[~fin.unsqueeze(-1).expand_as(o)] == 0).all()
    assert torch.isneginf(lse[~fin]).all()


@pytest.mark.parametrize("bq,bk", [(16, 16), (16, 8), (8, 32)])
def test_block_layout_matches_brute_force(bq, bk):
    nq = nk = 70
    q, k, v = qkv(nq=nq)
    lay = random_layout(nq, nk, bq, bk, 2, 4, 0.5, seed=3)
    o, lse = attention_reference(q, k, v, layout=lay, chunk=13)
    valid = brute_mask(nq, nk, block_mask=lay.to_block_mask(), block_q=bq, block_k=bk)
    bo, blse, _ = brute_attention(q, k, v, valid)
    assert_close(o, bo, ratio=1e-12)
    fin = torch.isfinite(blse)
    assert torch.equal(torch.isfinite(lse), fin)


def test_full_layout_equals_dense_and_big_window_equals_causal():
    q, k, v = qkv(nq=50)
    dense, _ = attention_reference(q, k, v)
    o1, _ = attention_reference(q, k, v, layout=BlockLayout.causal(50, 50, 16))
    o2, _ = attention_reference(q, k, v, window=50)
    o3, _ = attention_reference(q, k, v, window=1000)
    nc, _ = attention_reference(q, k, v, causal=False)
    o4, _ = attention_reference(q, k, v, causal=False, layout=BlockLayout.full(50, 50, 16))
    for o in (o1, o2, o3):
        assert_close(o, dense, ratio=1e-14)
    assert_close(o4, nc, ratio=1e-14)


def test_query_subset_all_routed_equals_dense_and_subset_rows_match():
    q, k, v = qkv(nq=45)
    dense, dlse = attention_reference(q, k, v)
    qi = QueryIndex.all(2, 4, 45)
    o, lse = attention_reference(q, k, v, q_index=qi)
    assert_close(o, dense, ratio=1e-14)
    g = torch.Generator().manual_seed(1)
    route = torch.rand(2, 4, 45, generator=g) < 0.3
    route[0, 0] = False  # a head with nothing routed
    qi = QueryIndex.from_mask(route)
    o, lse = attention_reference(q, k, v, q_index=qi)
    assert tuple(o.shape) == (2, 4, qi.idx.shape[-1], 16)
    assert_close(qi.scatter(o), dense * route.unsqueeze(-1), ratio=1e-12)
    pad = qi.idx < 0
    assert (o[pad] == 0).all() and torch.isneginf(lse[pad]).all()


def test_query_subset_with_layout():
    q, k, v = qkv(nq=64)
    lay = random_layout(64, 64, 16, 16, 2, 4, 0.6, seed=5)
    route = torch.rand(2, 4, 64, generator=torch.Generator().manual_seed(2)) < 0.5
    qi = QueryIndex.from_mask(route)
    full, _ = attention_reference(q, k, v, layout=lay)
    o, _ = attention_reference(q, k, v, layout=lay, q_index=qi)
    assert_close(qi.scatter(o), full * route.unsqueeze(-1), ratio=1e-12)


def test_empty_rows_give_zero_and_neg_inf():
    q, k, v = qkv(nq=32)
    m = causal_block_mask(32, 32, 8, 8)[None, None].expand(2, 4, -1, -1).clone()
    m[:, :, 2] = False  # query block 2 visits nothing
    lay = BlockLayout.from_block_mask(m, 8, 8, (32, 32))
    o, lse = attention_reference(q, k, v, layout=lay)
    assert (o[:, :, 16:24] == 0).all() and torch.isneginf(lse[:, :, 16:24]).all()
    assert torch.isfinite(lse[:, :, :16]).all() and torch.isfinite(lse[:, :, 24:]).all()


@pytest.mark.parametrize("causal,window", [(True, None), (True, 12), (False, None)])
def test_lssa_matches_definition(causal, window):
    nq = 40
    q, k, v = qkv(nq=nq)
    o, lse = attention_reference(q, k, v, causal=causal, window=window, score_mode="lssa", chunk=11)
    n_i, pos = row_lengths(nq, nq, causal=causal, window=window)
    bo, blse, _ = brute_attention(q, k, v, brute_mask(nq, nq, causal=causal, window=window), mode="lssa", n_i=n_i,
                                  pos=pos)
    assert_close(o, bo, ratio=1e-12)
    assert_close(lse, blse, ratio=1e-12)


def test_lssar_matches_definition_where_naive_is_finite():
    nq = 48
    q, k, v = qkv(nq=nq)
    for power in (1.0, 3.0, 15.0):
        o, _ = attention_reference(q, k, v, score_mode="lssar", lssar_power=power, chunk=10)
        n_i, pos = row_lengths(nq, nq)
        bo, _, _ = brute_attention(q, k, v, brute_mask(nq, nq), mode="lssar", n_i=n_i, pos=pos, power=power)
        assert_close(o, bo, ratio=1e-10)


def test_lssar_log_domain_stays_finite_where_naive_float32_overflows():
    n, d = 2048, 16
    g = torch.Generator().manual_seed(0)
    base = torch.randn(d, generator=g)
    q = base + 0.05 * torch.randn(1, 1, n, d, generator=g)
    k = -base + 0.05 * torch.randn(1, 1, n, d, generator=g)  # keys anti-aligned with every query ...
    k[..., ::1024, :] = base  # ... except a few aligned ones that take most of the weight (a sharp head)
    v = torch.randn(1, 1, n, d, generator=g)
    o, lse = attention_reference(q, k, v, score_mode="lssar", lssar_power=15.0, chunk=256)
    assert torch.isfinite(o).all()
    n_i, pos = row_lengths(n, n)
    rows = slice(n - 64, n)  # the naive form overflows float32 at long rows; compare the last rows in float64
    valid = brute_mask(n, n)[..., rows, :]
    bo64, _, _ = brute_attention(q[:, :, rows], k, v, valid, mode="lssar", n_i=n_i[rows], pos=pos[rows])
    o64, _ = attention_reference(q[:, :, rows].double(), k.double(), v.double(), score_mode="lssar",
                                 lssar_power=15.0, q_offset=n - 64)
    assert_close(o64, bo64, ratio=1e-10)
    # float32 keeps the log-domain form finite; its error is amplified by p / (N A - 1) near the threshold
    assert_close(o[:, :, rows], bo64, ratio=1e-3)
    bo32, _, _ = brute_attention(q[:, :, rows], k, v, valid, mode="lssar", n_i=n_i[rows], pos=pos[rows],
                                 dtype=torch.float32)
    assert not torch.isfinite(bo32).all(), "the naive float32 form was expected to overflow here"


@pytest.mark.parametrize("kw", [dict(), dict(window=5), dict(causal=False), dict(score_mode="lssa"),
                                dict(score_mode="lssar", lssar_power=3.0), dict(q_offset=3)])
def test_gradcheck(kw):
    q, k, v = qkv(b=1, hq=2, hk=1, nq=16, nk=19 if "q_offset" in kw else 16, d=8, grad=True)
    lay = None
    if kw.get("causal", True) and "q_offset" not in kw:
        lay = random_layout(16, 16, 4, 4, 1, 2, 0.8, seed=1)

    def f(q, k, v):
        o, lse = attention_reference(q, k, v, layout=lay, chunk=5, **kw)
        return o, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6)


def test_gradcheck_query_subset():
    q, k, v = qkv(b=1, hq=2, hk=2, nq=12, d=8, grad=True)
    qi = QueryIndex.from_mask(torch.rand(1, 2, 12, generator=torch.Generator().manual_seed(4)) < 0.5)
    assert torch.autograd.gradcheck(lambda q, k, v: attention_reference(q, k, v, q_index=qi)[0], (q, k, v))


def test_chunked_backward_matches_unchunked():
    q, k, v = qkv(nq=64, grad=True)
    o1, _ = attention_reference(q, k, v, chunk=7)
    g1 = torch.autograd.grad(o1.square().sum(), (q, k, v))
    o2, _ = attention_reference(q, k, v, chunk=1000)
    g2 = torch.autograd.grad(o2.square().sum(), (q, k, v))
    for a, b in zip(g1, g2):
        assert_close(a, b, ratio=1e-12)


def test_merge_lse_equals_attention_over_union_and_is_associative():
    q, k, v = qkv(nq=30, nk=60)
    full, flse = attention_reference(q, k, v, causal=False)
    parts = [attention_reference(q, k[:, :, s], v[:, :, s], causal=False) for s in
             (slice(0, 10), slice(10, 35), slice(35, 60))]
    o, lse = merge_lse_many(parts)
    assert_close(o, full, ratio=1e-12)
    assert_close(lse, flse, ratio=1e-12)
    a, b, c = parts
    left = merge_lse(*merge_lse(*a, *b), *c)
    right = merge_lse(*a, *merge_lse(*b, *c))
    assert_close(left[0], right[0], ratio=1e-13)
    assert_close(left[1], right[1], ratio=1e-13)
    empty = (torch.zeros_like(a[0]), torch.full_like(a[1], -math.inf))
    ident = merge_lse(*a, *empty)
    assert_close(ident[0], a[0], ratio=0) and assert_close(ident[1], a[1], ratio=0)
    both_empty = merge_lse(*empty, *empty)
    assert (both_empty[0] == 0).all() and torch.isneginf(both_empty[1]).all()


def test_gather_attention_matches_brute_force():
    q, k, v = qkv(nq=8, nk=50, hq=4, hk=2)
    keep = torch.rand(2, 2, 50, generator=torch.Generator().manual_seed(7)) < 0.4
    keep[0, 1] = False  # a kv head with an empty list
    ti = TokenIndex.from_mask(keep)
    o, lse = gather_attention_reference(q, k, v, ti)
    valid = brute_mask(8, 50) & keep.repeat_interleave(2, 1).unsqueeze(2)
    bo, blse, _ = brute_attention(q, k, v, valid)
    assert_close(o, bo, ratio=1e-12)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(blse))


@pytest.mark.parametrize("q_window,window", [(None, None), (7, None), (12, 9)])
def test_colstats_match_brute_force(q_window, window):
    nq, nk = 20, 33
    q, k, v = qkv(nq=nq, nk=nk, hq=4, hk=2)
    st = attention_colstats_reference(q, k, v, q_window=q_window, window=window, chunk=5)
    bo, _, p = brute_attention(q, k, v, brute_mask(nq, nk, window=window))
    w = nq if q_window is None else q_window
    p, bo = p[:, :, nq - w:], bo[:, :, nq - w:]
    assert_close(st.p_sum, p.sum(2), ratio=1e-12)
    assert_close(st.p2_sum, (p ** 2).sum(2), ratio=1e-12)
    assert_close(st.p2_o, torch.einsum("bhin,bhid->bhnd", p ** 2, bo), ratio=1e-12)
    assert_close(st.p2_o_norm2, torch.einsum("bhin,bhi->bhn", p ** 2, bo.square().sum(-1)), ratio=1e-12)


@pytest.mark.parametrize("q_window,q_offset", [(None, None), (9, None), (6, 4)])
def test_colstats_logit_moments_match_brute_force(q_window, q_offset):
    nq, nk = 20, 33
    q, k, v = qkv(nq=nq, nk=nk, hq=4, hk=2, seed=3)
    key_mask = torch.rand(2, 4, nk, generator=torch.Generator().manual_seed(1)) > 0.3
    key_mask[..., 0] = True
    st = attention_colstats_reference(q, k, v, q_window=q_window, q_offset=q_offset, chunk=4, moments="logit",
                                      key_mask=key_mask)
    valid = brute_mask(nq, nk, q_offset=q_offset) & key_mask.unsqueeze(-2)
    bo, _, p = brute_attention(q, k, v, valid)
    z = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    w = nq if q_window is None else q_window
    p, bo, z = p[:, :, nq - w:], bo[:, :, nq - w:], z[:, :, nq - w:]
    pz = p * z
    on = bo.square().sum(-1)
    expect = {
        "p_sum": p.sum(2), "p2_sum": (p ** 2).sum(2),
        "p2_o": torch.einsum("bhin,bhid->bhnd", p ** 2, bo), "p2_o_norm2": torch.einsum("bhin,bhi->bhn", p ** 2, on),
        "p2z_sum": (p * pz).sum(2), "p2z_o": torch.einsum("bhin,bhid->bhnd", p * pz, bo),
        "p2z2_sum": (pz ** 2).sum(2), "p2z2_o": torch.einsum("bhin,bhid->bhnd", pz ** 2, bo),
        "p2z2_o_norm2": torch.einsum("bhin,bhi->bhn", pz ** 2, on),
    }
    for name, value in expect.items():
        assert_close(getattr(st, name), value, ratio=1e-12, name=name)
    # fewer moments: the same values, the rest left out
    only = attention_colstats_reference(q, k, v, q_window=q_window, q_offset=q_offset, moments="attention",
                                        key_mask=key_mask)
    assert only.p2_o is None and only.p2z_sum is None
    assert torch.allclose(only.p_sum, st.p_sum, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="moments"):
        attention_colstats_reference(q, k, v, moments="everything")


@pytest.mark.parametrize("bits,group", [(4, 1), (4, 4), (8, 1)])
def test_quantizer_round_trip_bound(bits, group):
    x = torch.randn(2, 3, 37, 16, dtype=torch.float64)
    xq, sigma = quantize_lowbit(x, bits, group)
    qmax = 2 ** (bits - 1) - 1
    assert xq.dtype == torch.int8 and xq.abs().max() <= qmax
    err = (x - xq.double() * sigma.unsqueeze(-1)).abs()
    assert (err <= sigma.unsqueeze(-1) / 2 + 1e-12).all()
    # rows of a group share one scale
    if group > 1:
        assert torch.equal(sigma[..., 0], sigma[..., group - 1])


def test_smoothing_identity_and_lowbit_scores():
    q, k, _ = qkv(nq=30, nk=30, hq=4, hk=2)
    lb = quantize_qk_lowbit(q, k, bits=8)
    mu_q = q.mean(2, keepdim=True)
    khat = k - k.mean(2, keepdim=True)
    kr = khat.repeat_interleave(2, 1)
    exact = q @ kr.transpose(-1, -2)
    assert_close((q - mu_q) @ kr.transpose(-1, -2) + lb.bias.unsqueeze(-2), exact, ratio=1e-13)
    # the low-bit scores follow their definition exactly
    deq = (lb.q_int.double() @ lb.k_int.double().repeat_interleave(2, 1).transpose(-1, -2)) \
        * lb.q_scale.unsqueeze(-1) * lb.k_scale.repeat_interleave(2, 1).unsqueeze(-2) + lb.bias.unsqueeze(-2)
    assert_close(lowbit_scores_reference(lb), deq, ratio=1e-14)
    # and approximate the exact logits (8 bits: within a few percent)
    assert (lowbit_scores_reference(lb) - exact).abs().max() < 0.05 * exact.abs().max()


def test_lowbit_block_estimate_matches_brute_force_and_is_monotone():
    nq = nk = 96
    q, k, v = qkv(nq=nq, hq=2, hk=2, d=16)
    bq, bk = 16, 8
    sink_local = BlockLayout.causal(nq, nk, bq, bk, window=24)
    _, lse = attention_reference(q, k, v, layout=sink_local)
    scale = 1 / 4
    lb = quantize_qk_lowbit(q, k, bits=4)
    ras = scale * lowbit_scores_reference(lb) - lse.unsqueeze(-1)
    valid = brute_mask(nq, nk)
    densities = []
    for tau in (0.0, 1e-3, 1e-2, 1e-1):
        lay = lowbit_block_estimate_reference(q, k, lse, tau, scale=scale, block_q=bq, block_k=bk)
        hit = (ras >= math.log(tau) if tau > 0 else torch.ones_like(ras, dtype=torch.bool)) & valid
        expect = hit.view(2, 2, nq // bq, bq, nk // bk, bk).any(-1).any(-2)
        assert torch.equal(lay.to_block_mask(), expect)
        densities.append(lay.density())
    assert densities[0] == 1.0
    assert all(a >= b for a, b in zip(densities, densities[1:])) and densities[-1] < 1.0
