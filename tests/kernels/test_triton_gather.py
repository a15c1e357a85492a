"""K3 (``litctx_kernels.triton.gather``) against a float64 brute force and the torch reference (forward only)."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.interpret

from tests.kernels._triton_env import triton_device  # noqa: E402

DEVICE = triton_device()
INTERPRET = DEVICE == "cpu"

from litctx_kernels.layouts import TokenIndex  # noqa: E402
from litctx_kernels.testing import assert_close  # noqa: E402
from litctx_kernels.triton.gather import triton_gather_attention  # noqa: E402

from litctx_kernels.reference import gather_attention_reference  # noqa: E402

RATIO = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1.5e-2}


def brute_gather(q, k, v, token_index, *, scale=None, causal=True, q_offset=None):
    """float64 ``(o, lse)``: query head ``h`` attends to the listed keys of kv head ``h // G``."""
    b, hq, n_q, d = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    g = hq // hk
    q, k, v = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    keep = token_index.to_mask().to(q.device).repeat_interleave(g, 1)  # [B, Hq, Nk]
    off = n_k - n_q if q_offset is None else q_offset
    valid = keep.unsqueeze(2).expand(b, hq, n_q, n_k)
    if causal:
        valid = valid & (torch.arange(n_k, device=q.device) <= (torch.arange(n_q, device=q.device) + off)[:, None])
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(d) if scale is None else scale)
    s = s.masked_fill(~valid, -math.inf)
    has = valid.any(-1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(has, lse, 0.0).unsqueeze(-1)) * valid
    return p @ v, torch.where(has, lse, torch.full_like(lse, -math.inf))


def make(b, hq, hk, n_q, n_k, d, dtype, seed, keep=0.3, transposed=False):
    gen = torch.Generator().manual_seed(seed)

    def mk(h, n):
        if transposed:
            return torch.randn(b, n, h, d, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
        return torch.randn(b, h, n, d, generator=gen).to(dtype).to(DEVICE)

    q, k, v = mk(hq, n_q), mk(hk, n_k), mk(hk, n_k)
    ti = TokenIndex.from_mask((torch.rand(b, hk, n_k, generator=gen) < keep).to(DEVICE))
    return q, k, v, ti


def check(q, k, v, ti, **kw):
    ratio = RATIO[q.dtype]
    o, lse = triton_gather_attention(q, k, v, ti, **kw)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    assert o.shape == (*q.shape[:3], v.shape[-1]) and lse.shape == q.shape[:3]
    oracles = [brute_gather(q, k, v, ti, **kw),
               gather_attention_reference(q.double(), k.double(), v.double(), ti, **kw)]
    for ro, rl in oracles:
        assert_close(o, ro, ratio=ratio, name="o")
        fin = torch.isfinite(rl)
        assert torch.equal(torch.isfinite(lse), fin)
        assert (o[~fin] == 0).all()
        assert_close(lse[fin], rl[fin], ratio=ratio, name="lse")
    return o, lse


@pytest.mark.parametrize("case", [
    dict(b=2, hq=4, hk=2, n_q=5, n_k=100, d=32),          # verification window, GQA 2
    dict(b=1, hq=8, hk=1, n_q=1, n_k=70, d=64),           # decode, GQA 8
    dict(b=1, hq=3, hk=1, n_q=63, n_k=63, d=16),          # non-power-of-two group, many rows
    dict(b=1, hq=2, hk=2, n_q=100, n_k=100, d=32, keep=0.6),
    dict(b=1, hq=4, hk=2, n_q=16, n_k=100, d=32, q_offset=40),
    dict(b=1, hq=2, hk=1, n_q=20, n_k=90, d=32, scale=0.2),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("causal", [True, False])
def test_gather_fp32(case, causal):
    case = dict(case)
    kw = {k: case.pop(k) for k in ("q_offset", "scale") if k in case}
    q, k, v, ti = make(**case, dtype=torch.float32, seed=case["n_q"] + case["n_k"])
    check(q, k, v, ti, causal=causal, **kw)


def test_gather_fp16_and_bf16():
    q, k, v, ti = make(1, 4, 2, 33, 100, 32, torch.float16, seed=1)
    check(q, k, v, ti)
    q, k, v, ti = make(1, 4, 2, 9, 64, 32, torch.bfloat16, seed=2)
    check(q, k, v, ti)


def test_gather_noncontiguous():
    q, k, v, ti = make(2, 4, 2, 7, 80, 32, torch.float32, seed=3, transposed=True)
    assert not k.is_contiguous()
    check(q, k, v, ti)


def test_gather_empty_lists_and_rows_before_the_first_token():
    b, hk, n_k = 1, 2, 64
    mask = torch.zeros(b, hk, n_k, dtype=torch.bool)
    mask[0, 1, 40:] = True  # head 1: tokens >= 40 only; head 0: nothing
    ti = TokenIndex.from_mask(mask.to(DEVICE))
    q, k, v, _ = make(b, 4, hk, 30, n_k, 16, torch.float32, seed=4)
    o, lse = check(q, k, v, ti, causal=True)  # rows at positions 34..63: head group 1 sees keys from row 6 on
    assert (o[:, :2] == 0).all() and (lse[:, :2] == -math.inf).all()
    assert (lse[:, 2:, :6] == -math.inf).all() and torch.isfinite(lse[:, 2:, 6:]).all()


def test_gather_full_list_equals_dense_attention():
    from litctx_kernels.triton.attention import triton_attention

    q, k, v, _ = make(1, 4, 2, 20, 80, 32, torch.float32, seed=5)
    ti = TokenIndex.from_mask(torch.ones(1, 2, 80, dtype=torch.bool, device=DEVICE))
    o1, l1 = triton_gather_attention(q, k, v, ti)
    o2, l2 = triton_attention(q, k, v)
    assert_close(o1, o2, ratio=1e-6)
    assert_close(l1, l2, ratio=1e-6)


def test_gather_every_output_written(monkeypatch):
    q, k, v, ti = make(1, 6, 2, 37, 90, 32, torch.float32, seed=6)
    o1, l1 = triton_gather_attention(q, k, v, ti, q_offset=10)
    real_empty = torch.empty

    def poisoned(*a, **kw):
        t = real_empty(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    o2, l2 = triton_gather_attention(q, k, v, ti, q_offset=10)
    assert not torch.isnan(o2).any() and not torch.isnan(l2).any()
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_gather_is_forward_only_and_validates():
    q, k, v, ti = make(1, 2, 1, 4, 32, 16, torch.float32, seed=7)
    qq = q.clone().requires_grad_(True)
    o, _ = triton_gather_attention(qq, k, v, ti)
    with pytest.raises(NotImplementedError, match="forward-only"):
        o.sum().backward()
    with pytest.raises(ValueError, match="token_index"):
        triton_gather_attention(q, k, v, TokenIndex.from_mask(torch.ones(1, 2, 32, dtype=torch.bool, device=DEVICE)))
    with pytest.raises(TypeError, match="TokenIndex"):
        triton_gather_attention(q, k, v, ti.idx)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        triton_gather_attention(q[:, :1], k.expand(1, 2, 32, 16), v.expand(1, 2, 32, 16), ti)
