"""The CPU block-sparse path: exact parity with the reference (forward and backward) and that it computes
only the listed blocks."""

from __future__ import annotations

import math

import pytest
import torch

from litctx_kernels import BlockLayout
from litctx_kernels.cpu_sparse import block_sparse_attention_cpu, plan_buckets
from litctx_kernels.layouts import causal_block_mask
from litctx_kernels.reference import attention_reference
from litctx_kernels.testing import assert_close

CASES = [
    # b, hq, hk, nq, nk, d, bq, bk, causal, q_offset, window
    (2, 4, 2, 100, 100, 16, 32, 32, True, None, None),
    (1, 4, 4, 63, 130, 32, 16, 32, True, None, None),
    (1, 2, 1, 100, 100, 64, 32, 16, True, None, 40),
    (1, 2, 2, 100, 77, 16, 32, 32, False, None, None),
    (2, 4, 2, 128, 128, 64, 64, 64, True, None, None),
    (1, 2, 2, 48, 96, 16, 16, 16, True, 20, None),
]


def make(b, hq, hk, nq, nk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_(True)
            for s in ((b, hq, nq, d), (b, hk, nk, d), (b, hk, nk, d))]


def layout_for(kind, b, h, nq, nk, bq, bk, causal, q_offset, window, seed=0):
    mq, mk = math.ceil(nq / bq), math.ceil(nk / bk)
    allowed = (causal_block_mask(nq, nk, bq, bk, q_offset=q_offset, window=window) if causal
               else torch.ones(mq, mk, dtype=torch.bool))
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        m = torch.rand(b, h, mq, mk, generator=g) < 0.4
    elif kind == "empty_rows":
        m = torch.rand(b, h, mq, mk, generator=g) < 0.7
        m[:, :, ::2] = False
    elif kind == "diagonal":
        m = torch.zeros(b, h, mq, mk, dtype=torch.bool)
        for i in range(mq):
            last = allowed[i].nonzero()
            if len(last):
                m[:, :, i, last[-1]] = True
    elif kind == "sink":
        m = torch.zeros(b, h, mq, mk, dtype=torch.bool)
        m[..., 0] = True
    else:
        raise ValueError(kind)
    return BlockLayout.from_block_mask(m & allowed, bq, bk, (nq, nk))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ["random", "empty_rows", "diagonal", "sink"])
@pytest.mark.parametrize("dtype,ratio,native", [(torch.float64, 1e-12, True), (torch.float32, 1e-5, True),
                                                (torch.float32, 1e-5, False)])
def test_matches_reference_forward_and_backward(case, kind, dtype, ratio, native):
    """fp64 runs the flash-call path; fp32 the native forward and backward (when built), and with ``native=False``
    the flash-call path."""
    b, hq, hk, nq, nk, d, bq, bk, causal, off, window = case
    q, k, v = make(b, hq, hk, nq, nk, d, dtype)
    lay = layout_for(kind, b, hq, nq, nk, bq, bk, causal, off, window)
    o, lse = block_sparse_attention_cpu(q, k, v, lay, causal=causal, q_offset=off, window=window, native=native)
    ro, rlse = attention_reference(*(t.double() for t in (q, k, v)), layout=lay, causal=causal, q_offset=off,
                                   window=window)
    assert_close(o, ro, ratio=ratio)
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), fin), "rows without keys must have lse = -inf"
    assert (o.detach()[~fin] == 0).all()
    assert_close(lse[fin], rlse[fin], ratio=ratio)
    go = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), go)
    want = torch.autograd.grad(ro, (q, k, v), go.double())
    for name, a, e in zip("qkv", got, want):
        assert_close(a, e, ratio=ratio, name=f"d{name}")


def test_fp16_within_tolerance():
    q, k, v = make(1, 2, 2, 96, 96, 32, torch.float16)
    lay = layout_for("random", 1, 2, 96, 96, 32, 32, True, None, None)
    o, _ = block_sparse_attention_cpu(q, k, v, lay)
    ro, _ = attention_reference(*(t.double() for t in (q, k, v)), layout=lay)
    assert_close(o, ro, ratio=5e-3)


