"""Compiled fused block estimates on CUDA at realistic lengths (N = 4K-16K): Prism, the mean-pooled estimate and
XAttention against the torch references on the same GPU.

Run on a GPU machine with ``pytest -m gpu tests/kernels/test_estimate_gpu.py`` (``TRITON_INTERPRET`` unset; part of
``bench/gpu_check.sh``'s ``-m gpu`` run). The kernels sum in a different order than torch, so a block whose mass
before it sits within float rounding of the top-p threshold may go either way: every differing block must be such a
near tie of the reference's own probabilities (and there must be few of them).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.kernels._triton_env import compiled_cuda_device

pytestmark = pytest.mark.gpu
DEV = compiled_cuda_device()

from litctx_kernels.reference.estimate import (  # noqa: E402
    causal_block_softmax,
    mean_pool_layout_reference,
    pool_blocks,
    prism_band_logits,
    prism_layout_reference,
    xattention_block_scores,
    xattention_layout_reference,
)
from litctx_kernels.triton.estimate import (  # noqa: E402
    triton_mean_pool_layout,
    triton_pool_blocks,
    triton_prism_layout,
    triton_xattention_layout,
)
from lightning_modules.sparse_prefill.config import PrismConfig, XAttentionConfig  # noqa: E402
from lightning_modules.sparse_prefill.synthetic import HEAD_KINDS, structured_heads  # noqa: E402


@functools.lru_cache(maxsize=8)
def _cpu_inputs(b, hq, hk, n, d, seed, structured):
    """float32 CPU ``q, k`` (the structured heads take seconds to build at 16K: built once per case)."""
    if structured:
        q, k, _, _ = structured_heads((HEAD_KINDS * 2)[:hq], n=n, d=d, seed=seed)
        return q, k[:, :: hq // hk].contiguous()
    gen = torch.Generator().manual_seed(seed)

    def make(h):  # noise plus a component shared by 48-token segments (it survives pooling)
        seg = torch.randn(b, h, (n + 47) // 48, d, generator=gen).repeat_interleave(48, 2)[:, :, :n]
        return torch.randn(b, h, n, d, generator=gen) + 2.0 * seg

    return make(hq), make(hk)


def _inputs(b, hq, hk, n, d, dtype, seed, structured=False):
    q, k = _cpu_inputs(b, hq, hk, n, d, seed, structured)
    return q.to(DEV, dtype), k.to(DEV, dtype)


def _mass_before(probs: torch.Tensor) -> torch.Tensor:
    """The reference's mass before every entry of each row (stable descending sort), in entry order."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    before = torch.empty_like(probs)
    before.scatter_(-1, order, sorted_p.cumsum(-1) - sorted_p)
    return before


def _check(got, want, row_probs, p, tol=2e-4):
    """Same blocks, except near ties: each differing block sits within ``tol`` of ``p`` in some band."""
    gm, wm = got.to_block_mask(), want.to_block_mask()
    diff = gm != wm
    n_diff = int(diff.sum())
    if n_diff:
        near = torch.zeros_like(diff)
        for probs in row_probs:
            near |= (_mass_before(probs) - p).abs() < tol
        assert bool(near[diff].all()), f"{n_diff} blocks differ, not all near the top-p threshold"
    assert n_diff <= max(2, wm.sum() // 1000), f"{n_diff} of {int(wm.sum())} blocks differ"
    same_rows = (diff.sum(-1) == 0)
    assert torch.equal(got.kv_num_blocks[same_rows], want.kv_num_blocks[same_rows])


CASES = [  # b, hq, hk, n, d, block, dtype, structured
    (1, 8, 2, 4096, 64, 128, torch.bfloat16, False),
    (1, 8, 8, 8192, 128, 128, torch.float16, True),
    (2, 4, 2, 6000, 64, 64, torch.float32, False),
    (1, 9, 3, 16384, 64, 128, torch.bfloat16, True),  # SmolLM2's heads at 16K
]
IDS = [f"n{c[3]}-{str(c[6])[6:]}-b{c[5]}{'-structured' if c[7] else ''}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_prism_and_mean_pool_compiled(case):
    b, hq, hk, n, d, block, dtype, structured = case
    q, k = _inputs(b, hq, hk, n, d, dtype, 1, structured)
    qb, kb = triton_pool_blocks(q, k, block)
    rq, rk = pool_blocks(q, block), pool_blocks(k, block)
    torch.testing.assert_close(qb, rq, rtol=1e-5, atol=1e-6 * float(q.float().abs().max()))
    torch.testing.assert_close(kb, rk, rtol=1e-5, atol=1e-6 * float(k.float().abs().max()))
    kw = dict(block=block, top_p=0.95, high_fraction=0.5, low_fraction=0.75, calibrate=True, temperatures=True)
    got, tau = triton_prism_layout(q, k, **kw)
    want, tau_ref = prism_layout_reference(q, k, **kw)
    torch.testing.assert_close(tau, tau_ref, rtol=1e-4, atol=0)
    bands = prism_band_logits(rq, rk.repeat_interleave(hq // hk, 1), 0.5, 0.75, True)
    _check(got, want, [causal_block_softmax(bands["high"]), causal_block_softmax(bands["low"])], 0.95)
    scale = d ** -0.5
    got = triton_mean_pool_layout(q, k, block=block, top_p=0.9, scale=scale)
    want = mean_pool_layout_reference(q, k, block=block, top_p=0.9, scale=scale)
    logits = torch.matmul(rq, rk.repeat_interleave(hq // hk, 1).transpose(-1, -2)) * scale
    _check(got, want, [causal_block_softmax(logits)], 0.9)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_xattention_compiled(case):
    b, hq, hk, n, d, block, dtype, structured = case
    q, k = _inputs(b, hq, hk, n, d, dtype, 1, structured)
    stride = 8 if block == 128 else 4
    kw = dict(block=block, stride=stride, threshold=0.9, scale=d ** -0.5)
    got, scores = triton_xattention_layout(q, k, scores=True, **kw)
    ref = xattention_block_scores(q, k, block=block, stride=stride, scale=d ** -0.5)
    torch.testing.assert_close(scores, ref, rtol=1e-3, atol=1e-5)
    want = xattention_layout_reference(q, k, **kw)
    total = ref.sum(-1, keepdim=True)
    _check(got, want, [ref / total.clamp_min(1e-30)], 0.9)


def test_estimators_run_fused_on_cuda():
    q, k = _inputs(1, 4, 2, 8192, 64, torch.bfloat16, 3, False)
    for cfg in (PrismConfig(top_p=0.95), XAttentionConfig(threshold=0.9)):
        est = cfg.estimator()
        assert est._use_fused(q)
        sel = est.select(q, k, k, 0.125)
        est.backend = "torch"
        ref = est.select(q, k, k, 0.125)
        diff = int((sel.layout.to_block_mask() != ref.layout.to_block_mask()).sum())
        assert diff <= 2
        assert sel.seconds > 0 and ref.seconds > 0
