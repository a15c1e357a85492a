"""K1/K2 with a per-key mask (``triton_attention(..., key_mask=...)`` and the dispatcher's triton route) against
the chunked torch reference in float64.

Runs in the Triton interpreter on CPU (``TRITON_INTERPRET=1 pytest -m interpret tests/kernels``) or compiled on
CUDA when ``TRITON_INTERPRET`` is unset and a GPU is present. Small shapes (N <= 96): the interpreter executes every
program instance in Python.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.interpret

from tests.kernels._triton_env import triton_device  # noqa: E402

DEVICE = triton_device()

import litctx_kernels  # noqa: E402
from litctx_kernels.dispatch import expand_key_mask  # noqa: E402
from litctx_kernels.layouts import BlockLayout, QueryIndex  # noqa: E402
from litctx_kernels.reference import attention_reference  # noqa: E402
from litctx_kernels.testing import assert_attention_close, assert_close  # noqa: E402
from litctx_kernels.triton.attention import triton_attention  # noqa: E402

RATIO = {torch.float32: 1e-5, torch.float16: 5e-3}


def _qkv(b, hq, hk, n_q, n_k, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for h, n in ((hq, n_q), (hk, n_k), (hk, n_k)))
    return tuple(t.to(device=DEVICE, dtype=dtype) for t in (q, k, v))


def _reference(q, k, v, keep, **kw):
    return attention_reference(q.double(), k.double(), v.double(), key_mask=expand_key_mask(keep, q, k), **kw)


def _compare(o, lse, o_ref, lse_ref, dtype, what):
    assert_attention_close(o, lse, o_ref, lse_ref, RATIO[dtype], name=what)
    if dtype == torch.float32:  # the acceptance bound of the fused CPU path holds here too
        torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)


CASES = {
    # name: (b, hq, hk, n_q, n_k, kwargs)
    "prefill": (2, 4, 2, 64, 64, {}),
    "decode": (2, 4, 2, 1, 80, {}),
    "decode_inner_offset": (2, 4, 2, 1, 80, {"q_offset": 30}),
    "append": (2, 4, 2, 16, 80, {}),
    "window": (2, 4, 2, 64, 64, {"window": 20}),
    "noncausal": (2, 4, 1, 8, 72, {"causal": False}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_key_mask_forward(case, dtype):
    b, hq, hk, n_q, n_k, kw = CASES[case]
    q, k, v = _qkv(b, hq, hk, n_q, n_k, 16, dtype)
    gen = torch.Generator().manual_seed(1)
    for heads in (1, hk, hq):
        keep = (torch.rand(b, heads, n_k, generator=gen) > 0.4).to(DEVICE)
        keep[0, 0, : n_k // 2] = False  # early rows of head 0 lose all their keys
        o, lse = triton_attention(q, k, v, key_mask=keep, **kw)
        _compare(o, lse, *_reference(q, k, v, keep, **kw), dtype, f"{case} mask heads={heads}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_left_padded_batch_through_the_dispatcher(dtype):
    """The policy runner's call: causal, ``key_mask [B, Hk, Nk]`` with left padding and a fully masked row."""
    b, hq, hk, n = 3, 4, 2, 48
    q, k, v = _qkv(b, hq, hk, n, n, 16, dtype, seed=2)
    keep = torch.zeros(b, hk, n, dtype=torch.bool, device=DEVICE)
    keep[0, :, :] = True
    keep[1, :, 20:] = True  # 20 padding tokens
    # row 2: all keys masked
    o, lse = litctx_kernels.attention(q, k, v, key_mask=keep, backend="triton")
    _compare(o, lse, *_reference(q, k, v, keep), dtype, "left-padded")
    assert not bool(torch.isfinite(lse[2]).any())


def test_key_mask_with_layout_and_query_index():
    q, k, v = _qkv(1, 2, 1, 64, 64, 16, torch.float32, seed=3)
    keep = (torch.rand(1, 1, 64, generator=torch.Generator().manual_seed(4)) > 0.3).to(DEVICE)
    layout = BlockLayout.random_causal(64, 16, 0.6, heads=2, seed=1).to(DEVICE)
    o, lse = triton_attention(q, k, v, layout=layout, key_mask=keep)
    _compare(o, lse, *_reference(q, k, v, keep, layout=layout), torch.float32, "layout")
    route = (torch.rand(1, 2, 64, generator=torch.Generator().manual_seed(5)) > 0.5).to(DEVICE)
    qi = QueryIndex.from_mask(route)
    o, lse = triton_attention(q, k, v, q_index=qi, key_mask=keep)
    _compare(o, lse, *_reference(q, k, v, keep, q_index=qi), torch.float32, "q_index")


@pytest.mark.parametrize("kw", [{}, {"window": 12}, {"causal": False}])
def test_key_mask_gradients(kw):
    """dq, dk, dv (through o and through lse) against the reference's autograd, fp32."""
    n_q = 8 if kw.get("causal") is False else 40
    q, k, v = _qkv(2, 4, 2, n_q, 40, 16, torch.float32, seed=6)
    keep = (torch.rand(2, 2, 40, generator=torch.Generator().manual_seed(7)) > 0.35).to(DEVICE)
    keep[1, 0] = False
    weights = torch.randn(2, 4, n_q, 16, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    grads = []
    for fn in ("triton", "reference"):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        if fn == "triton":
            o, lse = triton_attention(qq, kk, vv, key_mask=keep, **kw)
        else:
            o, lse = _reference(qq, kk, vv, keep, **kw)
        live = torch.isfinite(lse)
        loss = (o * weights).sum() + 0.5 * torch.where(live, lse, torch.zeros_like(lse)).sum()
        grads.append(torch.autograd.grad(loss, (qq, kk, vv)))
    for name, a, e in zip("qkv", *grads):
        assert_close(a, torch.nan_to_num(e), 1e-5, atol=1e-7, name=f"d{name}")


def test_bad_key_mask_is_named():
    q, k, v = _qkv(1, 4, 2, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match=r"key_mask must be \[B, 1\|Hk\|Hq, Nk\] = \[1, 1\|2\|4, 8\], got \[1, 3, 8\]"):
        triton_attention(q, k, v, key_mask=torch.ones(1, 3, 8, dtype=torch.bool, device=DEVICE))
