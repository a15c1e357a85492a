"""No op materialises an N x N attention matrix on long inputs: every tensor that any aten op produces during
forward and backward is recorded (a TorchDispatchMode) and must stay well below N^2 elements."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import litctx_kernels
from litctx_kernels import BlockLayout, QueryIndex
from litctx_kernels.reference import attention_colstats_reference, attention_reference

N = 8192


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0
        self.op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), str(func)
        return out


def qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 1, N, 16, generator=g).requires_grad_(True) for _ in range(3)]


@pytest.mark.parametrize("case", ["dense", "window", "layout", "layout_flash_calls", "reference", "reference_lssa",
                                  "q_index", "colstats", "key_mask", "key_mask_window"])
def test_peak_tensor_is_subquadratic(case, monkeypatch):
    """``window`` and ``layout`` run the native forward and backward of ``litctx_kernels.cpu_sparse`` (when it
    builds), ``layout_flash_calls`` the flash-call path and its backward."""
    if case == "layout_flash_calls":
        from litctx_kernels.cpu_sparse import NATIVE_ENV

        monkeypatch.setenv(NATIVE_ENV, "0")
        case = "layout"
    q, k, v = qkv()
    mode = LargestTensor()
    with mode:
        if case == "dense":
            o, _ = litctx_kernels.attention(q, k, v)
        elif case == "window":
            o, _ = litctx_kernels.attention(q, k, v, window=512)
        elif case == "layout":
            o, _ = litctx_kernels.attention(q, k, v, layout=BlockLayout.random_causal(N, 128, 0.1))
        elif case == "reference":
            o, _ = attention_reference(q, k, v, layout=BlockLayout.random_causal(N, 128, 0.3), chunk=128)
        elif case == "reference_lssa":
            o, _ = attention_reference(q, k, v, score_mode="lssar", chunk=128)
        elif case in ("key_mask", "key_mask_window"):  # left padding plus random holes (the fused CPU paths)
            keep = torch.rand(1, 1, N, generator=torch.Generator().manual_seed(2)) < 0.7
            keep[..., : N // 4] = False
            o, _ = litctx_kernels.attention(q, k, v, key_mask=keep, window=512 if case == "key_mask_window" else None)
        elif case == "q_index":
            qi = QueryIndex.from_mask(torch.rand(1, 1, N, generator=torch.Generator().manual_seed(1)) < 0.2)
            o, _ = litctx_kernels.attention(q, k, v, q_index=qi)
        else:
            st = attention_colstats_reference(q.detach(), k.detach(), v.detach(), q_window=1024)
            o = st.p2_o
        if o.requires_grad:
            o.sum().backward()
    assert mode.largest < N * N // 8, f"{case}: {mode.op} produced a tensor of {mode.largest} elements"