@pytest.mark.parametrize("d,dv", [(48, 32), (16, 40)])
def test_value_head_dim_may_differ(d, dv):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 70, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 70, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 70, dv, generator=g, dtype=torch.float64, requires_grad=True)
    lay = layout_for("random", 1, 4, 70, 70, 16, 16, True, None, None, seed=6)
    o, _ = block_sparse_attention_cpu(q, k, v, lay)
    ro, _ = attention_reference(q, k, v, layout=lay)
    assert o.shape[-1] == dv
    assert_close(o, ro, ratio=1e-12)
    for a, e in zip(torch.autograd.grad(o.sum(), (q, k, v)), torch.autograd.grad(ro.sum(), (q, k, v))):
        assert_close(a, e, ratio=1e-12)


def test_gradient_through_lse():
    q, k, v = make(1, 2, 1, 40, 40, 16, torch.float64)
    lay = layout_for("random", 1, 2, 40, 40, 16, 16, True, None, None, seed=3)
    o, lse = block_sparse_attention_cpu(q, k, v, lay)
    ro, rlse = attention_reference(q, k, v, layout=lay)
    w = torch.randn_like(lse).masked_fill(~torch.isfinite(rlse), 0)
    safe = lambda x: torch.where(torch.isfinite(x), x, torch.zeros_like(x))  # noqa: E731
    got = torch.autograd.grad(o.sum() + (safe(lse) * w).sum(), (q, k, v))
    want = torch.autograd.grad(ro.sum() + (safe(rlse) * w).sum(), (q, k, v))
    for a, e in zip(got, want):
        assert_close(a, e, ratio=1e-10)


