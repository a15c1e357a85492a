"""The direct-domain CPU path of LSSA / LSSAR (``litctx_kernels.cpu_softplus``) against the float64 brute force of
the definitions and the log-domain reference (outputs, LSEs and gradients), its edge rows, and when the
dispatcher takes it."""

from __future__ import annotations

import math

import pytest
import torch

import litctx_kernels
from litctx_kernels import cpu_softplus
from litctx_kernels.cpu_softplus import softplus_attention_cpu, softplus_fits
from litctx_kernels.reference import attention_reference
from tests.kernels._brute import brute_attention, brute_mask, row_lengths


def qkv(b=2, hq=4, hk=4, nq=40, nk=None, d=16, dv=None, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    nk = nq if nk is None else nk
    dv = d if dv is None else dv
    return [torch.randn(*s, generator=g, dtype=dtype).requires_grad_(grad)
            for s in ((b, hq, nq, d), (b, hk, nk, d), (b, hk, nk, dv))]


CASES = [dict(), dict(causal=False), dict(window=7), dict(nq=5, nk=40), dict(nq=1, nk=33), dict(nq=12, nk=40,
         q_offset=10), dict(hk=2), dict(hk=1, dv=8), dict(lssar_offset_rows=0), dict(lssar_power=3.0)]


@pytest.mark.parametrize("mode", ["lssa", "lssar"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "causal")
def test_equals_the_brute_force_and_the_reference(mode, case):
    case = dict(case)
    shape = {k: case.pop(k) for k in ("nq", "nk", "hk", "dv") if k in case}
    q, k, v = qkv(**shape)
    kw = dict(causal=case.get("causal", True), q_offset=case.get("q_offset"), window=case.get("window"))
    power, rows = case.get("lssar_power", 15.0), case.get("lssar_offset_rows", 3)
    o, lse = softplus_attention_cpu(q, k, v, score_mode=mode, lssar_power=power, lssar_offset_rows=rows, **kw)
    n_q, n_k = q.shape[2], k.shape[2]
    valid = brute_mask(n_q, n_k, **kw)
    n_i, pos = row_lengths(n_q, n_k, **kw)
    o_b, lse_b, _ = brute_attention(q, k, v, valid, mode=mode, n_i=n_i, pos=pos, power=power, offset_rows=rows)
    defined = ~o_b.isnan().any(-1)  # the definition's 0/0 on a uniform LSSAR row (the reference keeps LSSA there)
    assert defined.float().mean() > 0.9
    torch.testing.assert_close(o[defined], o_b[defined], rtol=1e-9, atol=1e-10)
    o_r, lse_r = attention_reference(q, k, v, score_mode=mode, lssar_power=power, lssar_offset_rows=rows, **kw)
    torch.testing.assert_close(o, o_r, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(lse, lse_r, rtol=1e-9, atol=1e-10)
    if lse_b is not None:
        torch.testing.assert_close(lse, lse_b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("mode", ["lssa", "lssar"])
@pytest.mark.parametrize("case", [dict(), dict(window=9), dict(hk=2), dict(nq=8, nk=30)])
def test_gradients_equal_the_reference(mode, case):
    case = dict(case)
    shape = {k: case.pop(k) for k in ("nq", "nk", "hk") if k in case}
    ins = qkv(grad=True, **shape)
    ref = [t.detach().clone().requires_grad_(True) for t in ins]
    g = torch.Generator().manual_seed(5)
    o, lse = softplus_attention_cpu(*ins, score_mode=mode, **case)
    do, dl = torch.randn(o.shape, generator=g, dtype=o.dtype), torch.randn(lse.shape, generator=g, dtype=o.dtype)
    ((o * do).sum() + (lse * dl).sum()).backward()
    o_r, lse_r = attention_reference(*ref, score_mode=mode, chunk=16, **case)  # chunked + checkpointed backward
    ((o_r * do).sum() + (lse_r * dl).sum()).backward()
    for a, b in zip(ins, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-8, atol=1e-9)


def test_float32_matches_float64_and_keeps_the_input_dtype():
    q, k, v = qkv(nq=64, d=32)
    for mode in ("lssa", "lssar"):
        o64, lse64 = softplus_attention_cpu(q, k, v, score_mode=mode)
        o32, lse32 = softplus_attention_cpu(q.float(), k.float(), v.float(), score_mode=mode)
        assert o32.dtype == torch.float32 and lse32.dtype == torch.float32
        torch.testing.assert_close(o32.double(), o64, rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(lse32.double(), lse64, rtol=1e-5, atol=1e-5)
    o16, _ = softplus_attention_cpu(q.half(), k.half(), v.half(), score_mode="lssa")
    assert o16.dtype == torch.float16


def test_rows_without_keys_give_zero_and_minus_inf():
    q, k, v = qkv(nq=6, nk=20)
    keep = torch.ones(2, 1, 20, dtype=torch.bool)
    keep[0] = False  # batch row 0 sees nothing
    keep[1, :, 10:] = False  # batch row 1 keeps the first 10 keys
    for mode in ("lssa", "lssar"):
        o, lse = softplus_attention_cpu(q, k, v, score_mode=mode, key_mask=keep)
        assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isinf(lse[0]).all() and (lse[0] < 0).all()
        o_r, lse_r = attention_reference(q, k, v, score_mode=mode, key_mask=keep)
        torch.testing.assert_close(o, o_r, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(lse[1], lse_r[1], rtol=1e-9, atol=1e-10)
    # a negative q_offset: the first rows precede every key
    o, lse = softplus_attention_cpu(q, k[:, :, :4], v[:, :, :4], q_offset=-2, score_mode="lssa")
    assert torch.isinf(lse[:, :, :2]).all() and torch.equal(o[:, :, :2], torch.zeros_like(o[:, :, :2]))


def test_lssar_uniform_row_falls_back_to_lssa():
    """With ``window=1`` each row sees one key: ``A = 1``, ``N = 1``, so after the offset rows ``N A - 1 = 0`` (no
    LSSAR weight) and the row keeps LSSA's output ``v_i`` and LSE ``ln softplus(0) = ln ln 2`` (kappa = 0); the
    offset rows get weight 1 and LSE ``15 ln 1 + ln 1 = 0``. Closed forms, and the reference agrees."""
    q, k, v = qkv(b=1, hq=2, hk=2, nq=10)
    o, lse = softplus_attention_cpu(q, k, v, score_mode="lssar", window=1)
    torch.testing.assert_close(o, v.detach())
    expected = torch.full_like(lse, math.log(math.log(2.0)))
    expected[..., :3] = 0.0
    torch.testing.assert_close(lse, expected)
    o_r, lse_r = attention_reference(q, k, v, score_mode="lssar", window=1)
    torch.testing.assert_close(o, o_r, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(lse, lse_r, rtol=1e-9, atol=1e-10)


def test_row_chunks_and_key_spans_without_autograd(monkeypatch):
    """Chunks of a few rows (each over the keys its rows may see) give what one chunk gives."""
    q, k, v = qkv(nq=50)
    whole = [softplus_attention_cpu(q, k, v, score_mode=m, window=w) for m in ("lssa", "lssar") for w in (None, 6)]
    monkeypatch.setattr(cpu_softplus, "MAX_ELEMENTS", 2 * 4 * 50 * 3)  # 3 rows per chunk
    chunked = [softplus_attention_cpu(q, k, v, score_mode=m, window=w) for m in ("lssa", "lssar") for w in (None, 6)]
    for (o1, l1), (o2, l2) in zip(whole, chunked):
        torch.testing.assert_close(o1, o2, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(l1, l2, rtol=1e-12, atol=1e-13)


def test_the_dispatcher_takes_it_when_it_fits(monkeypatch):
    calls = []
    real = cpu_softplus.softplus_attention_cpu

    def spy(*a, **kw):
        calls.append(kw["score_mode"])
        return real(*a, **kw)

    monkeypatch.setattr(cpu_softplus, "softplus_attention_cpu", spy)
    q, k, v = qkv(dtype=torch.float32, grad=True)
    o, _ = litctx_kernels.attention(q, k, v, score_mode="lssar")
    assert calls == ["lssar"]
    torch.testing.assert_close(o, attention_reference(q, k, v, score_mode="lssar")[0], rtol=1e-4, atol=1e-5)
    litctx_kernels.attention(q, k, v, score_mode="lssa", backend="reference")  # asked for: the reference
    assert calls == ["lssar"]
    # a call with gradients too large for plain autograd goes to the reference (checkpointed chunks)
    monkeypatch.setattr(cpu_softplus, "MAX_ELEMENTS", q.shape[0] * q.shape[1] * 40 * 40 - 1)
    litctx_kernels.attention(q, k, v, score_mode="lssa")
    assert calls == ["lssar"]
    with torch.no_grad():  # ... but not without gradients (it chunks)
        litctx_kernels.attention(q, k, v, score_mode="lssa")
    assert calls == ["lssar", "lssa"]


def test_fits_refuses_an_underflowing_kappa():
    q, k, _ = qkv(nq=2, nk=4, d=16)
    assert softplus_fits(q, k, needs_grad=True)
    big_q = torch.empty(1, 1, 1, 4096, device="meta")
    big_k = torch.empty(1, 1, 1 << 16, 4096, device="meta")  # ln(4096) ln(65536) = 92 > MAX_KAPPA
    assert not softplus_fits(big_q, big_k, needs_grad=False)
