"""Masked attention on CUDA: ``litctx_kernels.attention(..., key_mask=...)`` through its routed backend (Triton K1/K2
with the key mask when a row has no valid key, as with left padding under a causal mask; otherwise the routing
table's choice, SDPA's memory-efficient op by default: ``tests/kernels/test_routing_gpu.py``); fp16 / bf16 (and
fp32 ieee) against the chunked reference in float64 on the GPU.

Run on a GPU machine with ``pytest -m gpu tests/kernels/test_masked_attention_gpu.py`` (``TRITON_INTERPRET``
unset). Skips cleanly without CUDA. Shapes follow SmolLM2-135M (9 query heads, 3 KV heads, d = 64) at N = 2K-4K.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels._triton_env import GPU_RATIO, compiled_cuda_device

pytestmark = pytest.mark.gpu
DEV = compiled_cuda_device()

import litctx_kernels  # noqa: E402
from litctx_kernels.dispatch import expand_key_mask, select_backend  # noqa: E402
from litctx_kernels.reference import attention_reference  # noqa: E402
from litctx_kernels.testing import assert_attention_close, assert_close  # noqa: E402


def _qkv(b, hq, hk, n_q, n_k, d, dtype, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=gen, device=DEV, dtype=dtype)
                 for h, n in ((hq, n_q), (hk, n_k), (hk, n_k)))


def _left_padded_and_evicted(b, hk, n, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    keep = torch.zeros(b, hk, n, dtype=torch.bool, device=DEV)
    for i in range(b):
        keep[i, :, (n * i) // (2 * b):] = True  # left padding growing with the row
    keep &= torch.rand(b, hk, n, generator=gen, device=DEV) > 0.5  # AdaKV-style per-head holes
    keep[..., -1] = True
    return keep


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(2048, 2048, {}), (1, 4096, {}), (64, 4096, {}), (2048, 2048, {"window": 512})],
                         ids=["prefill", "decode", "append", "window"])
def test_masked_forward_matches_reference(dtype, shape):
    n_q, n_k, kw = shape
    q, k, v = _qkv(4, 9, 3, n_q, n_k, 64, dtype)
    keep = _left_padded_and_evicted(4, 3, n_k, seed=1)
    assert select_backend("attention", q, key_mask=keep) == "triton"
    o, lse = litctx_kernels.attention(q, k, v, key_mask=keep, **kw)
    o_ref, lse_ref = attention_reference(q.double(), k.double(), v.double(), key_mask=expand_key_mask(keep, q, k),
                                         **kw)
    assert_attention_close(o, lse, o_ref, lse_ref, GPU_RATIO[dtype], name="masked forward")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_masked_backward_matches_reference(dtype):
    q, k, v = _qkv(2, 9, 3, 1024, 1024, 64, dtype, seed=2)
    keep = _left_padded_and_evicted(2, 3, 1024, seed=3)
    w = torch.randn(q.shape, device=DEV, dtype=torch.float64)
    grads = []
    for fn in ("triton", "reference"):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        if fn == "triton":
            o, lse = litctx_kernels.attention(qq, kk, vv, key_mask=keep)
        else:
            o, lse = attention_reference(qq.double(), kk.double(), vv.double(), key_mask=expand_key_mask(keep, q, k))
        live = torch.isfinite(lse)
        loss = (o.double() * w).sum() + torch.where(live, lse.double(), torch.zeros_like(lse.double())).sum()
        grads.append(torch.autograd.grad(loss, (qq, kk, vv)))
    for name, a, e in zip("qkv", *grads):
        assert_close(a, torch.nan_to_num(e), 2 * GPU_RATIO[dtype], name=f"d{name}")