def test_plan_gathers_only_listed_blocks_and_small_masks():
    nq = nk = 256
    lay = layout_for("random", 2, 4, nq, nk, 32, 32, True, None, None, seed=9)
    plan = plan_buckets(lay, 2, 4, 2, causal=True, q_offset=0, window=None, dtype=torch.float32)
    gathered = sum(bk.kv_ids.numel() for bk in plan.buckets)
    assert gathered == int(lay.kv_num_blocks.sum())  # every listed causal block once, nothing else
    for bk in plan.buckets:
        c = bk.kv_ids.shape[1]
        assert bk.mask is None or tuple(bk.mask.shape) == (1, 1, 32, c * 32)
    entries = sum(bk.q_ids.numel() for bk in plan.buckets) + plan.empty_q_ids.numel()
    assert entries == 2 * 4 * (nq // 32)
    # far fewer calls than query blocks: blocks with the same shape of work share one call
    assert len(plan.buckets) < entries / 2


def test_errors_name_the_problem():
    q, k, v = make(1, 2, 2, 32, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="seq_lens"):
        block_sparse_attention_cpu(q, k, v, BlockLayout.causal(64, 64, 16))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        block_sparse_attention_cpu(q, k[:, :1].expand(1, 3, 32, 16), v[:, :1].expand(1, 3, 32, 16),
                                   BlockLayout.causal(32, 32, 16))


def test_chunk_sizing_counts_the_key_mask_tile(monkeypatch):
    """With a key mask each chunk also builds an additive ``[n, 1, bq, c * bk]`` mask: the per-entry byte count
    (and the workspace sized from it) includes it, and a tight workspace limit still gives the reference."""
    import litctx_kernels.cpu_sparse as cs

    q, k, v = make(1, 4, 2, 96, 96, 16, torch.float32)
    lay = layout_for("random", 1, 4, 96, 96, 32, 32, True, None, None)
    keep = torch.rand(1, 4, 96, generator=torch.Generator().manual_seed(2)) > 0.3
    seen, real = [], cs._chunks

    def spy(bucket, per_entry_bytes, limit):
        seen.append((bucket.kv_ids.shape[1], per_entry_bytes))
        return real(bucket, per_entry_bytes, limit)

    monkeypatch.setattr(cs, "_chunks", spy)
    limit = 3 * 32 * 32 * 4 * 2
    o, lse = block_sparse_attention_cpu(q, k, v, lay, key_mask=keep, max_workspace_bytes=limit)
    assert seen and all(per == c * 32 * (16 + 16 + 32) * 4 for c, per in seen)
    seen.clear()
    block_sparse_attention_cpu(q, k, v, lay, max_workspace_bytes=limit, native=False)
    assert seen and all(per == c * 32 * (16 + 16) * 4 for c, per in seen)
    ro, rlse = attention_reference(*(t.double() for t in (q, k, v)), layout=lay, key_mask=keep)
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert_close(o, ro, ratio=1e-5)
    assert_close(lse[fin], rlse[fin], ratio=1e-5)


# --- the native fp32 inference forward -----------------------------------------------------------------------
# built once per machine (~40 s on 2 cores, then cached on disk): the first run of this module pays it once


@pytest.fixture(scope="module")
def native():
    from litctx_kernels.cpu_sparse import native_kernel, native_status

    mod = native_kernel()
    if mod is None:
        pytest.skip(f"native forward unavailable: {native_status().get('reason')}")
    return mod


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ["random", "empty_rows", "diagonal", "sink"])
def test_native_forward_matches_reference(native, monkeypatch, case, kind):
    import litctx_kernels.cpu_sparse as cs

    calls = []
    real = cs._native_forward
    monkeypatch.setattr(cs, "_native_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    b, hq, hk, nq, nk, d, bq, bk, causal, off, window = case
    q, k, v = (t.detach() for t in make(b, hq, hk, nq, nk, d, torch.float32))
    lay = layout_for(kind, b, hq, nq, nk, bq, bk, causal, off, window)
    with torch.no_grad():
        o, lse = block_sparse_attention_cpu(q, k, v, lay, causal=causal, q_offset=off, window=window)
    assert calls, "an fp32 inference call takes the native forward"
    ro, rlse = attention_reference(q.double(), k.double(), v.double(), layout=lay, causal=causal, q_offset=off,
                                   window=window)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (b, hq, nq)
    assert_close(o, ro, ratio=1e-5)
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), fin), "rows without keys must have lse = -inf"
    assert (o[~fin] == 0).all()
    assert_close(lse[fin], rlse[fin], ratio=1e-5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kv_tile", [1, 3 * 16, 10**6])
def test_native_forward_key_groups_match_reference(native, case, kv_tile):
    """One key block per gemm (kv_tile below the block), a few (gathered when not adjacent) and every listed block
    in one group give the same attention as the float64 reference."""
    import litctx_kernels.cpu_sparse as cs

    b, hq, hk, nq, nk, d, bq, bk, causal, off, window = case
    q, k, v = (t.detach() for t in make(b, hq, hk, nq, nk, d, torch.float32))
    lay = layout_for("random", b, hq, nq, nk, bq, bk, causal, off, window)
    o, lse = cs._native_forward(native, q, k, v, lay, scale=d ** -0.5, causal=causal,
                                q_offset=cs.resolve_q_offset(nq, nk, off), window=window, kv_tile=kv_tile)
    ro, rlse = attention_reference(q.double(), k.double(), v.double(), layout=lay, causal=causal, q_offset=off,
                                   window=window)
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert_close(o, ro, ratio=1e-5)
    assert_close(lse[fin], rlse[fin], ratio=1e-5)


def _dense_probs(q, k, layout, causal, q_offset):
    """Brute-force softmax probabilities ``[B, Hq, Nq, Nk]`` under a block layout and the causal mask (rows with
    no allowed key are 0)."""
    from litctx_kernels.layouts import resolve_q_offset

    b, hq, nq, d = q.shape
    nk = k.shape[2]
    kk = k.repeat_interleave(hq // k.shape[1], dim=1)
    s = q @ kk.transpose(-1, -2) / math.sqrt(d)
    blocks = layout.expand(b, hq).to_block_mask()
    allowed = blocks.repeat_interleave(layout.block_q, 2).repeat_interleave(layout.block_k, 3)[..., :nq, :nk]
    if causal:
        off = resolve_q_offset(nq, nk, q_offset)
        allowed = allowed & (torch.arange(nk).view(1, -1) <= torch.arange(nq).view(-1, 1) + off)
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)


@pytest.mark.parametrize("case", [c for c in CASES if c[10] is None])  # the fused statistics take no window
@pytest.mark.parametrize("kind", ["full", "random"])
def test_native_colstats_match_reference(native, case, kind):
    """Attention plus per-key statistics in one native call equal the float64 reference's output, LSE and column
    sums of P and P^2 (dense causal or non-causal layouts, and a random block layout)."""
    from litctx_kernels.cpu_sparse import native_attention_colstats
    from litctx_kernels.reference import attention_colstats_reference

    b, hq, hk, nq, nk, d, bq, bk, causal, off, _ = case
    q, k, v = (t.detach() for t in make(b, hq, hk, nq, nk, d, torch.float32))
    lay = None if kind == "full" else layout_for("random", b, hq, nq, nk, bq, bk, causal, off, None)
    o, lse, p_sum, p2_sum = native_attention_colstats(q, k, v, causal=causal, q_offset=off, block=bq, layout=lay)
    qd, kd, vd = q.double(), k.double(), v.double()
    ro, rlse = attention_reference(qd, kd, vd, layout=lay, causal=causal, q_offset=off)
    if lay is None:
        stats = attention_colstats_reference(qd, kd, vd, causal=causal, q_offset=off, moments="attention")
        want1, want2 = stats.p_sum, stats.p2_sum
    else:  # brute force: the probabilities of the layout's attention, summed per key
        p = _dense_probs(qd, kd, lay, causal, off)
        want1, want2 = p.sum(2), (p * p).sum(2)
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert_close(o, ro, ratio=1e-5)
    assert p_sum.shape == (b, hq, nk) and p2_sum.shape == (b, hq, nk)
    assert_close(p_sum, want1, ratio=1e-5)
    assert_close(p2_sum, want2, ratio=1e-5)


def test_native_forward_runs_on_every_thread(native):
    """The forward's at::parallel_for must really fan out (a build without OpenMP runs it on one thread)."""
    if not torch.backends.openmp.is_available():
        pytest.skip("torch built without OpenMP")
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert native.parallel_threads(64) == 2
        torch.set_num_threads(1)
        assert native.parallel_threads(64) == 1
    finally:
        torch.set_num_threads(prev)


def test_native_not_taken_with_key_mask_other_dtype_or_kill_switches(native, monkeypatch):
    """Calls that need a gradient take the native forward and backward; a key mask, fp64, ``native=False`` and
    ``LITCTX_CPU_SPARSE_NATIVE=0`` keep the flash-call path; ``LITCTX_CPU_SPARSE_NATIVE_BACKWARD=0`` sends only the
    calls that need a gradient there."""
    import litctx_kernels.cpu_sparse as cs

    fwd, bwd = [], []
    real_f, real_b = cs._native_forward, cs._native_backward
    monkeypatch.setattr(cs, "_native_forward", lambda *a, **kw: fwd.append(1) or real_f(*a, **kw))
    monkeypatch.setattr(cs, "_native_backward", lambda *a, **kw: bwd.append(1) or real_b(*a, **kw))
    b, hq, hk, nq, nk, d, bq, bk, causal, off, window = CASES[0]
    q, k, v = make(b, hq, hk, nq, nk, d, torch.float32)
    lay = layout_for("random", b, hq, nq, nk, bq, bk, causal, off, window)
    want, _ = attention_reference(q.detach(), k.detach(), v.detach(), layout=lay, causal=causal)
    o, _ = block_sparse_attention_cpu(q, k, v, lay, causal=causal)  # grad required: native forward and backward
    o.sum().backward()
    assert (fwd, bwd) == ([1], [1]) and q.grad is not None
    monkeypatch.setenv(cs.NATIVE_BACKWARD_ENV, "0")
    o1, _ = block_sparse_attention_cpu(q, k, v, lay, causal=causal)  # the flash-call path and its backward
    o1.sum().backward()
    with torch.no_grad():
        block_sparse_attention_cpu(q, k, v, lay, causal=causal)  # inference keeps the native forward
    assert (fwd, bwd) == ([1, 1], [1])
    monkeypatch.delenv(cs.NATIVE_BACKWARD_ENV)
    with torch.no_grad():
        km = torch.ones(b, hq, nk, dtype=torch.bool)
        block_sparse_attention_cpu(q, k, v, lay, causal=causal, key_mask=km)  # key mask: flash-call path
        block_sparse_attention_cpu(q.double(), k.double(), v.double(), lay, causal=causal)  # fp64
        o2, _ = block_sparse_attention_cpu(q, k, v, lay, causal=causal, native=False)
        monkeypatch.setenv(cs.NATIVE_ENV, "0")
        o3, _ = block_sparse_attention_cpu(q, k, v, lay, causal=causal)
    assert (fwd, bwd) == ([1, 1], [1])
    for x in (o, o1, o2, o3):
        assert_close(x.detach(), want, ratio=1e-5)


# --- the native backward --------------------------------------------------------------------------------------


def _native_calls(monkeypatch):
    import litctx_kernels.cpu_sparse as cs

    calls = []
    real = cs._native_backward
    monkeypatch.setattr(cs, "_native_backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ["random", "empty_rows", "diagonal", "sink"])
@pytest.mark.parametrize("with_lse", [False, True])
def test_native_backward_matches_reference(native, monkeypatch, case, kind, with_lse):
    """dq, dk, dv of the native backward equal float64 reference autograd within 1e-5 (causal, window, q_offset
    inside the sequence, ragged lengths, GQA, non-causal), also with a gradient through ``lse`` (folded into dS:
    ``dS = P (dP - rowsum(dO * O) + grad_lse)``); rows with no valid key (most cases have some; 'empty_rows' lists
    nothing for every other query block) take no gradient whatever flows into their ``lse``."""
    calls = _native_calls(monkeypatch)
    b, hq, hk, nq, nk, d, bq, bk, causal, off, window = case
    q, k, v = make(b, hq, hk, nq, nk, d, torch.float32)
    lay = layout_for(kind, b, hq, nq, nk, bq, bk, causal, off, window)
    o, lse = block_sparse_attention_cpu(q, k, v, lay, causal=causal, q_offset=off, window=window)
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ro, rlse = attention_reference(qd, kd, vd, layout=lay, causal=causal, q_offset=off, window=window)
    g = torch.Generator().manual_seed(7)
    go = torch.randn(o.shape, generator=g)
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), fin)
    if with_lse:
        gl = torch.randn(lse.shape, generator=g)  # also into the rows without keys (lse = -inf): no effect
        got = torch.autograd.grad((o, lse), (q, k, v), (go, gl))
        want = torch.autograd.grad((ro, torch.where(fin, rlse, torch.zeros_like(rlse))), (qd, kd, vd),
                                   (go.double(), gl.double().masked_fill(~fin, 0)))
    else:
        got = torch.autograd.grad(o, (q, k, v), go)
        want = torch.autograd.grad(ro, (qd, kd, vd), go.double())
    assert calls == [1], "an fp32 call that needs a gradient takes the native backward"
    for name, a, e in zip("qkv", got, want):
        assert a.dtype == torch.float32 and torch.isfinite(a).all()
        assert_close(a, e, ratio=1e-5, name=f"d{name}")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kv_tile", [1, 3 * 16, 10**6])
