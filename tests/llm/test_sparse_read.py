"""The sparse-read kit (lightning_modules/llm/sparse_read/kit.py) against brute-force references."""

from __future__ import annotations

import math

import pytest
import torch

from litctx_kernels.testing import assert_close
from lightning_modules.llm.model.attention import dense_masked_attention
from lightning_modules.llm.sparse_read.kit import (
    attention_recovery,
    dense_read_bytes,
    gather_read_set,
    kv_read_bytes,
    page_bounds,
    page_scores,
    quest_read_set,
    sparse_read_attention,
)

pytestmark = pytest.mark.usefixtures("torch_seed")


# --- helpers --------------------------------------------------------------------------------------------------
def _qkv(b, hq, hk, n_old, n_new, d, dtype, dv=None):
    q = torch.randn(b, hq, n_new, d, dtype=dtype)
    k = torch.randn(b, hk, n_old + n_new, d, dtype=dtype)
    v = torch.randn(b, hk, n_old + n_new, dv or d, dtype=dtype)
    return q, k, v


def _ragged_read(b, hk, n_old, p=0.5):
    """Random read set with ragged counts, one empty (b, h) row and one full row."""
    read = torch.rand(b, hk, n_old) < p
    read[0, -1] = False
    if b * hk > 2:
        read[-1, 0] = True
    return read


