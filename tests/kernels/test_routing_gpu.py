"""The routed CUDA backends against the float64 reference on a GPU: every SDPA op with its LSE (forward, backward,
a gradient through the LSE, GQA at SmolLM2's 9 / 3 heads), the memory-efficient op with a key mask, and compiled
FlexAttention with a block layout; then ``litctx_kernels.attention`` with no table (the defaults) on the same calls.

Run on a GPU machine with ``pytest -m gpu tests/kernels/test_routing_gpu.py`` (``bench/gpu_check.sh`` does).
Skips cleanly without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels._triton_env import compiled_cuda_device

pytestmark = pytest.mark.gpu
DEV = compiled_cuda_device()

import litctx_kernels  # noqa: E402
from litctx_kernels import BlockLayout  # noqa: E402
from litctx_kernels.reference import attention_reference  # noqa: E402
from litctx_kernels.testing import assert_attention_close, assert_close  # noqa: E402
from litctx_kernels.torch_kernels import flex_attention_layout, sdpa_attention  # noqa: E402

RATIO = {torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}


def _qkv(n, dtype, hq=9, hk=3, d=64, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(1, h, n, d, generator=gen, device=DEV, dtype=dtype).requires_grad_(True)
            for h in (hq, hk, hk)]


def _check(o, lse, q, k, v, ratio, **kw):
    w = torch.randn(o.shape, device=DEV, dtype=torch.float64)
    u = torch.randn(lse.shape, device=DEV, dtype=torch.float64)
    got = torch.autograd.grad((o.double() * w).sum() + (lse.double() * u).nan_to_num(0, 0, 0).sum(), (q, k, v))
    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o_ref, lse_ref = attention_reference(qr, kr, vr, **kw)
    assert_attention_close(o.detach().double(), lse.detach().double(), o_ref.detach(), lse_ref.detach(), ratio)
    ref = torch.autograd.grad((o_ref * w).sum() + (lse_ref * u).nan_to_num(0, 0, 0).sum(), (qr, kr, vr))
    for g, r, name in zip(got, ref, "qkv"):
        assert g.shape == r.shape
        assert_close(g.double(), r, ratio, name=f"d{name}")


@pytest.mark.parametrize("op,dtype", [("sdpa_flash", torch.bfloat16), ("sdpa_flash", torch.float16),
                                      ("sdpa_efficient", torch.bfloat16), ("sdpa_efficient", torch.float32)])
@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_ops_forward_and_backward(op, dtype, causal):
    q, k, v = _qkv(2048, dtype)
    o, lse = sdpa_attention(q, k, v, op, causal=causal)
    _check(o, lse, q, k, v, RATIO[dtype], causal=causal, q_offset=0 if causal else None)


def test_cudnn_forward():
    q, k, v = (t.detach() for t in _qkv(2048, torch.bfloat16))
    try:
        o, lse = sdpa_attention(q, k, v, "sdpa_cudnn", causal=True)
    except RuntimeError as exc:
        pytest.skip(f"cuDNN attention unavailable here: {exc}")
    o_ref, lse_ref = attention_reference(q.double(), k.double(), v.double(), causal=True)
    assert_attention_close(o.double(), lse.double(), o_ref, lse_ref, RATIO[torch.bfloat16])


def test_efficient_op_with_a_key_mask():
    q, k, v = _qkv(2048, torch.bfloat16)
    keep = torch.rand(1, 3, 2048, device=DEV) > 0.4
    keep[..., 0] = True
    o, lse = sdpa_attention(q, k, v, "sdpa_efficient", causal=True, key_mask=keep)
    _check(o, lse, q, k, v, RATIO[torch.bfloat16], causal=True, q_offset=0, key_mask=keep.repeat_interleave(3, 1))


def test_flex_with_a_layout():
    q, k, v = _qkv(4096, torch.bfloat16)
    layout = BlockLayout.random_causal(4096, 128, 0.2, heads=9, seed=0).to(DEV)
    o, lse = flex_attention_layout(q, k, v, layout, causal=True, q_offset=0)
    _check(o, lse, q, k, v, RATIO[torch.bfloat16], causal=True, layout=layout)


@pytest.mark.parametrize("kind", ["causal", "dense", "key_mask", "decode", "layout"])
def test_dispatcher_defaults(kind, monkeypatch):
    monkeypatch.setenv("LITCTX_ROUTING_TABLE", "")
    q, k, v = _qkv(2048, torch.bfloat16)
    kw = {"causal": kind != "dense"}
    if kind == "key_mask":
        keep = torch.rand(1, 1, 2048, device=DEV) > 0.3
        keep[..., 0] = True
        kw["key_mask"] = keep
    if kind == "layout":
        kw["layout"] = BlockLayout.random_causal(2048, 128, 0.3, heads=9, seed=1).to(DEV)
    if kind == "decode":
        q = q[:, :, -1:].detach().requires_grad_(True)
    o, lse = litctx_kernels.attention(q, k, v, **kw)
    ref_kw = dict(kw)
    if "key_mask" in ref_kw:
        ref_kw["key_mask"] = ref_kw["key_mask"].expand(1, 9, 2048)
    _check(o, lse, q, k, v, RATIO[torch.bfloat16], **ref_kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fine_layout_at_the_tuned_tile(dtype):
    """SALE's 64 x 32 layout run at K1's tuned forward tile (``triton_tile``, compiled) equals the fine layout's
    attention (float64 reference) and K1 at the layout's own blocks."""
    from bench.gpu_routing import sparse_layout, tuned_tile
    from litctx_kernels.triton.attention import triton_attention

    q, k, v = (t.detach() for t in _qkv(4096, dtype))
    layout = sparse_layout(4096, (64, 32), 0.1, heads=9, seed=1, device=DEV)
    tile = tuned_tile(64, dtype)
    o, lse = triton_attention(q, k, v, causal=True, layout=layout, tile=tile)
    o_ref, lse_ref = attention_reference(q.double(), k.double(), v.double(), causal=True, layout=layout)
    assert_attention_close(o.double(), lse.double(), o_ref, lse_ref, RATIO[dtype])
    o_fine, _ = triton_attention(q, k, v, causal=True, layout=layout)
    assert_close(o.double(), o_fine.double(), RATIO[dtype], name="tile vs fine tiles")
