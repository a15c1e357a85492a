"""The fast low-bit block estimate against the reference definition (SALE's selection pass)."""

from __future__ import annotations

import math

import pytest
import torch

from litctx_kernels import lowbit_block_estimate, lowbit_block_estimate_reference
from litctx_kernels.reference.lowbit import lowbit_scores_reference, quantize_qk_lowbit

CASES = [  # b, hq, hk, n_q, n_k, d, block_q, block_k, causal, bits, group
    (1, 2, 1, 200, 200, 16, 32, 16, True, 4, 1),
    (2, 4, 2, 130, 130, 8, 16, 8, True, 8, 1),
    (1, 3, 3, 70, 150, 16, 16, 32, True, 4, 4),   # Nq < Nk: bottom-right causal
    (1, 2, 2, 96, 77, 8, 32, 16, False, 4, 1),    # non-causal, ragged keys
    (1, 2, 1, 64, 64, 16, 64, 32, True, 4, 1),    # one query block
]


def _inputs(case, dtype, seed):
    b, hq, hk, n_q, n_k, d = case[:6]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n_q, d, generator=gen, dtype=torch.float64) * 1.5
    k = torch.randn(b, hk, n_k, d, generator=gen, dtype=torch.float64) * 1.5
    lse = torch.randn(b, hq, n_q, generator=gen, dtype=torch.float64) + 2.0
    return q.to(dtype), k.to(dtype), lse.to(dtype)


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_fast_estimate_equals_the_reference_in_float64(case):
    _, hq, *_rest = case
    block_q, block_k, causal, bits, group = case[6:]
    for seed in range(3):
        q, k, lse = _inputs(case, torch.float64, seed)
        tau = torch.tensor([0.0, 200.0, 2.0][:hq] + [20.0] * max(0, hq - 3), dtype=torch.float64)
        kw = dict(scale=0.3, block_q=block_q, block_k=block_k, bits=bits, group_size=group, causal=causal)
        want = lowbit_block_estimate_reference(q, k, lse, tau, **kw).to_block_mask()
        got = lowbit_block_estimate(q, k, lse, tau, chunk_rows=block_q * 2, **kw).to_block_mask()
        assert torch.equal(got, want)
        assert int(want.sum()) > 0
        if want[0, 0].numel() >= 8:  # on larger grids the thresholds also skip something
            assert int(want.sum()) < want.numel()


def test_fast_estimate_differs_from_the_reference_only_at_float_ties():
    case = (1, 4, 2, 256, 256, 32, 32, 16, True, 4, 1)
    q, k, lse = _inputs(case, torch.float32, 7)
    scale = 32 ** -0.5
    tau = 0.01
    want = lowbit_block_estimate_reference(q, k, lse, tau, scale=scale, block_q=32, block_k=16).to_block_mask()
    got = lowbit_block_estimate(q, k, lse, tau, scale=scale, block_q=32, block_k=16, chunk_rows=100).to_block_mask()
    diff = torch.nonzero(got != want).tolist()
    if diff:  # every disagreement: the block's best pair is within rounding of the threshold
        lb = quantize_qk_lowbit(q.double(), k.double(), 4, 1)
        for bb, h, mi, mj in diff:
            ras = scale * lowbit_scores_reference(lb, slice(mi * 32, (mi + 1) * 32))[bb, h] - lse[bb, h, mi * 32:(mi + 1) * 32].double().unsqueeze(-1)
            rows = torch.arange(mi * 32, (mi + 1) * 32).view(-1, 1)
            cols = torch.arange(256).view(1, -1)
            blk = ras.masked_fill(cols > rows, -math.inf)[:, mj * 16:(mj + 1) * 16]
            assert abs(float(blk.max()) - math.log(tau)) < 1e-4
    assert len(diff) <= 2


