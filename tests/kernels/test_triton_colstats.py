"""K5 (``litctx_kernels.triton.colstats``) against a float64 brute force and the torch reference."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.interpret

from tests.kernels._triton_env import triton_device  # noqa: E402

DEVICE = triton_device()
INTERPRET = DEVICE == "cpu"

from litctx_kernels.testing import assert_close  # noqa: E402
from litctx_kernels.triton.attention import triton_attention  # noqa: E402
from litctx_kernels.triton.colstats import ColStats, triton_attention_colstats  # noqa: E402

from litctx_kernels.reference import attention_colstats_reference  # noqa: E402

RATIO = {torch.float32: 1e-5, torch.float16: 5e-3}


def brute_colstats(q, k, v, *, scale=None, causal=True, q_offset=None, window=None, q_window=None):
    """float64 column statistics from the full probability matrix of the window rows."""
    b, hq, n_q, d = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    g = hq // hk
    q, k, v = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    off = n_k - n_q if q_offset is None else q_offset
    w = n_q if q_window is None else q_window
    rows = torch.arange(n_q - w, n_q, device=q.device)
    pos = rows + off
    j = torch.arange(n_k, device=q.device)
    valid = torch.ones(w, n_k, dtype=torch.bool, device=q.device)
    if causal:
        valid &= j <= pos[:, None]
        if window is not None:
            valid &= j > pos[:, None] - window
    s = q[:, :, rows] @ k.transpose(-1, -2) * (1 / math.sqrt(d) if scale is None else scale)
    s = s.masked_fill(~valid, -math.inf)
    has = valid.any(-1)
    p = torch.softmax(torch.where(has[:, None], s, torch.zeros_like(s)), -1) * valid
    o = p @ v
    p2 = p * p
    return ColStats(p.sum(2), p2.sum(2), p2.transpose(-1, -2) @ o, (p2 * o.pow(2).sum(-1, keepdim=True)).sum(2))


def make(b, hq, hk, n_q, n_k, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=gen).to(dtype).to(DEVICE)
                 for h, n in ((hq, n_q), (hk, n_k), (hk, n_k)))


def check(stats, expected, ratio):
    assert isinstance(stats, ColStats)
    for name, a, e in zip(stats._fields, stats, expected):
        if e is None:
            continue
        assert a.dtype == torch.float32, name
        assert_close(a, e, ratio=ratio, name=name)


@pytest.mark.parametrize("case", [
    dict(b=1, hq=4, hk=2, n_q=100, n_k=100, d=32, q_window=37),
    dict(b=2, hq=2, hk=2, n_q=64, n_k=64, d=64),
    dict(b=1, hq=2, hk=1, n_q=63, n_k=100, d=16, window=20),
    dict(b=1, hq=2, hk=1, n_q=40, n_k=100, d=32, causal=False, q_window=16),
    dict(b=1, hq=3, hk=1, n_q=50, n_k=80, d=32, q_offset=10, q_window=25),
    dict(b=1, hq=2, hk=1, n_q=50, n_k=80, d=32, q_offset=-4),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_colstats_fp32(case):
    case = dict(case)
    kw = {k: case.pop(k) for k in ("causal", "window", "q_window", "q_offset") if k in case}
    q, k, v = make(**case, dtype=torch.float32, seed=case["n_q"])
    stats = triton_attention_colstats(q, k, v, **kw)
    check(stats, brute_colstats(q, k, v, **kw), RATIO[torch.float32])
    check(stats, attention_colstats_reference(q.double(), k.double(), v.double(), **kw), RATIO[torch.float32])


@pytest.mark.parametrize("case", [
    dict(b=1, hq=4, hk=2, n_q=70, n_k=70, d=32, q_window=37),
    dict(b=1, hq=2, hk=1, n_q=40, n_k=90, d=16, window=20),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_colstats_logit_moments_fp32(case):
    case = dict(case)
    kw = {k: case.pop(k) for k in ("window", "q_window") if k in case}
    q, k, v = make(**case, dtype=torch.float32, seed=case["n_q"])
    stats = triton_attention_colstats(q, k, v, moments="logit", **kw)
    assert all(t is not None for t in stats)
    ref = attention_colstats_reference(q.double(), k.double(), v.double(), moments="logit", **kw)
    check(stats, ref, RATIO[torch.float32])


def test_colstats_fp16_with_given_outputs():
    q, k, v = make(1, 4, 2, 100, 100, 32, torch.float16, seed=1)
    o, lse = triton_attention(q[:, :, -30:], k, v, q_offset=70)
    stats = triton_attention_colstats(q, k, v, q_window=30, o=o, lse=lse)
    # reference statistics from the same (fp16) outputs, so only the kernel's arithmetic is compared
    ref = attention_colstats_reference(q.double(), k.double(), v.double(), q_window=30, o=o.double(),
                                       lse=lse.double())
    check(stats, ref, RATIO[torch.float16])
    check(stats, brute_colstats(q, k, v, q_window=30), RATIO[torch.float16])
    # computing o/lse internally gives the same statistics
    again = triton_attention_colstats(q, k, v, q_window=30)
    for a, b_ in zip(stats[:4], again[:4]):
        assert torch.equal(a, b_)


def test_colstats_every_output_written_and_unseen_keys_are_zero(monkeypatch):
    q, k, v = make(1, 2, 1, 40, 100, 32, torch.float32, seed=2)
    kw = dict(window=16, q_window=20)  # window rows 20..39 sit at 80..99 and see keys 65..99
    clean = triton_attention_colstats(q, k, v, **kw)
    real_empty = torch.empty

    def poisoned(*a, **kw_):
        t = real_empty(*a, **kw_)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    dirty = triton_attention_colstats(q, k, v, **kw)
    for a, b_ in zip(clean[:4], dirty[:4]):
        assert not torch.isnan(b_).any()
        assert torch.equal(a, b_)
    assert (dirty.p_sum[..., :65] == 0).all() and (dirty.p2_o[..., :65, :] == 0).all()
    assert_close(dirty.p_sum.sum(-1), torch.full((1, 2), 20.0, device=DEVICE), ratio=1e-6)  # rows sum to 1


def test_colstats_validates():
    q, k, v = make(1, 2, 1, 32, 32, 16, torch.float32, seed=3)
    with pytest.raises(ValueError, match="q_window"):
        triton_attention_colstats(q, k, v, q_window=0)
    with pytest.raises(ValueError, match="window"):
        triton_attention_colstats(q, k, v, causal=False, window=4)
    o, lse = triton_attention(q, k, v)
    with pytest.raises(ValueError, match="W=q_window"):
        triton_attention_colstats(q, k, v, q_window=8, o=o, lse=lse)
