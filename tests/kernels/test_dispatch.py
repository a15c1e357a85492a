"""The dispatcher: backend choice, overrides, clear errors, and that every CPU route equals the reference."""

from __future__ import annotations

import logging

import pytest
import torch

import litctx_kernels
from litctx_kernels import BlockLayout, QueryIndex, TokenIndex
from litctx_kernels.dispatch import BACKEND_ENV, _log_once, select_backend
from litctx_kernels.reference import attention_colstats_reference, attention_reference, gather_attention_reference
from litctx_kernels.testing import assert_close


def qkv(hq=4, hk=4, nq=96, nk=None, d=32, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(0)
    nk = nq if nk is None else nk
    return [torch.randn(*s, generator=g, dtype=dtype).requires_grad_(grad)
            for s in ((2, hq, nq, d), (2, hk, nk, d), (2, hk, nk, d))]


def test_auto_picks_torch_on_cpu_and_env_overrides(monkeypatch):
    q, _, _ = qkv()
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert select_backend("attention", q) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert select_backend("attention", q) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "cuda-please")
    with pytest.raises(ValueError, match=f"{BACKEND_ENV}='cuda-please'.*auto, torch, triton"):
        select_backend("attention", q)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        litctx_kernels.attention(q, k, v, backend="triton")


def test_decisions_logged_once(caplog):
    _log_once.cache_clear()
    q, k, v = qkv()
    with caplog.at_level(logging.INFO, logger="litctx.kernels"):
        for _ in range(3):
            litctx_kernels.attention(q, k, v)
    lines = [r.getMessage() for r in caplog.records if "attention" in r.getMessage()]
    assert lines and len(lines) == len(set(lines))


@pytest.mark.parametrize("kw", [dict(), dict(causal=False), dict(window=20), dict(q_offset=None, nk=150),
                                dict(hk=2), dict(layout="random"), dict(layout="full"), dict(score_mode="lssa"),
                                dict(score_mode="lssar"), dict(q_index=True), dict(dv=24), dict(dv=24, window=9)])
def test_every_cpu_route_equals_the_reference(kw):
    kw = dict(kw)
    nk = kw.pop("nk", None)
    hk = kw.pop("hk", 4)
    dv = kw.pop("dv", None)
    q, k, v = qkv(hk=hk, nk=nk, grad=True)
    if dv is not None:  # a value head dim different from the query/key one
        v = torch.randn(*v.shape[:-1], dv, generator=torch.Generator().manual_seed(9)).requires_grad_(True)
    nq, nk = q.shape[2], k.shape[2]
    lay = kw.pop("layout", None)
    if lay == "random":
        m = torch.rand(2, 4, 3, 3, generator=torch.Generator().manual_seed(1)) < 0.6
        kw["layout"] = BlockLayout.from_block_mask(m, 32, 32, (nq, nk))
    elif lay == "full":
        kw["layout"] = BlockLayout.causal(nq, nk, 32)
    if kw.pop("q_index", False):
        kw["q_index"] = QueryIndex.from_mask(torch.rand(2, 4, nq, generator=torch.Generator().manual_seed(2)) < 0.5)
    o, lse = litctx_kernels.attention(q, k, v, **kw)
    ro, rlse = attention_reference(q, k, v, **kw)
    assert_close(o, ro, ratio=1e-5)
    fin = torch.isfinite(rlse)
    assert_close(lse[fin], rlse[fin], ratio=1e-5)
    go = torch.randn_like(o)
    for a, e in zip(torch.autograd.grad(o, (q, k, v), go), torch.autograd.grad(ro, (q, k, v), go)):
        assert_close(a, e, ratio=1e-5)


def test_gather_and_colstats_routes():
    q, k, v = qkv(hq=4, hk=2, nq=8, nk=64)
    ti = TokenIndex.from_mask(torch.rand(2, 2, 64, generator=torch.Generator().manual_seed(3)) < 0.5)
    o, _ = litctx_kernels.gather_attention(q, k, v, ti)
    assert_close(o, gather_attention_reference(q, k, v, ti)[0], ratio=1e-6)
    st = litctx_kernels.attention_colstats(q, k, v, q_window=4)
    ref = attention_colstats_reference(q, k, v, q_window=4)
    for a, e in zip(st[:4], ref[:4]):
        assert_close(a, e, ratio=1e-6)
    assert st.p2z_sum is None and ref.p2z_sum is None  # logit moments only when asked for
    masked = litctx_kernels.attention_colstats(q, k, v, q_window=4, moments="logit", key_mask=ti.to_mask())
    assert masked.p2z2_o is not None and masked.p2z2_o.shape == (2, 4, 64, q.shape[-1])