def _full_mask(read, hq, n_old, n_new):
    """The equivalent dense boolean mask ``[B, Hq, n_new, N_old + n_new]``."""
    b, hk = read.shape[:2]
    read = read.expand(b, hk, n_old).repeat_interleave(hq // hk, dim=1)
    mask = torch.zeros(b, hq, n_new, n_old + n_new, dtype=torch.bool)
    mask[..., :n_old] = read.unsqueeze(2)
    mask[..., n_old:] = torch.ones(n_new, n_new, dtype=torch.bool).tril()
    return mask


def _brute_attention(q, k, v, mask, scale):
    """float64 masked softmax with its natural-log LSE."""
    g = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(g, 1)
    vv = v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ vv, s.logsumexp(-1)


# --- 2. fused attention vs the masked reference -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_new", [1, 5])
@pytest.mark.parametrize("hq,hk", [(4, 2), (9, 3)])
def test_sparse_read_attention_matches_masked_reference(hq, hk, n_new, dtype):
    b, n_old, d = 2, 37, 16
    q, k, v = _qkv(b, hq, hk, n_old, n_new, d, dtype)
    read = _ragged_read(b, hk, n_old)
    scale = 1.0 / math.sqrt(d)
    o, lse = sparse_read_attention(q, k, v, read, scale)
    assert o.shape == (b, hq, n_new, d) and lse.shape == (b, hq, n_new)
    mask = _full_mask(read, hq, n_old, n_new)
    ref = dense_masked_attention(q, k, v, mask, scale)  # computes in float32
    assert (o.double() - ref.double()).abs().max().item() < 1e-5
    o64, lse64 = _brute_attention(q, k, v, mask, scale)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert_close(o, o64, ratio=tol, atol=tol, name="o")
    assert_close(lse, lse64, ratio=tol, atol=tol, name="lse")
    assert torch.isfinite(lse).all()  # the empty read row still reads its new entries


@pytest.mark.parametrize("n_new", [1, 4])
def test_sparse_read_attention_shared_sets(n_new):
    """One set per batch row shared by the heads ([B, 1, N_old]), one set for everything, and a dense read."""
    b, hq, hk, n_old, d = 3, 4, 2, 29, 8
    q, k, v = _qkv(b, hq, hk, n_old, n_new, d, torch.float64)
    scale = 0.2
    per_row = torch.rand(b, 1, n_old) < 0.4
    per_row[1] = False
    everywhere = (torch.rand(1, 1, n_old) < 0.4).expand(b, 1, n_old)
    dense = torch.ones(b, hk, n_old, dtype=torch.bool)
    for read in (per_row, everywhere, per_row.expand(b, hk, n_old).clone(), dense):
        o, lse = sparse_read_attention(q, k, v, read, scale)
        o64, lse64 = _brute_attention(q, k, v, _full_mask(read, hq, n_old, n_new), scale)
        assert_close(o, o64, ratio=1e-12, atol=1e-12)
        assert_close(lse, lse64, ratio=1e-12, atol=1e-12)


def test_sparse_read_attention_errors():
    q, k, v = _qkv(1, 4, 2, 10, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"read must be boolean \[B, 1\|Hk, N_old\] = \[1, 1\|2, 10\].*\[1, 2, 12\]"):
        sparse_read_attention(q, k, v, torch.ones(1, 2, 12, dtype=torch.bool), 0.1)
    with pytest.raises(TypeError, match="read must be boolean.*float32"):
        sparse_read_attention(q, k, v, torch.ones(1, 2, 10), 0.1)
    with pytest.raises(ValueError, match=r"query heads \(3"):
        sparse_read_attention(q[:, :3], k, v, torch.ones(1, 2, 10, dtype=torch.bool), 0.1)
    with pytest.raises(ValueError, match=r"key must be .*got shape \[1, 2, 12\]"):
        sparse_read_attention(q, k[..., 0], v, torch.ones(1, 2, 10, dtype=torch.bool), 0.1)


# --- 1. gather layout -------------------------------------------------------------------------------------------
def test_gather_read_set_layout():
    b, hk, n_old, n_new, d, dv = 2, 3, 11, 2, 4, 5
    k = torch.randn(b, hk, n_old + n_new, d)
    v = torch.randn(b, hk, n_old + n_new, dv)
    read = _ragged_read(b, hk, n_old)
    k_c, v_c, mask = gather_read_set(k, v, read, n_new)
    s = int(read.sum(-1).max())
    assert k_c.shape == (b, hk, s + n_new, d) and v_c.shape == (b, hk, s + n_new, dv)
    assert mask.shape == (b, hk, s + n_new) and mask.dtype == torch.bool
    for bi in range(b):
        for h in range(hk):
            pos = read[bi, h].nonzero().flatten().tolist() + list(range(n_old, n_old + n_new))
            pad = s + n_new - len(pos)
            assert mask[bi, h].tolist() == [False] * pad + [True] * len(pos)
            assert torch.equal(k_c[bi, h, :pad], torch.zeros(pad, d))
            assert torch.equal(v_c[bi, h, :pad], torch.zeros(pad, dv))
            assert torch.equal(k_c[bi, h, pad:], k[bi, h, pos])
            assert torch.equal(v_c[bi, h, pad:], v[bi, h, pos])


def test_gather_read_set_no_padding_and_shortcuts():
    b, hk, n_old, n_new, d = 2, 2, 9, 1, 4
    k, v = torch.randn(b, hk, n_old + n_new, d), torch.randn(b, hk, n_old + n_new, d)
    # equal counts everywhere: no padding, no mask
    read = torch.zeros(b, hk, n_old, dtype=torch.bool)
    read[0, 0, [1, 4, 8]] = read[0, 1, [0, 2, 3]] = read[1, 0, [5, 6, 7]] = read[1, 1, [1, 2, 3]] = True
    k_c, v_c, mask = gather_read_set(k, v, read, n_new)
    assert mask is None and k_c.shape == (b, hk, 3 + n_new, d)
    assert torch.equal(k_c[1, 0], k[1, 0, [5, 6, 7, 9]])
    # a dense read returns the cache view itself
    full = torch.ones(b, 1, n_old, dtype=torch.bool)
    k_c, v_c, mask = gather_read_set(k, v, full, n_new)
    assert k_c is k and v_c is v and mask is None
    # an empty read everywhere leaves the new entries only
    k_c, v_c, mask = gather_read_set(k, v, torch.zeros(b, hk, n_old, dtype=torch.bool), n_new)
    assert mask is None and torch.equal(k_c, k[:, :, n_old:]) and torch.equal(v_c, v[:, :, n_old:])
    # a set shared by the heads (ragged over the batch): mask broadcast over the heads
    shared = torch.zeros(b, 1, n_old, dtype=torch.bool)
    shared[0, 0, [2, 3]] = shared[1, 0, [0, 4, 6]] = True
    k_c, v_c, mask = gather_read_set(k, v, shared, n_new)
    assert mask.shape == (b, hk, 4) and mask[0, :, 0].tolist() == [False, False]
    assert torch.equal(k_c[0, :, 1:], k[0, :, [2, 3, 9]]) and torch.equal(k_c[1], k[1][:, [0, 4, 6, 9]])
    with pytest.raises(ValueError, match="n_new must be an int in"):
        gather_read_set(k, v, shared, 11)


# --- 3. bytes ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float16), (torch.float32, torch.bfloat16)])
def test_kv_read_bytes_brute_force(dtypes):
    b, hk, n_old, n_new, d, dv = 3, 2, 17, 3, 8, 6
    k = torch.zeros(b, hk, n_old + n_new, d, dtype=dtypes[0])
    v = torch.zeros(b, hk, n_old + n_new, dv, dtype=dtypes[1])
    read = _ragged_read(b, hk, n_old)
    per = d * k.element_size() + dv * v.element_size()
    brute = 0
    for bi in range(b):
        for h in range(hk):
            count = sum(bool(x) for x in read[bi, h])
            brute += (count + n_new) * per
    assert kv_read_bytes(read, k, v, n_new) == brute
    assert kv_read_bytes(read, k, v) == brute - b * hk * n_new * per
    shared = read[:, :1]
    assert kv_read_bytes(shared, k, v, n_new) == hk * int(shared.sum()) * per + b * hk * n_new * per
    assert dense_read_bytes(None, k, v, n_new) == b * hk * (n_old + n_new) * per
    valid = read
    assert dense_read_bytes(valid, k, v, n_new) == brute


# --- 4. Quest ---------------------------------------------------------------------------------------------------
def test_page_bounds_brute_force():
    b, hk, n, d, page = 2, 3, 23, 5, 4
    key = torch.randn(b, hk, n, d, dtype=torch.float64)
    valid = torch.rand(b, hk, n) < 0.7
    valid[0, 0, 8:12] = False  # page 2 of (0, 0) holds no valid entry
    kmin, kmax, page_valid = page_bounds(key, valid, page)
    p = math.ceil(n / page)
    assert kmin.shape == kmax.shape == (b, hk, p, d) and page_valid.shape == (b, hk, p)
    assert not page_valid[0, 0, 2]
    for bi in range(b):
        for h in range(hk):
            for pi in range(p):
                rows = [j for j in range(pi * page, min(n, (pi + 1) * page)) if valid[bi, h, j]]
                assert bool(page_valid[bi, h, pi]) == bool(rows)
                if rows:
                    assert torch.equal(kmin[bi, h, pi], key[bi, h, rows].amin(0))
                    assert torch.equal(kmax[bi, h, pi], key[bi, h, rows].amax(0))
                else:
                    assert not kmin[bi, h, pi].any() and not kmax[bi, h, pi].any()
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
        page_bounds(key, valid, 0)


def test_page_scores_brute_force_and_upper_bound():
    b, hq, hk, nq, n, d, page = 2, 6, 2, 3, 30, 7, 4
    g = hq // hk
    for trial in range(5):
        q = torch.randn(b, hq, nq, d, dtype=torch.float64) * (1 + trial)
        key = torch.randn(b, hk, n, d, dtype=torch.float64) + trial * 0.5
        valid = torch.rand(b, hk, n) < 0.8
        kmin, kmax, page_valid = page_bounds(key, valid, page)
        scores = page_scores(q, kmin, kmax)
        p = kmin.shape[2]
        assert scores.shape == (b, hk, nq, p) and scores.dtype == torch.float64
        # brute force: the per-head bound, max over the group's query heads
        per_head = torch.maximum(q.unsqueeze(3) * kmax.repeat_interleave(g, 1).unsqueeze(2),
                                 q.unsqueeze(3) * kmin.repeat_interleave(g, 1).unsqueeze(2)).sum(-1)
        brute = per_head.view(b, hk, g, nq, p).amax(2)
        assert_close(scores, brute, ratio=1e-12, atol=1e-12)
        # property: the bound upper-bounds q . k for every valid key of the page and every query head of the group
        dots = q @ key.repeat_interleave(g, 1).transpose(-1, -2)  # [B, Hq, Nq, N]
        page_of = torch.arange(n) // page
        bound_per_key = scores.repeat_interleave(g, 1)[..., page_of]  # [B, Hq, Nq, N]
        live = valid.repeat_interleave(g, 1).unsqueeze(2).expand_as(dots)
        assert bool((bound_per_key[live] >= dots[live] - 1e-12).all())
    masked = page_scores(q, kmin, kmax, page_valid)
    assert torch.isinf(masked[~page_valid.unsqueeze(2).expand_as(masked)]).all()


def _brute_quest(q, key, valid, budget, page, sink, window):
    """Per (b, h) Python greedy: protected first, then pages by (-score, index), entries by position."""
    b, hq, nq, d = q.shape
    hk, n_old = key.shape[1], valid.shape[-1]
    g = hq // hk
    read = torch.zeros(b, hk, n_old, dtype=torch.bool)
    for bi in range(b):
        for h in range(hk):
            pos = [j for j in range(n_old) if valid[bi, h, j]]
            cap = min(budget, len(pos))
            prot = set(pos[:sink]) | set(pos[max(0, len(pos) - window):])
            chosen = sorted(prot)
            pages = []
            for pi in range(math.ceil(n_old / page)):
                rows = [j for j in pos if pi * page <= j < (pi + 1) * page]
                if not rows:
                    continue
                kk = key[bi, h, rows].double()
                best = max(float(torch.maximum(q[bi, qh, i].double() * kk.amax(0),
                                               q[bi, qh, i].double() * kk.amin(0)).sum())
                           for qh in range(h * g, (h + 1) * g) for i in range(nq))
                pages.append((-best, pi, rows))
            for _, _, rows in sorted(pages, key=lambda t: (t[0], t[1])):
                for j in rows:
                    if len(chosen) < cap and j not in prot:
                        chosen.append(j)
            read[bi, h, chosen] = True
    return read


@pytest.mark.parametrize("n_new", [1, 4])
@pytest.mark.parametrize("budget,page,sink,window", [(9, 4, 1, 2), (16, 3, 0, 0), (5, 8, 2, 3), (40, 4, 2, 2)])
def test_quest_read_set(n_new, budget, page, sink, window):
    b, hq, hk, n_old, d = 2, 4, 2, 29, 8
    q, key, _ = _qkv(b, hq, hk, n_old, n_new, d, torch.float64)
    valid = torch.ones(b, hk, n_old, dtype=torch.bool)
    valid[1, :, :6] = False  # left padding
    valid[0, 1, 10:14] = False
    read, info = quest_read_set(q, key, valid, budget, page, sink=sink, window=window)
    assert read.shape == (b, hk, n_old) and read.dtype == torch.bool
    count = valid.sum(-1)
    assert torch.equal(read.sum(-1), torch.clamp(count, max=budget))
    assert torch.equal(info["read_count"], read.sum(-1))
    assert not (read & ~valid).any()
    for bi in range(b):
        for h in range(hk):
            pos = valid[bi, h].nonzero().flatten().tolist()
            assert all(read[bi, h, j] for j in pos[:sink] + pos[len(pos) - window:])
    if budget >= n_old:
        assert torch.equal(read, valid)
    assert torch.equal(read, _brute_quest(q, key, valid, budget, page, sink, window))
    p = math.ceil(n_old / page)
    assert info["meta_bytes"] == int(info["page_valid"].sum()) * 2 * d * key.element_size()
    assert info["page_scores"].shape == (b, hk, p)
    _, info0 = quest_read_set(q, key, valid, budget, page, sink=sink, window=window, page_meta_bytes=False)
    assert info0["meta_bytes"] == 0


def test_quest_read_set_whole_pages_and_errors():
    b, hq, hk, n_old, n_new, d, page = 1, 2, 1, 40, 1, 4, 5
    q, key, _ = _qkv(b, hq, hk, n_old, n_new, d, torch.float32)
    read, info = quest_read_set(q, key, None, 12, page)
    pages = read.view(b, hk, n_old // page, page).sum(-1)[0, 0]
    assert sorted(pages.tolist(), reverse=True)[:4] == [5, 5, 2, 0]  # two whole pages, one cut, the rest unread
    scores = info["page_scores"][0, 0]
    taken = pages > 0
    assert scores[taken].min() >= scores[~taken].max()
    with pytest.raises(ValueError, match=r"budget_tokens=3 .*sink \+ window = 2 \+ 2"):
        quest_read_set(q, key, None, 3, page, sink=2, window=2)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        quest_read_set(q, key, None, 8, 0)
    with pytest.raises(ValueError, match=r"valid must be boolean \[B, 1\|Hk, N_old\] = \[1, 1\|1, 40\]"):
        quest_read_set(q, key, torch.ones(1, 1, 41, dtype=torch.bool), 8, 4)


# --- 5. attention recovery --------------------------------------------------------------------------------------
def _brute_arr(q, key, read, scale, valid):
    b, hq, nq, d = q.shape
    hk, n_old = key.shape[1], read.shape[-1]
    g = hq // hk
    out = torch.zeros(b, dtype=torch.float64)
    for bi in range(b):
        total = 0.0
        for h in range(hq):
            for i in range(nq):
                e = [math.exp(scale * float(q[bi, h, i].double() @ key[bi, h // g, j].double()))
                     for j in range(n_old + i + 1)]
                full = sum(e[j] for j in range(n_old) if valid[bi, h // g, j]) + sum(e[n_old:])
                part = sum(e[j] for j in range(n_old) if valid[bi, h // g, j] and read[bi, h // g, j]) + sum(e[n_old:])
                total += part / full
        out[bi] = total / (hq * nq)
    return out


@pytest.mark.parametrize("n_new", [1, 3])
def test_attention_recovery(n_new):
    b, hq, hk, n_old, d = 2, 6, 3, 15, 8
    q, key, _ = _qkv(b, hq, hk, n_old, n_new, d, torch.float64)
    scale = 0.4
    valid = torch.rand(b, hk, n_old) < 0.8
    read = _ragged_read(b, hk, n_old)
    arr = attention_recovery(q, key, read, scale, valid=valid)
    assert arr.shape == (b,)
    assert_close(arr, _brute_arr(q, key, read, scale, valid), ratio=1e-12, atol=1e-12)
    assert bool(((arr > 0) & (arr <= 1)).all())
    ones = torch.ones(b, hk, n_old, dtype=torch.bool)
    assert_close(attention_recovery(q, key, ones, scale), torch.ones(b, dtype=torch.float64), 1e-14, 1e-14)
    assert_close(attention_recovery(q, key, valid, scale, valid=valid), torch.ones(b, dtype=torch.float64),
                 1e-14, 1e-14)
    # default scale 1/sqrt(d), shared read set [B, 1, N_old], float32 input
    shared = read[:, :1]
    arr32 = attention_recovery(q.float(), key.float(), shared, None)
    assert arr32.dtype == torch.float32
    brute = _brute_arr(q, key, shared.expand(b, hk, n_old), 1 / math.sqrt(d), ones)
    assert_close(arr32, brute, ratio=1e-5, atol=1e-6)
