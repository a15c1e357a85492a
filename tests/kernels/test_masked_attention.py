"""The fused CPU path of ``litctx_kernels.attention(..., key_mask=...)`` against the chunked reference (float64) and a
float64 brute force: random masks, left-padded batches, GQA, decode steps with a q offset, windows, fully masked
rows, gradients, and the ``reference`` backend override."""

from __future__ import annotations

import pytest
import torch

import litctx_kernels
import litctx_kernels.dispatch as dispatch
from litctx_kernels import BlockLayout
from litctx_kernels.cpu_sparse import block_sparse_attention_cpu
from litctx_kernels.dispatch import BACKEND_ENV, empty_rows, expand_key_mask
from litctx_kernels.reference import attention_reference
from litctx_kernels.testing import assert_attention_close
from tests.kernels._brute import brute_attention, brute_mask


def _qkv(b, hq, hk, n_q, n_k, d, dv=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n_q, d, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hk, n_k, d, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hk, n_k, dv or d, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v


def _left_padded(b, heads, n_k, lengths):
    keep = torch.zeros(b, heads, n_k, dtype=torch.bool)
    for i, length in enumerate(lengths):
        keep[i, :, n_k - length:] = True
    return keep


@pytest.fixture
def no_reference(monkeypatch):
    """Fail if the dispatcher falls back to the chunked reference (the call must run fused)."""

    def boom(*args, **kwargs):
        raise AssertionError("litctx_kernels.attention ran the chunked reference for a masked CPU call")

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setattr(dispatch, "attention_reference", boom)


def _check(q, k, v, key_mask, **kw):
    """Fused (fp32) against the reference (float64 inputs): o and lse within 1e-5, the same empty rows, o = 0
    and lse = -inf on them."""
    o, lse = litctx_kernels.attention(q, k, v, key_mask=key_mask, **kw)
    o_ref, lse_ref = attention_reference(q.double(), k.double(), v.double(), key_mask=expand_key_mask(key_mask, q, k),
                                         **kw)
    assert o.dtype == q.dtype and o.shape == o_ref.shape and lse.shape == lse_ref.shape
    live = assert_attention_close(o, lse, o_ref, lse_ref, 1e-5, name="fused")
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double()[live], lse_ref[live], atol=1e-5, rtol=1e-5)
    return o, lse, live


CASES = {
    # name: (b, hq, hk, n_q, n_k, kwargs)
    "prefill": (2, 6, 2, 300, 300, {}),
    "prefill_mha": (2, 3, 3, 200, 200, {}),
    "decode": (3, 6, 2, 1, 257, {}),
    "decode_inner_offset": (2, 6, 2, 1, 257, {"q_offset": 100}),
    "append": (2, 6, 2, 20, 300, {}),
    "chunk_inner_offset": (2, 6, 2, 40, 300, {"q_offset": 150}),
    "window_prefill": (2, 6, 2, 300, 300, {"window": 48}),
    "window_decode": (2, 6, 2, 1, 300, {"window": 64}),
    "noncausal": (2, 6, 2, 30, 200, {"causal": False}),
    "prefill_one_kv_head": (2, 4, 1, 200, 200, {}),  # Gemma-3: 4 query heads share one KV head
    "decode_one_kv_head": (2, 4, 1, 1, 200, {}),
}


@pytest.mark.parametrize("hk", [1, 2])
@pytest.mark.parametrize("kw", [{}, {"causal": False}, {"window": 48}])
def test_unmasked_gqa_matches_reference(hk, kw):
    """The dense CPU path without a key mask, including a single KV head (no mask to repeat per group)."""
    q, k, v = _qkv(2, 4, hk, 150, 150, 16)
    o, lse = litctx_kernels.attention(q, k, v, **kw)
    o_ref, lse_ref = attention_reference(q.double(), k.double(), v.double(), **kw)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", ["one", "kv", "q"])
@pytest.mark.parametrize("case", list(CASES))
def test_random_key_masks_match_reference(case, heads, no_reference):
    b, hq, hk, n_q, n_k, kw = CASES[case]
    q, k, v = _qkv(b, hq, hk, n_q, n_k, 16)
    h = {"one": 1, "kv": hk, "q": hq}[heads]
    gen = torch.Generator().manual_seed(1)
    keep = torch.rand(b, h, n_k, generator=gen) > 0.4
    _check(q, k, v, keep, **kw)