def test_bad_inputs_name_the_tensor():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must be \[B, H, N, d\]"):
        litctx_kernels.attention(q[0], k, v)
    with pytest.raises(ValueError, match="score_mode"):
        litctx_kernels.attention(q, k, v, score_mode="sparsemax")
    with pytest.raises(ValueError, match="window=4 needs causal=True"):
        litctx_kernels.attention(q, k, v, causal=False, window=4)
    with pytest.raises(ValueError, match="head dims differ"):
        litctx_kernels.attention(q, k[..., :16], v)


@pytest.mark.interpret
def test_triton_backend_through_the_dispatcher(monkeypatch):
    if __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (run with make test-interpret)")
    monkeypatch.setenv(BACKEND_ENV, "triton")
    q, k, v = qkv(hq=4, hk=2, nq=64, d=32, grad=True)
    lay = BlockLayout.from_block_mask(torch.rand(2, 4, 4, 4, generator=torch.Generator().manual_seed(5)) < 0.6,
                                      16, 16, (64, 64))
    o, lse = litctx_kernels.attention(q, k, v, layout=lay)
    ro, _ = attention_reference(q, k, v, layout=lay)
    assert_close(o, ro, ratio=1e-5)
    go = torch.randn_like(o)
    for a, e in zip(torch.autograd.grad(o, (q, k, v), go), torch.autograd.grad(ro, (q, k, v), go)):
        assert_close(a, e, ratio=1e-5)
    o, _ = litctx_kernels.attention(q, k, v, score_mode="lssar")  # K6, the LSSAR forward
    assert_close(o, attention_reference(q, k, v, score_mode="lssar")[0], ratio=2e-4)
    with pytest.raises(RuntimeError, match="LSSAR"):  # no K6 for layouts: a forced triton backend refuses
        litctx_kernels.attention(q, k, v, score_mode="lssar", layout=lay)


@pytest.mark.parametrize("n_q,causal", [(1, True), (5, False)])
def test_cpu_gqa_without_a_causal_mask_folds_groups_and_matches_the_reference(n_q, causal):
    q, k, v = qkv(hq=6, hk=2, nq=n_q, nk=40)
    o, lse = litctx_kernels.attention(q, k, v, causal=causal)
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal)
    assert_close(o, ref_o, ratio=1e-6)
    assert_close(lse, ref_lse, ratio=1e-6)
    # gradients flow through the folded call
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    litctx_kernels.attention(qg, kg, vg, causal=causal)[0].square().sum().backward()
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    attention_reference(qr, kr, vr, causal=causal)[0].square().sum().backward()
    for a, b in ((qg, qr), (kg, kr), (vg, vr)):
        assert_close(a.grad, b.grad, ratio=1e-5)


def test_cpu_block_layout_takes_the_native_kernels(monkeypatch):
    """fp32 calls with a block layout run the native kernels of litctx_kernels.cpu_sparse (when they build): the
    forward for inference, forward and native backward for calls that need a gradient (the flash-call path and its
    backward with LITCTX_CPU_SPARSE_NATIVE_BACKWARD=0)."""
    import litctx_kernels.cpu_sparse as cs

    if cs.native_kernel() is None:
        pytest.skip(f"native forward unavailable: {cs.native_status().get('reason')}")
    calls = []
    real = cs._native_forward
    monkeypatch.setattr(cs, "_native_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 96, 16, generator=g)
    k, v = torch.randn(1, 2, 96, 16, generator=g), torch.randn(1, 2, 96, 16, generator=g)
    lay = BlockLayout.random_causal(96, 32, 0.5, heads=4, seed=1)
    want, want_lse = attention_reference(q, k, v, layout=lay, causal=True)
    with torch.no_grad():
        o, lse = litctx_kernels.attention(q, k, v, layout=lay)
    assert calls == [1]
    assert_close(o, want, ratio=1e-5)
    assert_close(lse, want_lse, ratio=1e-5)
    bwd = []
    real_b = cs._native_backward
    monkeypatch.setattr(cs, "_native_backward", lambda *a, **kw: bwd.append(1) or real_b(*a, **kw))
    qg = q.clone().requires_grad_(True)
    o2, _ = litctx_kernels.attention(qg, k, v, layout=lay)
    o2.square().sum().backward()
    assert (calls, bwd) == ([1, 1], [1]), "a call that needs a gradient runs the native forward and backward"
    assert_close(o2.detach(), want, ratio=1e-5)
    qr = q.clone().requires_grad_(True)
    attention_reference(qr, k, v, layout=lay, causal=True)[0].square().sum().backward()
    assert_close(qg.grad, qr.grad, ratio=1e-5)
    monkeypatch.setenv(cs.NATIVE_BACKWARD_ENV, "0")
    qf = q.clone().requires_grad_(True)
    o3, _ = litctx_kernels.attention(qf, k, v, layout=lay)
    o3.square().sum().backward()
    assert (calls, bwd) == ([1, 1], [1]), "the kill switch keeps gradient calls on the flash-call path"
    assert_close(qf.grad, qr.grad, ratio=1e-5)
