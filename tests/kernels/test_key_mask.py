"""``kernels.attention`` with a per-key mask, and the CPU flash path for GQA and single-query decode steps,
against a float64 brute force."""

from __future__ import annotations

import pytest
import torch

import kernels
from tests.kernels._brute import brute_attention, brute_mask


def _brute(q, k, v, keep, causal=True):
    """The shared float64 brute force, with the element mask ``causal x keep [B, Hq, Nk]``."""
    valid = brute_mask(q.shape[2], k.shape[2], causal=causal) & keep.unsqueeze(2)
    return brute_attention(q, k, v, valid)[0]


@pytest.mark.parametrize("mask_heads", ["one", "kv", "q"])
def test_key_mask_matches_brute_force(mask_heads):
    gen = torch.Generator().manual_seed(0)
    b, hq, hk, nq, nk, d = 2, 6, 2, 5, 9, 8
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for h, n in ((hq, nq), (hk, nk), (hk, nk)))
    heads = {"one": 1, "kv": hk, "q": hq}[mask_heads]
    mask = torch.rand(b, heads, nk, generator=gen) > 0.3
    mask[..., -1] = True  # every row keeps at least its own newest key
    o, lse = kernels.attention(q, k, v, causal=True, key_mask=mask)
    keep = mask.expand(b, hq, nk) if heads == 1 else mask.repeat_interleave(hq // heads, 1)
    torch.testing.assert_close(o.double(), _brute(q, k, v, keep), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="key_mask must be"):
        kernels.attention(q, k, v, key_mask=torch.ones(b, 4, nk, dtype=torch.bool))


@pytest.mark.parametrize("nq", [1, 7])
def test_cpu_flash_path_serves_gqa_prefill_and_decode(nq):
    gen = torch.Generator().manual_seed(1)
    b, hq, hk, d = 1, 9, 3, 16
    nk = nq if nq > 1 else 12
    q = torch.randn(b, hq, nq, d, generator=gen)
    k, v = torch.randn(b, hk, nk, d, generator=gen), torch.randn(b, hk, nk, d, generator=gen)
    o, _ = kernels.attention(q, k, v, causal=True)
    torch.testing.assert_close(o.double(), _brute(q, k, v, torch.ones(b, hq, nk, dtype=torch.bool)), atol=1e-5,
                               rtol=1e-5)