@pytest.mark.parametrize("case", ["prefill", "append", "window_prefill", "decode", "noncausal"])
def test_left_padded_batch_matches_brute_force(case, no_reference):
    """Rows of 300 / 250 / 130 / 1 tokens padded on the left; padding query rows see only padding keys."""
    _, hq, hk, n_q, n_k, kw = CASES[case]
    q, k, v = _qkv(4, hq, hk, n_q, n_k, 16)
    lengths = [n_k, n_k - 50, n_k - 170, 1]
    keep = _left_padded(4, 1, n_k, lengths)
    o, lse, live = _check(q, k, v, keep, **kw)
    valid = brute_mask(n_q, n_k, causal=kw.get("causal", True), q_offset=kw.get("q_offset"),
                       window=kw.get("window")) & keep.unsqueeze(2)
    o_b, lse_b, _ = brute_attention(q, k, v, valid)
    torch.testing.assert_close(o.double(), o_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double()[live], lse_b[live], atol=1e-5, rtol=1e-5)
    if case == "prefill":  # the padded query rows of the short rows are exactly the empty ones
        assert int((~live).sum()) == hq * sum(n_k - length for length in lengths)


@pytest.mark.parametrize("case", ["prefill", "decode", "noncausal", "window_prefill", "chunk_inner_offset"])
def test_fully_masked_rows_and_heads(case, no_reference):
    """A whole batch row masked, and a head whose only live keys lie after some queries."""
    b, hq, hk, n_q, n_k, kw = CASES[case]
    q, k, v = _qkv(b, hq, hk, n_q, n_k, 16, seed=3)
    keep = torch.ones(b, hk, n_k, dtype=torch.bool)
    keep[0] = False  # batch row 0: nothing to attend to
    keep[1, 0, : n_k // 2] = False  # kv head 0 of row 1: the first half masked
    o, lse, live = _check(q, k, v, keep, **kw)
    assert not bool(live[0].any())


def test_head_dims_differ(no_reference):
    q, k, v = _qkv(2, 4, 2, 50, 50, 16, dv=8)
    keep = torch.rand(2, 2, 50, generator=torch.Generator().manual_seed(4)) > 0.3
    _check(q, k, v, keep)
    _check(q, k, v, keep, window=10)


@pytest.mark.parametrize("kw", [{}, {"window": 40}, {"causal": False}, {"q_offset": 0}])
def test_gradients_match_reference(kw, monkeypatch):
    """float64 end to end (the CPU flash kernel accepts it): dq, dk, dv through o (the flash backward with the
    same mask), and through o and lse (a gradient into lse recomputes that backward with the reference)."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    n_q = 1 if kw.get("causal") is False else 150
    q, k, v = _qkv(2, 4, 2, n_q, 150, 8, dtype=torch.float64, seed=5)
    holes = torch.rand(2, 2, 150, generator=torch.Generator().manual_seed(6)) > 0.3
    keep = _left_padded(2, 2, 150, [150, 90]) & holes
    keep[1, 1] = False
    for through_lse in (False, True):
        grads = []
        for fn in ("fused", "reference"):
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
            if fn == "fused":
                o, lse = litctx_kernels.attention(qq, kk, vv, key_mask=keep, **kw)
            else:
                o, lse = attention_reference(qq, kk, vv, key_mask=expand_key_mask(keep, q, k), **kw)
            loss = (o * torch.linspace(-1, 1, o.shape[-1], dtype=o.dtype)).sum()
            if through_lse:
                loss = loss + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).sum()
            grads.append(torch.autograd.grad(loss, (qq, kk, vv)))
        for a, b in zip(*grads):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, torch.nan_to_num(b), atol=1e-9, rtol=1e-7)


def test_block_sparse_path_takes_a_key_mask():
    """``block_sparse_attention_cpu`` with a random causal layout and a per-query-head key mask."""
    q, k, v = _qkv(2, 4, 2, 256, 256, 16, seed=7)
    layout = BlockLayout.random_causal(256, 64, 0.5, heads=4, seed=0)
    keep = torch.rand(2, 4, 256, generator=torch.Generator().manual_seed(8)) > 0.5
    keep[0, 1] = False
    o, lse = block_sparse_attention_cpu(q, k, v, layout, key_mask=keep)
    o_ref, lse_ref = attention_reference(q.double(), k.double(), v.double(), layout=layout, key_mask=keep)
    live = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), live)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double()[live], lse_ref[live], atol=1e-5, rtol=1e-5)
    o2, _ = block_sparse_attention_cpu(q, k, v, layout, key_mask=keep[:, ::2])  # a per-kv-head mask is expanded
    o2_ref, _ = attention_reference(q.double(), k.double(), v.double(), layout=layout,
                                    key_mask=keep[:, ::2].repeat_interleave(2, dim=1))
    torch.testing.assert_close(o2.double(), o2_ref, atol=1e-5, rtol=1e-5)
    expected = r"key_mask must be \[B, 1\|Hk\|Hq, Nk\] = \[2, 1\|2\|4, 256\], got \[2, 3, 256\]"
    with pytest.raises(ValueError, match=expected):
        block_sparse_attention_cpu(q, k, v, layout, key_mask=keep[:, :3])


@pytest.mark.parametrize("where", ["block_sparse", "reference", "dispatch"])
def test_float_key_mask_is_rejected(where):
    """An additive 0/-inf mask cast to bool would be inverted (-inf -> True): every entry point refuses floats."""
    q, k, v = _qkv(1, 4, 2, 64, 64, 16, seed=3)
    additive = torch.zeros(1, 4, 64).masked_fill_(torch.rand(1, 4, 64) > 0.5, float("-inf"))
    call = {"block_sparse": lambda: block_sparse_attention_cpu(q, k, v, BlockLayout.full(64, 64, 16),
                                                               key_mask=additive),
            "reference": lambda: attention_reference(q, k, v, key_mask=additive),
            "dispatch": lambda: litctx_kernels.attention(q, k, v, key_mask=additive)}[where]
    with pytest.raises(TypeError, match=r"key_mask must be boolean \[B, 1\|Hk\|Hq, Nk\] = \[1, 1\|2\|4, 64\].*float32"):
        call()


def test_empty_rows_matches_brute_force():
    gen = torch.Generator().manual_seed(9)
    keep = torch.rand(3, 2, 70, generator=gen) > 0.8
    keep[0] = False
    for n_q, off, causal, window in ((70, 0, True, None), (10, 60, True, 5), (1, 69, True, 3), (9, 0, False, None),
                                     (20, -5, True, None)):
        valid = brute_mask(n_q, 70, causal=causal, q_offset=off, window=window) & keep.unsqueeze(2)
        assert torch.equal(empty_rows(keep, n_q, off, causal, window), ~valid.any(-1))


def test_reference_backend_override(monkeypatch):
    """``backend="reference"`` and ``LITCTX_KERNEL_BACKEND=reference`` run the chunked reference (the pre-fused
    path, kept for benchmarks); the default runs fused."""
    calls = []
    real = dispatch.attention_reference

    def spy(*args, **kwargs):
        calls.append(kwargs.get("key_mask") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "attention_reference", spy)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    q, k, v = _qkv(1, 2, 1, 8, 8, 8)
    keep = torch.ones(1, 1, 8, dtype=torch.bool)
    keep[..., :2] = False
    o_fused, _ = litctx_kernels.attention(q, k, v, key_mask=keep)
    assert calls == []
    o_ref, _ = litctx_kernels.attention(q, k, v, key_mask=keep, backend="reference")
    assert calls == [True]
    monkeypatch.setenv(BACKEND_ENV, "reference")
    litctx_kernels.attention(q, k, v)
    assert calls == [True, False]
    torch.testing.assert_close(o_fused, o_ref, atol=1e-6, rtol=1e-6)


def test_bad_key_masks_are_named():
    q, k, v = _qkv(2, 6, 2, 5, 9, 8)
    with pytest.raises(ValueError, match=r"key_mask must be \[B, 1\|Hk\|Hq, Nk\] = \[2, 1\|2\|6, 9\], got \[2, 4, 9\]"):
        litctx_kernels.attention(q, k, v, key_mask=torch.ones(2, 4, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"got \[2, 2, 8\]"):
        litctx_kernels.attention(q, k, v, key_mask=torch.ones(2, 2, 8, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_mask must be boolean"):
        litctx_kernels.attention(q, k, v, key_mask=torch.ones(2, 2, 9))


@pytest.mark.parametrize("heads", ["none", "one", "kv", "q"])
@pytest.mark.parametrize("kw", [{}, {"causal": False}])
def test_dense_gqa_never_repeats_kv(heads, kw, monkeypatch, no_reference):
    """docs/kernels.md: no op repeats K/V in memory. The dense CPU path hands the flash kernel K/V with the kv
    heads only (causal: one call per group member; non-causal: the group folded into the query axis), with any
    key mask, and still matches the float64 reference."""
    q, k, v = _qkv(2, 6, 2, 96, 96, 16)
    seen = []
    real = dispatch._flash_cpu

    def spy(q_, k_, v_, **kwargs):
        seen.append((k_.shape[1], v_.shape[1], k_.data_ptr() == k.data_ptr()))
        return real(q_, k_, v_, **kwargs)

    monkeypatch.setattr(dispatch, "_flash_cpu", spy)
    h = {"none": None, "one": 1, "kv": 2, "q": 6}[heads]
    keep = None if h is None else torch.rand(2, h, 96, generator=torch.Generator().manual_seed(5)) > 0.3
    if keep is None:
        o, lse = litctx_kernels.attention(q, k, v, **kw)
        o_ref, lse_ref = attention_reference(q.double(), k.double(), v.double(), **kw)
        torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    else:
        _check(q, k, v, keep, **kw)
    assert seen and all(hk == 2 and hv == 2 and same for hk, hv, same in seen), seen
