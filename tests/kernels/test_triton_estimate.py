"""Fused block estimates (``litctx_kernels.triton.estimate``): Prism's dual band, the mean-pooled estimate and
XAttention, layout for layout against the torch references and the estimators' own (torch) selection.

Interpreter (``TRITON_INTERPRET=1``) or compiled on CUDA; small shapes (N = 512-1024, blocks 64/128, GQA, N not a
multiple of the block), random and RoPE-rotated structured inputs, fp32 and fp16.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.interpret

from tests.kernels._triton_env import triton_device  # noqa: E402

DEVICE = triton_device()

from litctx_kernels.block_estimate import mean_pool_layout, prism_layout, xattention_layout  # noqa: E402
from litctx_kernels.reference.estimate import (  # noqa: E402
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
from lightning_modules.sparse_prefill.config import MeanPoolConfig, PrismConfig, XAttentionConfig  # noqa: E402
from lightning_modules.sparse_prefill.synthetic import HEAD_KINDS, structured_heads  # noqa: E402

CASES = [  # b, hq, hk, n, d, block, kind, dtype
    (1, 2, 1, 512, 32, 64, "random", torch.float32),
    (2, 2, 1, 700, 32, 128, "random", torch.float16),      # GQA, N not a multiple of the block, batch 2
    (1, 3, 3, 600, 32, 64, "structured", torch.float16),   # RoPE-rotated slash heads, ragged last block
    (1, 4, 2, 1024, 64, 128, "structured", torch.float32),  # GQA over structured heads (slash, local, sink)
]
IDS = [f"{c[6]}-n{c[3]}-b{c[5]}-h{c[1]}x{c[2]}-{str(c[7])[6:]}" for c in CASES]


def _inputs(case, seed=0):
    b, hq, hk, n, d, block, kind, dtype = case
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":  # noise plus a component shared by 48-token segments (it survives pooling)
        def make(h):
            seg = torch.randn(b, h, (n + 47) // 48, d, generator=gen).repeat_interleave(48, 2)[:, :, :n]
            return torch.randn(b, h, n, d, generator=gen) + 2.0 * seg

        q, k = make(hq), make(hk)
    else:
        q, k, _, _ = structured_heads(HEAD_KINDS[:hq], n=n, d=d, seed=seed)
        k = k[:, :: hq // hk]  # GQA: one kv head per group (its first member's keys)
    return q.to(dtype).to(DEVICE), k.contiguous().to(dtype).to(DEVICE)


def _same_layout(got, want, where=""):
    """Same blocks, counts and (ascending) indices; ``got`` is padded to ``M`` columns."""
    assert got.seq_lens == want.seq_lens and (got.block_q, got.block_k) == (want.block_q, want.block_k)
    gm, wm = got.to_block_mask(), want.to_block_mask()
    bad = (gm != wm).nonzero().tolist()
    assert not bad, f"{where}: {len(bad)} blocks differ, first (b, h, I, J) {bad[:5]}"
    assert torch.equal(got.kv_num_blocks, want.kv_num_blocks)
    kmax = want.kv_indices.shape[-1]
    assert torch.equal(got.kv_indices[..., :kmax], want.kv_indices)
    assert bool((got.kv_indices[..., kmax:] == -1).all())


def _sparse(layout):
    """The selection drops something (the test is not trivially the causal layout)."""
    m = layout.num_q_blocks
    assert int(layout.kv_num_blocks.sum()) < layout.kv_num_blocks.numel() * (m + 1) // 2


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_prism_fused_equals_reference_and_estimator(case):
    q, k = _inputs(case)
    block = case[5]
    cfg = PrismConfig(block=block, top_p=0.9)
    kw = dict(block=block, top_p=0.9, high_fraction=cfg.high_fraction, low_fraction=cfg.low_fraction,
              calibrate=True, temperatures=True)
    got, tau = triton_prism_layout(q, k, **kw)
    want, tau_ref = prism_layout_reference(q, k, **kw)
    _same_layout(got, want, "fused vs reference")
    torch.testing.assert_close(tau, tau_ref, rtol=1e-5, atol=0)
    est = cfg.estimator()
    mask, info = est.selected_block_mask(q, k, 0.1)
    assert torch.equal(want.to_block_mask(), mask)  # the reference is the estimator's torch path
    est.backend = "triton"
    sel = est.select(q, k, k, 0.1)
    _same_layout(sel.layout, want, "estimator (fused)")
    assert sel.info["tau_low"] == pytest.approx(info["tau_low"], rel=1e-5)
    _sparse(got)


def test_prism_without_calibration():
    q, k = _inputs(CASES[2][:7] + (torch.float32,), seed=1)
    kw = dict(block=64, top_p=0.8, high_fraction=0.5, low_fraction=0.75, calibrate=False, temperatures=True)
    got, tau = triton_prism_layout(q, k, **kw)
    want, _ = prism_layout_reference(q, k, **kw)
    _same_layout(got, want)
    assert bool((tau == 1).all())


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_mean_pool_fused_equals_reference_and_estimator(case):
    q, k = _inputs(case, seed=2)
    block, scale = case[5], case[4] ** -0.5
    got = triton_mean_pool_layout(q, k, block=block, top_p=0.9, scale=scale)
    want = mean_pool_layout_reference(q, k, block=block, top_p=0.9, scale=scale)
    _same_layout(got, want)
    est = MeanPoolConfig(block=block, top_p=0.9).estimator()
    assert torch.equal(est.selected_block_mask(q, k, scale)[0], want.to_block_mask())
    est.backend = "triton"
    _same_layout(est.select(q, k, k, scale).layout, want, "estimator (fused)")
    _sparse(got)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_xattention_fused_equals_reference_and_estimator(case):
    q, k = _inputs(case, seed=3)
    block, scale = case[5], case[4] ** -0.5
    stride = 8 if block == 128 else 4  # T = 16 reshaped rows per block (128 / 8), and T = 16 at 64 / 4
    kw = dict(block=block, stride=stride, threshold=0.9, scale=scale)
    got, scores = triton_xattention_layout(q, k, scores=True, **kw)
    want = xattention_layout_reference(q, k, **kw)
    ref_scores = xattention_block_scores(q, k, block=block, stride=stride, scale=scale)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-4, atol=1e-5)
    _same_layout(got, want)
    est = XAttentionConfig(block=block, stride=stride, threshold=0.9, chunk_blocks=3).estimator()
    assert torch.equal(est.selected_block_mask(q, k, scale)[0], want.to_block_mask())
    est.backend = "triton"
    _same_layout(est.select(q, k, k, scale).layout, want, "estimator (fused)")
    _sparse(got)


def test_xattention_stride_and_block_that_are_not_powers_of_two():
    q, k = _inputs((1, 2, 1, 300, 16, 48, "random", torch.float32), seed=4)
    kw = dict(block=48, stride=6, threshold=0.8, scale=0.25)  # T = 8 rows per block, stride 6
    _same_layout(triton_xattention_layout(q, k, **kw), xattention_layout_reference(q, k, **kw))
    kw = dict(block=40, stride=4, threshold=0.8, scale=0.25)  # T = 10: padded to 16 inside the tile
    _same_layout(triton_xattention_layout(q, k, **kw), xattention_layout_reference(q, k, **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_pooling_and_energies(dtype):
    q, k = _inputs(CASES[1][:7] + (dtype,), seed=5)
    qb, kb = triton_pool_blocks(q, k, 128)
    for got, x in ((qb, q), (kb, k)):
        want = pool_blocks(x, 128)
        assert got.dtype == torch.float32 and got.shape == want.shape
        # within 1e-5 relative; means that cancel to near zero are held to the rounding of their summands
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(x.float().abs().max()))
    # the temperatures come from the kernel's block energies: compare them with the reference's RMS ratios
    _, tau = triton_prism_layout(q, k, block=128, top_p=0.9, high_fraction=0.5, low_fraction=0.75,
                                 temperatures=True)
    bands = prism_band_logits(pool_blocks(q, 128), pool_blocks(k, 128).repeat_interleave(2, 1), 0.5, 0.75, True)
    torch.testing.assert_close(tau, torch.stack([bands["tau_high"], bands["tau_low"]], -1), rtol=1e-5, atol=0)


def test_exact_ties_are_broken_by_index_like_a_stable_sort():
    """Identical key blocks make every causal logit of a row equal: the kept blocks are the lowest-indexed ones."""
    gen = torch.Generator().manual_seed(6)
    n, d, block = 640, 16, 64
    q = torch.randn(1, 2, n, d, generator=gen)
    vals = torch.tensor([-1.0, 0.5, 1.0, 0.25])
    k = vals[torch.randint(0, 4, (1, 1, 1, d), generator=gen)].expand(1, 1, n, d).contiguous()  # dyadic: exact means
    for p in (0.3, 0.5, 0.77):
        got = triton_mean_pool_layout(q.to(DEVICE), k.to(DEVICE), block=block, top_p=p, scale=0.2)
        want = mean_pool_layout_reference(q, k, block=block, top_p=p, scale=0.2)
        _same_layout(got.to("cpu"), want)
        m = math.ceil(n / block)
        for i in range(m):  # uniform rows: a prefix of the causal blocks (lowest indices first), plus the diagonal
            kept = set(want.kv_indices[0, 0, i, :int(want.kv_num_blocks[0, 0, i])].tolist()) - {i}
            assert kept == set(range(len(kept)))
            assert len(kept) < i + 1 or i == 0 or p > 0.5


def test_dispatch_chooses_fused_only_when_asked_on_cpu():
    q, k = _inputs(CASES[0])
    kw = dict(block=64, top_p=0.9, scale=0.2)
    _same_layout(mean_pool_layout(q, k, backend="triton", **kw), mean_pool_layout(q, k, backend="torch", **kw))
    _same_layout(prism_layout(q, k, block=64, top_p=0.9, high_fraction=0.5, low_fraction=0.75, backend="triton"),
                 prism_layout(q, k, block=64, top_p=0.9, high_fraction=0.5, low_fraction=0.75, backend="reference"))
    x = dict(block=64, stride=4, threshold=0.9, scale=0.2)
    _same_layout(xattention_layout(q, k, backend="triton", **x), xattention_layout(q, k, backend="torch", **x))
    if DEVICE == "cpu":  # auto on CPU tensors: the torch path (the estimator never runs the interpreter unasked)
        from litctx_kernels.block_estimate import block_estimate_backend

        assert block_estimate_backend(q) == "torch"


def test_bad_inputs_are_named():
    q, k = _inputs(CASES[0])
    with pytest.raises(ValueError, match="top_p"):
        triton_mean_pool_layout(q, k, block=64, top_p=0.0, scale=0.1)
    with pytest.raises(ValueError, match="multiple of its stride"):
        triton_xattention_layout(q, k, block=64, stride=5, threshold=0.9, scale=0.1)
    with pytest.raises(ValueError, match="kv heads"):
        triton_mean_pool_layout(q, k[:, :1].expand(1, 3, -1, -1)[:, :3], block=64, top_p=0.9, scale=0.1)


def test_strided_inputs_as_a_model_hands_them_over():
    """q, k transposed from ``[B, N, H, d]`` (not contiguous): the kernels read strides."""
    q, k = _inputs((1, 4, 2, 330, 16, 32, "random", torch.float32), seed=7)
    q, k = q.transpose(1, 2).contiguous().transpose(1, 2), k.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q.is_contiguous()
    for fused, ref, kw in ((triton_mean_pool_layout, mean_pool_layout_reference, dict(top_p=0.8, scale=0.3)),
                           (triton_prism_layout, prism_layout_reference,
                            dict(top_p=0.8, high_fraction=0.5, low_fraction=0.75)),
                           (triton_xattention_layout, xattention_layout_reference,
                            dict(stride=4, threshold=0.8, scale=0.3))):
        _same_layout(fused(q, k, block=32, **kw), ref(q, k, block=32, **kw), fused.__name__)