def test_native_backward_key_groups_match_reference(native, case, kv_tile):
    """One key block per group, a few, and every listed block in one group give the reference's gradients."""
    import litctx_kernels.cpu_sparse as cs

    b, hq, hk, nq, nk, d, bq, bk, causal, off, window = case
    q, k, v = (t.detach() for t in make(b, hq, hk, nq, nk, d, torch.float32))
    lay = layout_for("random", b, hq, nq, nk, bq, bk, causal, off, window)
    kw = dict(scale=d ** -0.5, causal=causal, q_offset=cs.resolve_q_offset(nq, nk, off), window=window,
              kv_tile=kv_tile)
    o, lse = cs._native_forward(native, q, k, v, lay, **kw)
    go = torch.randn(o.shape, generator=torch.Generator().manual_seed(3))
    dq, dk, dv = cs._native_backward(native, q, k, v, o, lse, go, None, lay, **kw)
    qd, kd, vd = (t.double().requires_grad_(True) for t in (q, k, v))
    ro, _ = attention_reference(qd, kd, vd, layout=lay, causal=causal, q_offset=off, window=window)
    for name, a, e in zip("qkv", (dq, dk, dv), torch.autograd.grad(ro, (qd, kd, vd), go.double())):
        assert_close(a, e, ratio=1e-5, name=f"d{name}")


