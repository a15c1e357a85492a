"""K4 (``litctx_kernels.triton.lowbit``): SALE's fused low-bit estimate against the reference, flag for flag."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.interpret

from tests.kernels._triton_env import triton_device  # noqa: E402

DEVICE = triton_device()
INTERPRET = DEVICE == "cpu"

from litctx_kernels import lowbit_block_estimate, lowbit_block_estimate_reference  # noqa: E402
from litctx_kernels.triton.lowbit import triton_lowbit_block_estimate  # noqa: E402

CASES = [  # b, hq, hk, n_q, n_k, d, block_q, block_k, causal, bits, group, keys_per_step
    (1, 2, 1, 200, 200, 16, 32, 16, True, 4, 1, 1),
    (2, 4, 2, 130, 130, 24, 16, 16, True, 8, 1, 2),    # GQA, int8, head dim not a power of two
    (1, 3, 3, 70, 150, 16, 16, 32, True, 4, 4, 1),     # Nq < Nk: bottom-right causal; grouped scales
    (1, 2, 2, 96, 77, 8, 32, 16, False, 4, 1, 4),      # non-causal, ragged keys, several key blocks per step
    (1, 2, 1, 128, 128, 64, 64, 32, True, 4, 1, 1),    # SALE's tile and head size
]


def _inputs(case, dtype, seed):
    b, hq, hk, n_q, n_k, d = case[:6]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n_q, d, generator=gen) * 1.5
    k = torch.randn(b, hk, n_k, d, generator=gen) * 1.5
    lse = torch.randn(b, hq, n_q, generator=gen) + 2.0
    return q.to(dtype).to(DEVICE), k.to(dtype).to(DEVICE), lse.to(DEVICE)


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_fused_estimate_equals_the_reference(case):
    hq = case[1]
    block_q, block_k, causal, bits, group, kb = case[6:]
    for seed in range(2):
        q, k, lse = _inputs(case, torch.float32, seed)
        tau = torch.tensor([0.0, 200.0, 2.0][:hq] + [20.0] * max(0, hq - 3), dtype=torch.float64)
        kw = dict(scale=0.3, block_q=block_q, block_k=block_k, bits=bits, group_size=group, causal=causal)
        want = lowbit_block_estimate_reference(q, k, lse, tau, **kw).to_block_mask()
        got = triton_lowbit_block_estimate(q, k, lse, tau, keys_per_step=kb, **kw).to_block_mask()
        if INTERPRET:  # same float32 operations in the same order: the same flags
            assert torch.equal(got, want)
        else:  # compiled: a fused multiply-add may move a pair sitting on the threshold
            assert int((got != want).sum()) <= max(1, want.numel() // 500)
        assert int(want.sum()) > 0
        assert int(want[:, 1:].sum()) < want[:, 1:].numel()  # the thresholds drop something


def test_fused_estimate_takes_half_precision_and_a_row_without_exact_keys():
    case = (1, 2, 1, 96, 96, 32, 32, 16, True, 4, 1, 1)
    q, k, lse = _inputs(case, torch.float16, 5)
    lse[0, 1, 40] = float("-inf")  # a row the exact pass did not cover: its RAS is +inf (reference semantics)
    kw = dict(block_q=32, block_k=16)
    want = lowbit_block_estimate_reference(q, k, lse, 0.05, **kw).to_block_mask()
    got = triton_lowbit_block_estimate(q, k, lse, 0.05, **kw).to_block_mask()
    assert torch.equal(got, want) if INTERPRET else int((got != want).sum()) <= 1
    assert bool(want[0, 1, 1, :3].all())


def test_the_dispatcher_runs_the_fused_estimate_when_asked():
    case = CASES[0]
    q, k, lse = _inputs(case, torch.float32, 1)
    kw = dict(block_q=32, block_k=16)
    want = lowbit_block_estimate_reference(q, k, lse, 0.5, **kw).to_block_mask()
    got = lowbit_block_estimate(q, k, lse, 0.5, backend="triton", **kw).to_block_mask()
    assert torch.equal(got, want) if INTERPRET else int((got != want).sum()) <= 1


def test_fused_estimate_names_bad_inputs():
    q, k, lse = _inputs(CASES[0], torch.float32, 0)
    with pytest.raises(ValueError, match="powers of two"):
        triton_lowbit_block_estimate(q, k, lse, 0.1, block_q=48, block_k=16)
    with pytest.raises(ValueError, match="lse must be"):
        triton_lowbit_block_estimate(q, k, lse[..., :5], 0.1, block_q=32, block_k=16)
    with pytest.raises(ValueError, match="keys_per_step"):
        triton_lowbit_block_estimate(q, k, lse, 0.1, block_q=32, block_k=16, keys_per_step=3)