def test_fast_estimate_names_bad_inputs():
    q, k, lse = _inputs((1, 2, 1, 64, 64, 8), torch.float32, 0)
    with pytest.raises(ValueError, match="lse must be"):
        lowbit_block_estimate(q, k, lse[..., :10], 0.1)
    with pytest.raises(ValueError, match="tau must be"):
        lowbit_block_estimate(q, k, lse, [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="chunk_rows"):
        lowbit_block_estimate(q, k, lse, 0.1, chunk_rows=0)


PRUNE_CASES = [  # b, hq, hk, n_q, n_k, d, block_q, block_k, causal, chunk_rows
    (1, 4, 2, 700, 700, 32, 32, 16, True, 128),
    (2, 3, 1, 300, 420, 16, 16, 32, True, 64),    # Nq < Nk: bottom-right causal
    (1, 2, 2, 256, 200, 16, 32, 16, False, 96),   # non-causal, ragged keys
]


def _structured(case, seed):
    """Attention-like inputs: queries share a direction, a few keys (every 37th and the first) point along it
    and the rest are weak, so most tiles hold no key a row attends to; ``lse`` is the exact attention's over
    every key (``tau`` is then a share of the true probability mass)."""
    from litctx_kernels.reference import attention_reference

    b, hq, hk, n_q, n_k, d = case[:6]
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(d, generator=gen)
    direction = direction / direction.norm()
    q = torch.randn(b, hq, n_q, d, generator=gen) + 4 * direction
    k = torch.randn(b, hk, n_k, d, generator=gen) * 0.7
    heavy = torch.zeros(n_k, dtype=torch.bool)
    heavy[::37] = True
    k[:, :, heavy] += 4 * direction
    lse = attention_reference(q, k, k, causal=case[8])[1]
    return q, k, lse


@pytest.mark.parametrize("case", PRUNE_CASES, ids=[f"case{i}" for i in range(len(PRUNE_CASES))])
def test_exact_bound_keeps_the_flags_bit_identical(case):
    block_q, block_k, causal, chunk = case[6:]
    hq = case[1]
    flagged = tiles = 0
    for seed in range(4):
        q, k, lse = _structured(case, seed)
        tau = torch.tensor([0.01, 0.001, 0.1, 0.0][:hq], dtype=torch.float64)
        kw = dict(block_q=block_q, block_k=block_k, causal=causal, chunk_rows=chunk, backend="torch")
        pruned = lowbit_block_estimate(q, k, lse, tau, prune=True, **kw).to_block_mask()
        full = lowbit_block_estimate(q, k, lse, tau, prune=False, **kw).to_block_mask()
        assert torch.equal(pruned, full)
        flagged, tiles = flagged + int(full.sum()), tiles + full.numel()
    assert 0 < flagged < tiles


def test_the_box_bound_is_above_every_logit_and_rules_tiles_out():
    from litctx_kernels.lowbit_estimate import _key_boxes

    q, k, lse = _structured((1, 2, 2, 256, 256, 16, 32, 16, True), 3)
    lb = quantize_qk_lowbit(q.double(), k.double(), 4, 1)
    qa = torch.cat([lb.q_int.double() * lb.q_scale.unsqueeze(-1), torch.ones(1, 2, 256, 1, dtype=torch.float64)], -1)
    ka = torch.cat([lb.k_int.double() * lb.k_scale.unsqueeze(-1), lb.bias.unsqueeze(-1)], -1)
    centre, half, _ = _key_boxes(ka, 16)
    bound = qa @ centre.transpose(-1, -2) + qa.abs() @ half.transpose(-1, -2)  # [1, 2, 256, 16]
    exact = (qa @ ka.transpose(-1, -2)).view(1, 2, 256, 16, 16).amax(-1)
    assert bool((bound >= exact - 1e-9).all())
    # not vacuous: somewhere the bound sits below the best logit of another key block of the same row
    assert bool((bound < exact.amax(-1, keepdim=True)).any())


def test_backend_names_the_tile_rule_for_triton():
    q, k, lse = _inputs((1, 2, 1, 64, 64, 8), torch.float32, 0)
    with pytest.raises(RuntimeError, match="powers of two"):
        lowbit_block_estimate(q, k, lse, 0.1, block_q=24, block_k=16, backend="triton")
    ref = lowbit_block_estimate(q, k, lse, 0.1, block_q=16, block_k=16, backend="reference").to_block_mask()
    want = lowbit_block_estimate_reference(q, k, lse, 0.1, block_q=16, block_k=16).to_block_mask()
    assert torch.equal(ref, want)
