"""K6 (``litctx_kernels.triton.lssar``): the two-pass log-domain LSSAR forward against the torch reference and a float64
brute force of the paper's definition; the backward (reference recompute) against the reference's gradients.

Runs in the Triton interpreter on CPU (``TRITON_INTERPRET=1 pytest -m interpret tests/kernels``) or compiled on
CUDA. Sizes stay small because the interpreter runs every program instance in Python.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.interpret

from tests.kernels._triton_env import triton_device  # noqa: E402

DEVICE = triton_device()

import litctx_kernels  # noqa: E402
from litctx_kernels.reference import attention_reference  # noqa: E402
from litctx_kernels.testing import assert_close  # noqa: E402
from litctx_kernels.triton.lssar import triton_lssar_attention  # noqa: E402


def qkv(b=1, hq=2, hk=1, nq=128, nk=None, d=32, seed=0, sharp=0.0):
    g = torch.Generator().manual_seed(seed)
    nk = nq if nk is None else nk
    q = torch.randn(b, hq, nq, d, generator=g)
    k = torch.randn(b, hk, nk, d, generator=g)
    if sharp:  # a few keys aligned with the queries: a sharp head whose naive (N A - 1)^p is large
        k[:, :, ::17] = q[:, :hk, : k[:, :, ::17].shape[2]] * sharp
    v = torch.randn(b, hk, nk, d, generator=g)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


def brute_lssar(q, k, v, *, power, offset_rows=3, causal=True, window=None, q_offset=None):
    """float64, the paper's steps verbatim: cosine logits, kappa = ln d ln N_i, softplus, l1 rows,
    relu(N A - O)^p, l1 rows (rows whose re-weighted weights are all zero keep the LSSA weights)."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    g = hq // hk
    q = F.normalize(q.double().cpu(), dim=-1)
    k = F.normalize(k.double().cpu(), dim=-1).repeat_interleave(g, 1)
    v = v.double().cpu().repeat_interleave(g, 1)
    off = nk - nq if q_offset is None else q_offset
    pos = torch.arange(nq) + off
    j = torch.arange(nk)
    mask = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        mask = j[None] <= pos[:, None]
        if window is not None:
            mask = mask & (j[None] > pos[:, None] - window)
    n_i = mask.sum(-1).double().clamp_min(1)
    kappa = math.log(d) * torch.log(n_i)
    a = F.softplus(kappa[:, None] * (q @ k.transpose(-1, -2))) * mask
    a = a / a.sum(-1, keepdim=True)
    o_i = (pos >= offset_rows).double()[:, None]
    r = torch.relu(n_i[:, None] * a - o_i) ** power * mask
    tot = r.sum(-1, keepdim=True)
    w = torch.where(tot > 0, r / torch.where(tot > 0, tot, torch.ones_like(tot)), a)
    return w @ v


@pytest.mark.parametrize("kw", [dict(), dict(window=40), dict(nk=200), dict(hq=4, hk=2),
                                dict(causal=False), dict(d=64, nq=96)])
@pytest.mark.parametrize("power", [3.0, 15.0])
def test_lssar_forward_matches_reference_and_definition(kw, power):
    kw = dict(kw)
    causal, window = kw.pop("causal", True), kw.pop("window", None)
    q, k, v = qkv(**kw, sharp=0.8)
    o, lse = triton_lssar_attention(q, k, v, causal=causal, window=window, power=power)
    ro, rlse = attention_reference(q, k, v, causal=causal, window=window, score_mode="lssar", lssar_power=power)
    assert torch.isfinite(o).all()
    assert_close(o, ro, ratio=2e-4)
    assert_close(lse, rlse, ratio=2e-4)
    assert_close(o.double().cpu(), brute_lssar(q, k, v, power=power, causal=causal, window=window), ratio=2e-4)


@pytest.mark.parametrize("offset_rows", [0, 3, 7])
def test_offset_rows_match_the_reference(offset_rows):
    q, k, v = qkv(nq=64, sharp=0.7)
    o, lse = triton_lssar_attention(q, k, v, power=15.0, offset_rows=offset_rows)
    ro, rlse = attention_reference(q, k, v, score_mode="lssar", lssar_power=15.0, lssar_offset_rows=offset_rows)
    assert_close(o, ro, ratio=2e-4)
    assert_close(lse, rlse, ratio=2e-4)
    assert_close(o.double().cpu(), brute_lssar(q, k, v, power=15.0, offset_rows=offset_rows), ratio=2e-4)


def test_decode_rows_with_offset_match_the_full_forward():
    q, k, v = qkv(nq=160, sharp=0.5)
    full, _ = triton_lssar_attention(q, k, v, power=15.0)
    tail, _ = triton_lssar_attention(q[:, :, -7:], k, v, power=15.0)  # q_offset = Nk - Nq (bottom-right)
    assert_close(tail, full[:, :, -7:], ratio=1e-5)


def test_backward_matches_reference_gradients():
    q, k, v = qkv(nq=48, d=16, hq=2, hk=1, sharp=0.6)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    o, lse = triton_lssar_attention(q, k, v, power=3.0)
    (o.square().sum() + lse.sum()).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ro, rlse = attention_reference(q2, k2, v2, score_mode="lssar", lssar_power=3.0)
    (ro.square().sum() + rlse.sum()).backward()
    for g, r in zip(grads, (q2.grad, k2.grad, v2.grad)):
        assert_close(g, r, ratio=1e-4)


def test_dispatcher_runs_k6_for_lssar_and_the_reference_for_what_k6_cannot_serve():
    q, k, v = qkv(nq=64)
    o, _ = litctx_kernels.attention(q, k, v, score_mode="lssar", backend="triton")
    ro, _ = attention_reference(q, k, v, score_mode="lssar")
    assert_close(o, ro, ratio=2e-4)
    km = torch.ones(1, 1, 64, dtype=torch.bool, device=q.device)
    with pytest.raises(RuntimeError, match="cannot run this call"):
        litctx_kernels.attention(q, k, v, score_mode="lssar", key_mask=km, backend="triton")
