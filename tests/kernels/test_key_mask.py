"""``litctx_kernels.attention`` with a per-key mask, and the CPU flash path for GQA and single-query decode steps,
against a float64 brute force."""

from __future__ import annotations

import pytest
import torch

import litctx_kernels
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
    o, lse = litctx_kernels.attention(q, k, v, causal=True, key_mask=mask)
    keep = mask.expand(b, hq, nk) if heads == 1 else mask.repeat_interleave(hq // heads, 1)
    torch.testing.assert_close(o.double(), _brute(q, k, v, keep), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="key_mask must be"):
        litctx_kernels.attention(q, k, v, key_mask=torch.ones(b, 4, nk, dtype=torch.bool))


@pytest.mark.parametrize("nq", [1, 7])
def test_cpu_flash_path_serves_gqa_prefill_and_decode(nq):
    gen = torch.Generator().manual_seed(1)
    b, hq, hk, d = 1, 9, 3, 16
    nk = nq if nq > 1 else 12
    q = torch.randn(b, hq, nq, d, generator=gen)
    k, v = torch.randn(b, hk, nk, d, generator=gen), torch.randn(b, hk, nk, d, generator=gen)
    o, _ = litctx_kernels.attention(q, k, v, causal=True)
    torch.testing.assert_close(o.double(), _brute(q, k, v, torch.ones(b, hq, nk, dtype=torch.bool)), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("hk,mask_heads", [(3, "kv"), (3, "one"), (9, "one"), (3, None)])
def test_short_append_after_a_cache_is_one_exact_flash_call(hk, mask_heads):
    """A few queries appended after a cache (a speculative verification): bottom-right causal among the new keys,
    every old key, a per-key mask with a row that has no valid key; values and LSE against the brute force, and
    gradients against the reference."""
    from litctx_kernels.dispatch import SHORT_APPEND_ROWS
    from litctx_kernels.reference import attention_reference

    gen = torch.Generator().manual_seed(3)
    b, hq, nq, nk, d = 2, 9, 5, 70, 16
    assert nq <= SHORT_APPEND_ROWS
    q = torch.randn(b, hq, nq, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hk, nk, d, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = None
    keep = torch.ones(b, hq, nk, dtype=torch.bool)
    if mask_heads is not None:
        heads = 1 if mask_heads == "one" else hk
        mask = torch.rand(b, heads, nk, generator=gen) > 0.4
        mask[1, :, :] = False
        mask[1, :, nk - nq + 2] = True  # row 1: queries 0 and 1 see no key at all
        keep = mask.expand(b, hq, nk) if heads == 1 else mask.repeat_interleave(hq // heads, 1)
    o, lse = litctx_kernels.attention(q, k, v, causal=True, key_mask=mask)
    want = _brute(q, k, v, keep)
    torch.testing.assert_close(o, want, atol=1e-10, rtol=1e-10)
    ro, rl = attention_reference(q, k, v, causal=True, key_mask=None if mask is None else keep)
    assert torch.equal(torch.isinf(lse), torch.isinf(rl))
    torch.testing.assert_close(torch.where(torch.isinf(lse), 0.0, lse), torch.where(torch.isinf(rl), 0.0, rl))
    if mask is None:  # gradients of the fused call against the reference's
        qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
        litctx_kernels.attention(qr, kr, vr, causal=True)[0].square().sum().backward()
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        attention_reference(qs, ks, vs, causal=True)[0].square().sum().backward()
        for a, r in ((qr, qs), (kr, ks), (vr, vs)):
            torch.testing.assert_close(a.grad, r.grad, atol=1e-9, rtol=1e-9)
