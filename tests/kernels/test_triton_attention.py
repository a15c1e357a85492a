"""K1/K2 (``litctx_kernels.triton.attention``) against a float64 brute force and the torch reference.

Runs in the Triton interpreter on CPU (``TRITON_INTERPRET=1 pytest -m interpret tests/kernels``) or compiled on
CUDA when ``TRITON_INTERPRET`` is unset and a GPU is present. Sizes stay small (N <= 256) because every program
instance is executed in Python by the interpreter.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.interpret

from tests.kernels._triton_env import triton_device  # noqa: E402

DEVICE = triton_device()
INTERPRET = DEVICE == "cpu"

from litctx_kernels.layouts import BlockLayout, QueryIndex  # noqa: E402
from litctx_kernels.testing import assert_close  # noqa: E402
from litctx_kernels.triton.attention import triton_attention  # noqa: E402

from litctx_kernels.reference import attention_reference  # noqa: E402

RATIO = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1.5e-2}


# ----------------------------------------------------------------------------------------------------------------
# float64 brute force, written from the definitions
# ----------------------------------------------------------------------------------------------------------------
def brute_attention(q, k, v, *, scale=None, causal=True, q_offset=None, window=None, layout=None, q_index=None,
                    score_mode="softmax"):
    """``(o, lse)`` in float64 with the full score matrix; K/V repeated for GQA (fine in a test)."""
    b, hq, n_q, d = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    g = hq // hk
    q, k, v = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    off = n_k - n_q if q_offset is None else q_offset
    if q_index is not None:
        idx = q_index.idx.long().to(q.device).expand(b, hq, -1)
    else:
        idx = torch.arange(n_q, device=q.device).expand(b, hq, n_q)
    row_ok = idx >= 0
    rows = idx.clamp_min(0)
    qs = torch.gather(q, 2, rows.unsqueeze(-1).expand(-1, -1, -1, d))
    pos = rows + off
    j = torch.arange(n_k, device=q.device)
    valid = row_ok.unsqueeze(-1) & (j < n_k)
    if causal:
        valid = valid & (j <= pos.unsqueeze(-1))
        if window is not None:
            valid = valid & (j > pos.unsqueeze(-1) - window)
    if layout is not None:
        bm = layout.to_block_mask().to(q.device).expand(b, hq, -1, -1)  # [b, hq, Mq, Mk]
        per_row = torch.gather(bm, 2, (rows // layout.block_q).unsqueeze(-1).expand(-1, -1, -1, bm.shape[-1]))
        valid = valid & per_row[..., j // layout.block_k]
    if score_mode == "softmax":
        phi = qs @ k.transpose(-1, -2) * (1 / math.sqrt(d) if scale is None else scale)
    else:
        c = F.normalize(qs, dim=-1, eps=1e-12) @ F.normalize(k, dim=-1, eps=1e-12).transpose(-1, -2)
        if causal:
            n_i = torch.clamp(pos + 1, 0, n_k)
            if window is not None:
                n_i = torch.clamp(n_i, max=window)
        else:
            n_i = torch.full_like(pos, n_k)
        kappa = math.log(d) * torch.log(n_i.clamp_min(1).double())
        x = kappa.unsqueeze(-1) * c
        phi = torch.where(x < -30, x, torch.log(F.softplus(torch.where(x < -30, torch.zeros_like(x), x))))
    has = valid.any(-1, keepdim=True)
    phi = torch.where(valid, phi, torch.full_like(phi, -math.inf))
    phi = torch.where(has, phi, torch.zeros_like(phi))  # keep empty rows finite (no NaN gradients)
    lse = torch.logsumexp(phi, -1)
    p = torch.exp(phi - lse.unsqueeze(-1)) * valid
    o = p @ v
    lse = torch.where(has.squeeze(-1), lse, torch.full_like(lse, -math.inf))
    return o, lse


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------
def make_qkv(b=1, hq=2, hk=1, n_q=64, n_k=None, d=32, dv=None, dtype=torch.float32, seed=0, transposed=False):
    gen = torch.Generator().manual_seed(seed)
    n_k = n_q if n_k is None else n_k
    dv = d if dv is None else dv

    def mk(h, n, e):
        if transposed:  # [B, N, H, e] storage viewed as [B, H, N, e]
            return torch.randn(b, n, h, e, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
        return torch.randn(b, h, n, e, generator=gen).to(dtype).to(DEVICE)

    return mk(hq, n_q, d), mk(hk, n_k, d), mk(hk, n_k, dv)


def check_lse(actual, expected, ratio, name="lse"):
    fin = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(actual), fin), f"{name}: -inf pattern differs"
    assert bool((actual[~fin] == -math.inf).all()), f"{name}: rows without keys must have lse = -inf"
    assert_close(actual[fin], expected[fin], ratio=ratio, name=name)


def grads(fn, q, k, v, go, gl):
    """Run ``fn`` on leaf copies of q/k/v and backprop ``sum(o * go) + sum(lse * gl)`` (finite lse only)."""
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o, lse = fn(qq, kk, vv)
    loss = (o.double() * go).sum() + (torch.where(torch.isfinite(lse), lse.double(), 0.0) * gl).sum()
    if not loss.requires_grad:  # e.g. an oracle that returns fresh zeros for zero computed rows
        return o.detach(), lse.detach(), torch.zeros_like(qq), torch.zeros_like(kk), torch.zeros_like(vv)
    loss.backward()
    return o.detach(), lse.detach(), qq.grad, kk.grad, vv.grad


def run_parity(q, k, v, *, backward=True, **kw):
    """Compare triton_attention against the brute force (and the reference when importable)."""
    dtype = q.dtype
    ratio = RATIO[dtype]
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    o, lse = triton_attention(q, k, v, **kw)
    assert o.dtype == dtype and lse.dtype == torch.float32
    gen = torch.Generator().manual_seed(123)
    go = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    gl = torch.randn(lse.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    oracles = [("brute", lambda a, b_, c: brute_attention(a, b_, c, **kw)),
               ("reference", lambda a, b_, c: attention_reference(a, b_, c, **kw))]
    if not backward:
        for name, fn in oracles:
            ro, rl = fn(q64, k64, v64)
            assert_close(o, ro, ratio=ratio, name=f"o vs {name}")
            check_lse(lse, rl, ratio, name=f"lse vs {name}")
        return o, lse
    to, tlse, tdq, tdk, tdv = grads(lambda a, b_, c: triton_attention(a, b_, c, **kw), q, k, v, go, gl)
    assert torch.equal(to, o)
    assert torch.isfinite(tdq).all() and torch.isfinite(tdk).all() and torch.isfinite(tdv).all()
    for name, fn in oracles:
        ro, rl, rdq, rdk, rdv = grads(fn, q64, k64, v64, go, gl)
        assert_close(to, ro, ratio=ratio, name=f"o vs {name}")
        check_lse(tlse, rl, ratio, name=f"lse vs {name}")
        assert_close(tdq, rdq, ratio=ratio, name=f"dq vs {name}")
        assert_close(tdk, rdk, ratio=ratio, name=f"dk vs {name}")
        assert_close(tdv, rdv, ratio=ratio, name=f"dv vs {name}")
    return o, lse


def random_layout(b, h, n_q, n_k, block_q, block_k, density, seed, causal=True):
    """Random block layout over the causal blocks at roughly ``density`` (diagonal not forced)."""
    gen = torch.Generator().manual_seed(seed)
    mq, mk = math.ceil(n_q / block_q), math.ceil(n_k / block_k)
    mask = torch.rand(b, h, mq, mk, generator=gen) < density
    if causal:
        base = BlockLayout.causal(n_q, n_k, block_q, block_k).to_block_mask()
        mask = mask & base
    return BlockLayout.from_block_mask(mask.to(DEVICE), block_q, block_k, (n_q, n_k))


# ----------------------------------------------------------------------------------------------------------------
# dense / causal / window / offsets / dtypes / shapes
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [
    dict(n_q=100, d=32, hq=4, hk=2, causal=True),
    dict(n_q=63, d=16, hq=2, hk=2, causal=False),
    dict(n_q=63, n_k=100, d=32, hq=2, hk=1, causal=True, window=17),
    dict(n_q=40, n_k=100, d=64, hq=2, hk=1, causal=True, q_offset=20),
    dict(n_q=48, n_k=80, d=32, hq=2, hk=2, causal=True, q_offset=-5),       # first rows see no key
    dict(n_q=130, d=16, hq=1, hk=1, causal=True, window=40, b=2),
    dict(n_q=100, n_k=37, d=32, hq=2, hk=1, causal=False, dv=16),
    dict(n_q=256, d=64, hq=1, hk=1, causal=True),
    dict(n_q=40, d=48, dv=24, hq=3, hk=1, causal=True),                   # non-power-of-two head dims, GQA 3
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_fp32_forward_backward(case):
    case = dict(case)
    shape = {k: case.pop(k) for k in ("b", "hq", "hk", "n_q", "n_k", "d", "dv") if k in case}
    q, k, v = make_qkv(**shape, seed=len(str(case)))
    run_parity(q, k, v, **case)


@pytest.mark.parametrize("case", [
    dict(n_q=100, d=64, hq=4, hk=2, causal=True),
    dict(n_q=63, n_k=100, d=32, hq=2, hk=1, causal=True, window=24),
    dict(n_q=80, d=16, hq=2, hk=2, causal=False),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_fp16_forward_backward(case):
    case = dict(case)
    shape = {k: case.pop(k) for k in ("b", "hq", "hk", "n_q", "n_k", "d", "dv") if k in case}
    q, k, v = make_qkv(**shape, dtype=torch.float16, seed=7)
    run_parity(q, k, v, **case)


def test_bf16_is_computed_in_fp32_in_the_interpreter():
    q, k, v = make_qkv(hq=2, hk=1, n_q=64, d=32, dtype=torch.bfloat16, seed=3)
    run_parity(q, k, v, causal=True)


def test_noncontiguous_inputs():
    q, k, v = make_qkv(b=2, hq=4, hk=2, n_q=63, d=32, transposed=True, seed=5)
    assert not q.is_contiguous()
    run_parity(q, k, v, causal=True)


def test_explicit_scale():
    q, k, v = make_qkv(hq=2, hk=2, n_q=50, d=32, seed=9)
    run_parity(q, k, v, causal=True, scale=0.3)


def test_empty_rows_give_zero_output_and_minus_inf_lse():
    q, k, v = make_qkv(hq=2, hk=1, n_q=40, n_k=40, d=16, seed=11)
    o, lse = triton_attention(q, k, v, causal=True, q_offset=-10)
    assert (o[:, :, :10] == 0).all()
    assert (lse[:, :, :10] == -math.inf).all()
    assert torch.isfinite(lse[:, :, 10:]).all()


# ----------------------------------------------------------------------------------------------------------------
# LSSA score mode
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [
    dict(n_q=100, d=32, hq=4, hk=2, causal=True),
    dict(n_q=40, n_k=100, d=32, hq=2, hk=1, causal=True, window=30),
    dict(n_q=63, d=16, hq=2, hk=2, causal=False),
    dict(n_q=64, d=64, hq=2, hk=1, causal=True, dtype=torch.float16),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_lssa(case):
    case = dict(case)
    dtype = case.pop("dtype", torch.float32)
    shape = {k: case.pop(k) for k in ("b", "hq", "hk", "n_q", "n_k", "d", "dv") if k in case}
    q, k, v = make_qkv(**shape, dtype=dtype, seed=13)
    run_parity(q, k, v, score_mode="lssa", **case)


def test_lssa_ignores_scale_and_handles_zero_vectors():
    q, k, v = make_qkv(hq=2, hk=1, n_q=48, d=32, seed=17)
    q[:, :, 5] = 0.0  # normalise(0) = 0: cosine 0, finite
    k[:, :, 7] = 0.0
    o1, l1 = run_parity(q, k, v, score_mode="lssa", causal=True)
    o2, l2 = triton_attention(q, k, v, score_mode="lssa", causal=True, scale=123.0)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


# ----------------------------------------------------------------------------------------------------------------
# block layouts
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [
    dict(n_q=100, bq=16, bk=16, density=0.3, lh=2, hq=2, hk=1, d=32),
    dict(n_q=128, bq=32, bk=16, density=0.5, lh=1, hq=4, hk=2, d=16),
    dict(n_q=100, bq=16, bk=32, density=0.1, lh=4, hq=4, hk=2, d=32),
    dict(n_q=96, bq=48, bk=32, density=0.5, lh=2, hq=2, hk=2, d=64),
    dict(n_q=63, n_k=100, bq=16, bk=16, density=0.4, lh=2, hq=2, hk=1, d=32, lb=2, b=2),
    dict(n_q=100, bq=16, bk=16, density=0.4, lh=2, hq=2, hk=1, d=32, causal=False),
    dict(n_q=100, bq=16, bk=16, density=0.5, lh=2, hq=2, hk=1, d=32, window=40),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_layout(case):
    case = dict(case)
    b, lb = case.pop("b", 1), case.pop("lb", 1)
    n_q = case.pop("n_q")
    n_k = case.pop("n_k", n_q)
    causal = case.pop("causal", True)
    window = case.pop("window", None)
    lay = random_layout(lb, case.pop("lh"), n_q, n_k, case.pop("bq"), case.pop("bk"), case.pop("density"),
                        seed=n_q + n_k, causal=causal)
    q, k, v = make_qkv(b=b, n_q=n_q, n_k=n_k, seed=21, **case)
    run_parity(q, k, v, causal=causal, window=window, layout=lay)


def test_layout_fp16_and_lssa():
    lay = random_layout(1, 2, 100, 100, 16, 16, 0.4, seed=5)
    q, k, v = make_qkv(hq=2, hk=1, n_q=100, d=32, dtype=torch.float16, seed=23)
    run_parity(q, k, v, layout=lay)
    q, k, v = make_qkv(hq=2, hk=1, n_q=100, d=32, seed=29)
    run_parity(q, k, v, layout=lay, score_mode="lssa")


def _adversarial(kind, n, bs):
    m = math.ceil(n / bs)
    mask = torch.zeros(1, 2, m, m, dtype=torch.bool)
    if kind == "empty_rows":  # head 0: every other query block empty; head 1: nothing at all
        mask[0, 0] = BlockLayout.causal(n, n, bs).to_block_mask()[0, 0]
        mask[0, 0, ::2] = False
    elif kind == "diagonal":
        mask[..., torch.arange(m), torch.arange(m)] = True
    elif kind == "sink":
        mask[..., 0] = True
    return BlockLayout.from_block_mask(mask.to(DEVICE), bs, bs, (n, n))


@pytest.mark.parametrize("kind", ["empty_rows", "diagonal", "sink"])
def test_adversarial_layouts(kind):
    lay = _adversarial(kind, 100, 16)
    q, k, v = make_qkv(hq=2, hk=1, n_q=100, d=32, seed=31)
    o, lse = run_parity(q, k, v, layout=lay)
    if kind == "empty_rows":
        assert (o[:, 1] == 0).all() and (lse[:, 1] == -math.inf).all()
        assert (o[:, 0, :16] == 0).all() and (lse[:, 0, :16] == -math.inf).all()


@pytest.mark.parametrize("case", [
    dict(n=100, bq=16, bk=16, tile=(32, 32), density=0.3),  # 2 x 2 fine blocks per tile, ragged edge
    dict(n=128, bq=16, bk=16, tile=(64, 16), density=0.5),  # query direction only
    dict(n=96, bq=16, bk=16, tile=(16, 32), density=0.4, causal=False, hq=4, hk=2),  # key direction only, GQA
    dict(n=100, bq=32, bk=16, tile=(64, 32), density=0.2, window=40),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_fine_layout_at_a_coarse_tile(case):
    """A layout finer than the compute tile (SALE's 64 x 32 at 128 x 64): the forward visits the coarsened
    layout's tiles and masks elements outside the fine blocks, so it equals the fine layout's attention (brute
    force in float64), including rows that a tile's fine mask leaves without keys and rows with none at all."""
    from litctx_kernels.triton.attention import _Spec, _coarse_tile

    case = dict(case)
    n, causal, window = case.pop("n"), case.pop("causal", True), case.pop("window", None)
    hq, hk = case.pop("hq", 2), case.pop("hk", 1)
    lay = random_layout(1, hq, n, n, case.pop("bq"), case.pop("bk"), case.pop("density"), seed=n + 3, causal=causal)
    mask = lay.to_block_mask().clone()
    mask[0, 1, 1] = False  # one query block of head 1 with no keys at all
    lay = BlockLayout.from_block_mask(mask, lay.block_q, lay.block_k, (n, n))
    tile = case.pop("tile")
    spec = _Spec(scale=1.0, causal=causal, q_offset=0, window=window, layout=lay, q_index=None, lssa=False,
                 tile=tile)
    assert _coarse_tile(spec) == tile  # the coarse-tile path (layout mode 3) is the one under test
    # the tiles cover elements the fine mask must drop
    assert int(lay.coarsen(*tile).kv_num_blocks.sum()) * tile[0] * tile[1] > int(lay.kv_num_blocks.sum()) * (
        lay.block_q * lay.block_k)
    q, k, v = make_qkv(hq=hq, hk=hk, n_q=n, d=32, seed=37)
    o, lse = triton_attention(q, k, v, causal=causal, window=window, layout=lay, tile=tile)
    ro, rl = brute_attention(q.double(), k.double(), v.double(), causal=causal, window=window, layout=lay)
    assert_close(o, ro, ratio=1e-5, name="o vs brute")
    check_lse(lse, rl, 1e-5, name="lse vs brute")
    bq = lay.block_q
    assert (o[:, 1, bq:2 * bq] == 0).all() and (lse[:, 1, bq:2 * bq] == -math.inf).all()
    # the backward runs at the fine tiles and sees the same layout
    q.requires_grad_(True)
    o2, _ = triton_attention(q, k, v, causal=causal, window=window, layout=lay, tile=tile)
    o2.sum().backward()
    q64 = q.detach().double().requires_grad_(True)
    brute_attention(q64, k.double(), v.double(), causal=causal, window=window, layout=lay)[0].sum().backward()
    assert_close(q.grad, q64.grad, ratio=1e-5, name="dq vs brute")


def test_tile_errors_name_what_is_valid():
    lay = random_layout(1, 1, 64, 64, 32, 16, 0.5, seed=1)
    q, k, v = make_qkv(hq=1, hk=1, n_q=64, d=16, seed=2)
    for bad in [(48, 16), (32,), (8, 16), "128x64"]:
        with pytest.raises(ValueError, match="tile"):
            triton_attention(q, k, v, layout=lay, tile=bad)
    with pytest.raises(ValueError, match=r"multiple of the layout's blocks \(32, 16\)"):
        triton_attention(q, k, v, layout=lay, tile=(16, 16))


def test_full_layout_equals_dense():
    q, k, v = make_qkv(hq=2, hk=1, n_q=100, d=32, seed=37)
    lay = BlockLayout.causal(100, 100, 32, 16, device=DEVICE)
    o1, l1 = triton_attention(q, k, v, layout=lay)
    o2, l2 = triton_attention(q, k, v)
    assert_close(o1, o2, ratio=1e-6)
    assert_close(l1, l2, ratio=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# query subsets
# ----------------------------------------------------------------------------------------------------------------
def _qidx(kind, b, h, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        return QueryIndex.from_mask((torch.rand(b, h, n, generator=gen) < 0.4).to(DEVICE))
    if kind == "all":
        return QueryIndex.all(b, h, n, device=DEVICE)
    if kind == "none_padded":  # 5 padded slots, nothing routed
        return QueryIndex(torch.full((b, h, 5), -1, dtype=torch.int32, device=DEVICE),
                          torch.zeros(b, h, dtype=torch.int32, device=DEVICE), n)
    if kind == "none":
        return QueryIndex.from_mask(torch.zeros(b, h, n, dtype=torch.bool, device=DEVICE))
    raise ValueError(kind)


@pytest.mark.parametrize("case", [
    dict(kind="random", hq=4, hk=2, ih=4, n_q=100),
    dict(kind="random", hq=2, hk=1, ih=1, n_q=63, n_k=100, window=30),
    dict(kind="all", hq=2, hk=1, ih=2, n_q=100),
    dict(kind="none_padded", hq=2, hk=1, ih=2, n_q=50),
    dict(kind="none", hq=2, hk=1, ih=2, n_q=50),
    dict(kind="random", hq=2, hk=1, ih=2, n_q=100, layout=0.4),
    dict(kind="random", hq=2, hk=2, ih=2, n_q=100, score_mode="lssa"),
    dict(kind="random", hq=2, hk=1, ih=2, n_q=100, causal=False),
    dict(kind="random", hq=2, hk=1, ih=2, n_q=100, layout=0.4, score_mode="lssa", dtype=torch.float16),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_q_index(case):
    case = dict(case)
    dtype = case.pop("dtype", torch.float32)
    n_q = case.pop("n_q")
    n_k = case.pop("n_k", n_q)
    qi = _qidx(case.pop("kind"), 1, case.pop("ih"), n_q, seed=n_q)
    density = case.pop("layout", None)
    if density is not None:
        case["layout"] = random_layout(1, case["hq"], n_q, n_k, 16, 16, density, seed=3)
    q, k, v = make_qkv(n_q=n_q, n_k=n_k, hq=case.pop("hq"), hk=case.pop("hk"), d=32, dtype=dtype, seed=41)
    o, lse = run_parity(q, k, v, q_index=qi, **case)
    pad = (qi.idx < 0).expand(o.shape[:3])
    assert (o[pad] == 0).all() and (lse[pad] == -math.inf).all()


def test_q_index_all_routed_equals_dense():
    q, k, v = make_qkv(hq=2, hk=1, n_q=100, d=32, seed=43)
    o1, l1 = triton_attention(q, k, v, q_index=QueryIndex.all(1, 2, 100, device=DEVICE))
    o2, l2 = triton_attention(q, k, v)
    assert_close(o1, o2, ratio=1e-6)
    assert_close(l1, l2, ratio=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# every output element written (NaN-poisoned allocations), determinism, errors, import hygiene
# ----------------------------------------------------------------------------------------------------------------
def _poison(monkeypatch):
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64, torch.int8):
            t.fill_(-7)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(real_empty_like(*a, **kw)))


@pytest.mark.parametrize("case", ["dense", "window", "layout_empty_rows", "q_index", "lssa_qidx_layout"])
def test_nan_poison_every_output_written(case, monkeypatch):
    q, k, v = make_qkv(hq=4, hk=2, n_q=100, n_k=100, d=32, dv=16, seed=47)
    kw = {}
    if case == "window":
        kw = dict(window=20, q_offset=-3)
    elif case == "layout_empty_rows":
        kw = dict(layout=random_layout(1, 4, 100, 100, 16, 32, 0.2, seed=2))
    elif case == "q_index":
        kw = dict(q_index=_qidx("random", 1, 4, 100, seed=2))
    elif case == "lssa_qidx_layout":
        kw = dict(q_index=_qidx("random", 1, 4, 100, seed=4), layout=random_layout(1, 4, 100, 100, 16, 16, 0.3, 6),
                  score_mode="lssa")
    gen = torch.Generator().manual_seed(1)
    o_ref, _ = triton_attention(q, k, v, **kw)
    go = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    gl = torch.randn(o_ref.shape[:3], generator=gen, dtype=torch.float64).to(DEVICE)
    clean = grads(lambda a, b_, c: triton_attention(a, b_, c, **kw), q, k, v, go, gl)
    _poison(monkeypatch)
    dirty = grads(lambda a, b_, c: triton_attention(a, b_, c, **kw), q, k, v, go, gl)
    for name, a, b_ in zip(("o", "lse", "dq", "dk", "dv"), clean, dirty):
        assert not torch.isnan(b_).any(), f"{name}: unwritten (NaN) elements"
        assert torch.equal(a, b_), f"{name}: differs with poisoned allocations"


def test_backward_is_deterministic_with_gqa():
    q, k, v = make_qkv(hq=4, hk=1, n_q=64, d=16, seed=53)
    go = torch.randn(1, 4, 64, 16, dtype=torch.float64).to(DEVICE)
    gl = torch.zeros(1, 4, 64, dtype=torch.float64).to(DEVICE)
    a = grads(lambda x, y, z: triton_attention(x, y, z), q, k, v, go, gl)
    b_ = grads(lambda x, y, z: triton_attention(x, y, z), q, k, v, go, gl)
    for x, y in zip(a, b_):
        assert torch.equal(x, y)


def test_errors_name_the_argument(monkeypatch):
    q, k, v = make_qkv(hq=2, hk=1, n_q=32, d=16)
    with pytest.raises(ValueError, match="window requires causal"):
        triton_attention(q, k, v, causal=False, window=4)
    with pytest.raises(ValueError, match="window must be >= 1"):
        triton_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        triton_attention(q[:, :1], k.expand(1, 2, 32, 16), v.expand(1, 2, 32, 16))
    with pytest.raises(TypeError, match="share a dtype"):
        triton_attention(q, k.half(), v)
    with pytest.raises(ValueError, match="score_mode"):
        triton_attention(q, k, v, score_mode="lssar")
    with pytest.raises(ValueError, match="seq_lens"):
        triton_attention(q, k, v, layout=BlockLayout.causal(64, 64, 16, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of 16"):
        triton_attention(q, k, v, layout=BlockLayout.causal(32, 32, 8, device=DEVICE))
    with pytest.raises(ValueError, match="q_index.n_q"):
        triton_attention(q, k, v, q_index=QueryIndex.all(1, 2, 16, device=DEVICE))
    with pytest.raises(ValueError, match="k head dim"):
        triton_attention(q, k[..., :8], v)
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="CUDA"):
            triton_attention(q, k, v)


def test_kernel_modules_load_lazily_and_survive_missing_triton():
    """``import litctx_kernels.triton`` loads no kernel module; without triton the package still imports and
    accessing a kernel raises a clear ImportError (torch itself may import triton; that is not ours)."""
    code = (
        "import sys\n"
        "import litctx_kernels, litctx_kernels.triton\n"
        "assert not any(m.startswith('litctx_kernels.triton.') and m != 'litctx_kernels.triton._compat' for m in sys.modules), "
        "sorted(m for m in sys.modules if m.startswith('litctx_kernels.triton'))\n"
        "print('lazy ok')\n"
    )
    missing = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "import litctx_kernels, litctx_kernels.triton\n"
        "assert not litctx_kernels.triton.HAS_TRITON\n"
        "try:\n"
        "    litctx_kernels.triton.triton_attention\n"
        "except ImportError as e:\n"
        "    assert 'triton' in str(e)\n"
        "    print('missing ok')\n"
    )
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for src, token in ((code, "lazy ok"), (missing, "missing ok")):
        res = subprocess.run([sys.executable, "-c", src], cwd=root, env=env, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0 and token in res.stdout, res.stderr[-2000:]


@pytest.mark.parametrize("causal,key_mask", [(True, False), (False, True)])
def test_backward_alone_from_another_forward(causal, key_mask):
    """``triton_attention_backward`` (K2 on a forward computed elsewhere, the SDPA route's gradient through the
    LSE) gives the float64 gradients of ``(o * w).sum() + (lse * u).sum()``, GQA included."""
    from litctx_kernels.triton.attention import triton_attention_backward

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, 64, 32, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    keep = None
    if key_mask:
        keep = torch.rand(1, 2, 64, generator=gen) > 0.3
        keep[..., 0] = True
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    o, lse = attention_reference(qr, kr, vr, causal=causal,
                                 key_mask=None if keep is None else keep.repeat_interleave(2, 1))
    w, u = torch.randn(o.shape, generator=gen, dtype=torch.float64), torch.randn(lse.shape, generator=gen,
                                                                                  dtype=torch.float64)
    ref = torch.autograd.grad((o * w).sum() + (lse * u).sum(), (qr, kr, vr))
    dev = dict(device=DEVICE, dtype=torch.float32)
    got = triton_attention_backward(q.to(**dev), k.to(**dev), v.to(**dev), o.detach().to(**dev),
                                    lse.detach().to(**dev), w.to(**dev), u.to(**dev), causal=causal,
                                    key_mask=None if keep is None else keep.to(DEVICE))
    for g, r, name in zip(got, ref, "qkv"):
        assert g.shape == r.shape
        assert_close(g.double().cpu(), r, 1e-5, name=f"d{name}")
