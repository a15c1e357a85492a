"""Compiled Triton kernels on CUDA at realistic lengths (N = 4K-16K), fp16 / bf16 (and one fp32 ieee case).

Run on a GPU machine with ``pytest -m gpu tests/kernels/test_triton_gpu.py`` (``TRITON_INTERPRET`` unset).
The oracle is the chunked torch reference in float64 on the GPU (memory O(chunk x N); the reference itself is
checked against a float64 brute force at small N on CPU). Sized to finish in about 3-4 minutes on an H200 including
~40 kernel compilations.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels._triton_env import GPU_RATIO, compiled_cuda_device

pytestmark = pytest.mark.gpu
DEV = compiled_cuda_device()

from litctx_kernels.layouts import BlockLayout, QueryIndex, TokenIndex  # noqa: E402
from litctx_kernels.reference import attention_reference, gather_attention_reference  # noqa: E402
from litctx_kernels.testing import assert_close  # noqa: E402
from litctx_kernels.triton.attention import triton_attention  # noqa: E402
from litctx_kernels.triton.colstats import triton_attention_colstats  # noqa: E402
from litctx_kernels.triton.gather import triton_gather_attention  # noqa: E402


def brute(q, k, v, *, key_keep=None, **kw):
    """float64 ``(o, lse)`` from the chunked torch reference (checked against a float64 brute force at small N in
    ``test_reference.py``): memory O(chunk x N), never an N x N matrix, differentiable."""
    q, k, v = q.double(), k.double(), v.double()
    if key_keep is not None:
        return gather_attention_reference(q, k, v, TokenIndex.from_mask(key_keep), chunk=256, **kw)
    return attention_reference(q, k, v, chunk=256, **kw)


def make(b, hq, hk, n, d, dtype, seed, n_k=None, transposed=False):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    n_k = n if n_k is None else n_k

    def mk(h, m):
        if transposed:
            return torch.randn(b, m, h, d, generator=gen, device=DEV).to(dtype).transpose(1, 2)
        return torch.randn(b, h, m, d, generator=gen, device=DEV).to(dtype)

    return mk(hq, n), mk(hk, n_k), mk(hk, n_k)


def parity(q, k, v, backward=True, **kw):
    ratio = GPU_RATIO[q.dtype]
    gen = torch.Generator(device=DEV).manual_seed(99)
    leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    o, lse = triton_attention(*leaves, **kw)
    go = torch.randn(o.shape, generator=gen, device=DEV, dtype=torch.float64)
    gl = torch.randn(lse.shape, generator=gen, device=DEV, dtype=torch.float64)
    if backward:
        ((o.double() * go).sum() + (torch.where(torch.isfinite(lse), lse.double(), 0.0) * gl).sum()).backward()
    r_leaves = [t.detach().double().requires_grad_(backward) for t in (q, k, v)]
    ro, rl = brute(*r_leaves, **kw)
    if backward:
        ((ro * go).sum() + (torch.where(torch.isfinite(rl), rl, 0.0) * gl).sum()).backward()
    assert_close(o, ro, ratio=ratio, name="o")
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin)
    assert_close(lse[fin], rl[fin], ratio=ratio, name="lse")
    if backward:
        for name, a, e in zip(("dq", "dk", "dv"), leaves, r_leaves):
            assert torch.isfinite(a.grad).all(), name
            assert_close(a.grad, e.grad, ratio=ratio, name=name)
    del ro, rl, r_leaves
    torch.cuda.empty_cache()


def random_layout(h, n, bq, bk, density, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    base = BlockLayout.causal(n, n, bq, bk, device=DEV).to_block_mask()
    mq, mk = base.shape[-2:]
    mask = (torch.rand(1, h, mq, mk, generator=gen, device=DEV) < density) & base
    mask[..., 0] = True
    r = torch.arange(mq, device=DEV)
    mask[..., r, (r * bq) // bk] = True  # diagonal block
    return BlockLayout.from_block_mask(mask & base, bq, bk, (n, n))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dense_causal_4k(dtype):
    parity(*make(1, 4, 2, 4096, 64, dtype, 1))


def test_dense_causal_16k_fp16():
    parity(*make(1, 2, 1, 16384, 64, torch.float16, 2))


def test_fp32_ieee_parity_4k():
    parity(*make(1, 2, 1, 4096, 64, torch.float32, 3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_window_and_noncontiguous_8k(dtype):
    parity(*make(1, 4, 2, 8192, 64, dtype, 4, transposed=True), window=1024)


def test_chunked_prefill_offset_and_noncausal():
    parity(*make(1, 4, 1, 1024, 128, torch.bfloat16, 5, n_k=8192))            # Nq < Nk, bottom-right
    parity(*make(1, 2, 2, 4096, 64, torch.float16, 6, n_k=4000), causal=False)  # ragged, dense


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_block_layout_8k(dtype):
    lay = random_layout(4, 8192, 128, 128, 0.25, 7)
    parity(*make(1, 4, 2, 8192, 64, dtype, 8), layout=lay)


def test_block_layout_sale_blocks_and_lssa():
    lay = random_layout(2, 4096, 64, 32, 0.3, 9)  # non-square blocks (SALE 64 x 32)
    parity(*make(1, 2, 1, 4096, 64, torch.float16, 10), layout=lay)
    parity(*make(1, 4, 2, 4096, 64, torch.bfloat16, 11), score_mode="lssa")


def test_q_index_4k():
    gen = torch.Generator(device=DEV).manual_seed(12)
    qi = QueryIndex.from_mask(torch.rand(1, 4, 4096, generator=gen, device=DEV) < 0.3)
    parity(*make(1, 4, 2, 4096, 64, torch.float16, 13), q_index=qi)
    lay = random_layout(4, 4096, 128, 128, 0.3, 14)
    parity(*make(1, 4, 2, 4096, 64, torch.bfloat16, 15), q_index=qi, layout=lay)


def test_gather_16k():
    q, k, v = make(1, 8, 2, 16, 64, torch.float16, 16, n_k=16384)
    gen = torch.Generator(device=DEV).manual_seed(17)
    keep = torch.rand(1, 2, 16384, generator=gen, device=DEV) < 0.1
    ti = TokenIndex.from_mask(keep)
    for dtype in (torch.float16, torch.bfloat16):
        qq, kk, vv = q.to(dtype), k.to(dtype), v.to(dtype)
        o, lse = triton_gather_attention(qq, kk, vv, ti)
        ro, rl = brute(qq, kk, vv, key_keep=keep)
        assert_close(o, ro, ratio=GPU_RATIO[dtype], name="o")
        assert_close(lse, rl, ratio=GPU_RATIO[dtype], name="lse")


def test_colstats_8k():
    q, k, v = make(1, 4, 2, 8192, 64, torch.float16, 18)
    w = 64
    stats = triton_attention_colstats(q, k, v, q_window=w)
    g = 2
    qd, kd = q[:, :, -w:].double(), k.double().repeat_interleave(g, 1)
    s = qd @ kd.transpose(-1, -2) / 8.0
    s = s.masked_fill(torch.arange(8192, device=DEV) > torch.arange(8192 - w, 8192, device=DEV)[:, None], -math.inf)
    p = torch.softmax(s, -1)
    o = p @ v.double().repeat_interleave(g, 1)
    p2 = p * p
    expected = (p.sum(2), p2.sum(2), p2.transpose(-1, -2) @ o, (p2 * o.pow(2).sum(-1, keepdim=True)).sum(2))
    for name, a, e in zip(stats._fields, stats, expected):
        assert_close(a, e, ratio=GPU_RATIO[torch.float16], name=name)
