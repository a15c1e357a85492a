"""The CPU query-subset path (L2A's routed rows through the fused flash kernel, chunked, checkpointed) against
float64 brute force: GQA, shared and per-head routing, key masks, windows, padded and keyless rows, gradients."""

from __future__ import annotations

import pytest
import torch

import litctx_kernels
from litctx_kernels import dispatch
from litctx_kernels.layouts import QueryIndex
from tests.kernels._brute import brute_attention, brute_mask


def _case(b=2, hq=4, hk=2, n=70, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=torch.float64).requires_grad_(True) for h in (hq, hk, hk)]


@pytest.mark.parametrize("heads", ["shared", "per_head"])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("masked", [False, True])
def test_query_subset_matches_brute_force_forward_and_backward(heads, window, masked, monkeypatch):
    monkeypatch.setattr(dispatch, "QUERY_SUBSET_ROWS", 16)  # several chunks, checkpointed in backward
    q, k, v = _case()
    b, hq, n, _ = q.shape
    gen = torch.Generator().manual_seed(1)
    route = torch.rand(b, 1 if heads == "shared" else hq, n, generator=gen) < 0.4
    route[0, :, :3] = True  # the first rows: with left padding below they have no key at all
    index = QueryIndex.from_mask(route)
    key_mask = None
    if masked:
        key_mask = torch.rand(b, 1, n, generator=gen) < 0.8
        key_mask[0, :, :5] = False
    o, lse = litctx_kernels.attention(q, k, v, window=window, q_index=index, key_mask=key_mask)
    valid = brute_mask(n, n, window=window).expand(b, hq, n, n)
    if key_mask is not None:
        valid = valid & key_mask.unsqueeze(2)
    bo, blse, _ = brute_attention(q, k, v, valid)
    want_o = index.gather(bo)
    live = index.gather(torch.isfinite(blse).unsqueeze(-1).to(bo.dtype)).squeeze(-1) > 0
    pad = (index.idx < 0).expand(b, hq, -1)
    assert torch.allclose(o, want_o * live.unsqueeze(-1), atol=1e-10)
    assert torch.all(o[pad] == 0) and torch.all(torch.isinf(lse[pad] if pad.any() else torch.tensor([-float("inf")])))
    want_lse = index.gather(blse.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(lse[live], want_lse[live], atol=1e-10)
    assert torch.all(torch.isinf(lse[~live]))
    go = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), go)
    ref = torch.autograd.grad((want_o * live.unsqueeze(-1) * go).sum(), (q, k, v))
    for a, e in zip(got, ref):
        assert torch.allclose(a, e, atol=1e-9)


def test_an_empty_subset_returns_no_rows_but_keeps_the_graph():
    q, k, v = _case(n=20)
    index = QueryIndex.from_mask(torch.zeros(2, 1, 20, dtype=torch.bool))
    o, lse = litctx_kernels.attention(q, k, v, q_index=index)
    assert o.shape == (2, 4, 0, 16) and lse.shape == (2, 4, 0)
    o.sum().backward()
    assert q.grad is not None and float(q.grad.abs().sum()) == 0.0