def test_native_backward_is_deterministic(native):
    """Each kv head's dK / dV is accumulated by one task in a fixed order: two runs give identical bits."""
    q, k, v = make(2, 8, 2, 300, 300, 32, torch.float32)
    lay = BlockLayout.random_causal(300, 32, 0.4, batch=2, heads=8, seed=4)
    grads = []
    for _ in range(2):
        o, lse = block_sparse_attention_cpu(q, k, v, lay)
        grads.append(torch.autograd.grad((o * o).sum() + lse.sum(), (q, k, v)))
    for a, b_ in zip(*grads):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("d,dv", [(24, 40), (40, 24), (72, 72)])
def test_native_pads_head_sizes(native, monkeypatch, d, dv):
    """Head sizes that are not whole vectors are zero-padded (exact) for the native kernels, forward and backward."""
    calls = _native_calls(monkeypatch)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 90, d, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 90, d, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 90, dv, generator=g, requires_grad=True)
    lay = layout_for("random", 1, 4, 90, 90, 32, 32, True, None, None, seed=6)
    o, lse = block_sparse_attention_cpu(q, k, v, lay)
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ro, rlse = attention_reference(qd, kd, vd, layout=lay)
    assert o.shape == (1, 4, 90, dv)
    assert_close(o, ro, ratio=1e-5)
    assert_close(lse, rlse, ratio=1e-5)
    go = torch.randn(o.shape, generator=g)
    got = torch.autograd.grad(o, (q, k, v), go)
    assert calls == [1]
    for name, a, e in zip("qkv", got, torch.autograd.grad(ro, (qd, kd, vd), go.double())):
        assert a.shape == e.shape
        assert_close(a, e, ratio=1e-5, name=f"d{name}")


def test_native_exp2_within_4e7_of_exp2(native):
    """The kernels' vector 2^x (degree-5 polynomial + scalef) stays within 4e-7 relative of float64 exp2 over the
    range the softmax uses; below 2^-126 (no denormals), -inf and NaN (masked entries) give 0."""
    x = torch.linspace(-126.0, 10.0, 1_000_003)
    y = native.vexp2_test(x)
    rel = (y.double() - torch.exp2(x.double())).abs() / torch.exp2(x.double())
    assert float(rel.max()) < 4e-7
    special = native.vexp2_test(torch.tensor([float("-inf"), float("nan"), -127.5, -200.0, 0.0, 1.0]))
    assert special.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 2.0]
