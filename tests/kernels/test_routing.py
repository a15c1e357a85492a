"""The CUDA routing of ``litctx_kernels.attention`` on CPU: the table's matching rules and defaults, and the
dispatcher's routed paths with a mocked CUDA device whose SDPA / FlexAttention ops are CPU stand-ins (PyTorch's
CPU flash kernel, eager FlexAttention), checked against the float64 reference: scaling, GQA (with an op that
refuses grouped heads), the memory-efficient op's padded LSE, key masks, rows without keys, a gradient through
the LSE, a backend that fails at run time, and one log line per decision."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import litctx_kernels
import litctx_kernels.dispatch as dispatch
import litctx_kernels.routing as routing
import litctx_kernels.torch_kernels as tk
from litctx_kernels import BlockLayout
from litctx_kernels.reference import attention_reference
from litctx_kernels.routing import CallShape, RoutingRow, RoutingTable, load_table, route
from litctx_kernels.testing import assert_attention_close, assert_close

GPU = "Fake GPU 80GB"


def _call(kind="causal", dtype="bfloat16", n=4096, d=64, dv=None, triton=True, grad=False):
    return CallShape(kind=kind, dtype=dtype, n_q=n, n_k=n, head_dim=d, head_dim_v=dv or d, triton=triton, grad=grad)


# --- the table -------------------------------------------------------------------------------------------------

def test_defaults_without_a_row():
    empty = RoutingTable()
    assert route(GPU, _call("causal", "bfloat16"), empty).backend == "sdpa_flash"
    assert route(GPU, _call("dense", "float16"), empty).backend == "sdpa_flash"
    assert route(GPU, _call("causal", "float32"), empty).backend == "sdpa_efficient"  # flash takes half only
    assert route(GPU, _call("key_mask", "bfloat16"), empty).backend == "sdpa_efficient"
    assert route(GPU, _call("block_sparse", "bfloat16"), empty).backend == "triton"
    # shapes SDPA cannot take go to Triton; nothing at all without Triton
    assert route(GPU, _call("causal", "bfloat16", d=72, dv=64), empty).backend == "triton"
    assert route(GPU, _call("causal", "bfloat16", d=320), empty).backend == "triton"
    assert route(GPU, _call("block_sparse", triton=False), empty).backend is None
    assert "default" in route(GPU, _call(), empty).reason


def test_rows_match_device_kind_dtype_length_and_grad():
    rows = (RoutingRow(device=GPU, kind="causal", dtype="bfloat16", backend="triton", n_min=1, n_max=8192,
                       head_dim=64, ms={"sdpa_flash": 2.0, "triton": 1.5}),
            RoutingRow(device=GPU, kind="block_sparse", dtype="bfloat16", backend="flex", n_min=16384),
            RoutingRow(device=GPU, kind="causal", dtype="bfloat16", backend="sdpa_cudnn", grad=False,
                       n_min=8193))
    table = RoutingTable(rows, "test")
    got = route(GPU, _call("causal", n=4096), table)
    assert got.backend == "triton" and "triton 1.5 ms" in got.reason
    assert route(GPU, _call("causal", n=16384), table).backend == "sdpa_cudnn"
    assert route(GPU, _call("causal", n=16384, grad=True), table).backend == "sdpa_flash"  # cuDNN: forward only
    assert route(GPU, _call("causal", n=4096, d=128), table).backend == "sdpa_flash"  # head dim differs
    assert route("Another GPU", _call("causal", n=4096), table).backend == "sdpa_flash"
    assert route(GPU, _call("causal", "float16", n=4096), table).backend == "sdpa_flash"
    assert route(GPU, _call("block_sparse", n=32768), table).backend == "flex"
    assert route(GPU, _call("block_sparse", n=8192), table).backend == "triton"
    # a backend that failed at run time is skipped
    assert route(GPU, _call("causal", n=4096), table, exclude=["triton"]).backend == "sdpa_flash"
    # a row whose winner cannot serve the call (flash in fp32) falls back to the default
    fp32_row = RoutingTable((RoutingRow(device=GPU, kind="causal", dtype="float32", backend="sdpa_flash"),))
    assert route(GPU, _call("causal", "float32"), fp32_row).backend == "sdpa_efficient"


def test_block_rows_and_the_tile_candidate():
    """Block-sparse rows carry the layout's blocks: SALE's 64 x 32 layouts and Prism's 128 x 128 ones route apart;
    K1 at its own tile serves forward calls whose layout is finer than the tile, never a backward."""
    def sparse(block, fine, grad=False, n=8192):
        return CallShape(kind="block_sparse", dtype="bfloat16", n_q=n, n_k=n, head_dim=64, head_dim_v=64,
                         grad=grad, block=block, fine_layout=fine)

    assert routing.eligible_backends(sparse((64, 32), True)) == ["triton", "flex", "triton_tile"]
    assert "triton_tile" not in routing.eligible_backends(sparse((64, 32), True, grad=True))
    assert "triton_tile" not in routing.eligible_backends(sparse((128, 128), False))
    table = RoutingTable((
        RoutingRow(device=GPU, kind="block_sparse", dtype="bfloat16", backend="triton_tile", block=[64, 32]),
        RoutingRow(device=GPU, kind="block_sparse", dtype="bfloat16", backend="flex", block=(128, 128)),
    ), "test")
    got = route(GPU, sparse((64, 32), True), table)
    assert got.backend == "triton_tile" and "blocks 64x32" in got.reason
    assert route(GPU, sparse((64, 32), True, grad=True), table).backend == "triton"  # no grad row: the default
    assert route(GPU, sparse((128, 128), False), table).backend == "flex"
    assert route(GPU, sparse((128, 64), False), table).backend == "triton"  # no row for these blocks
    assert table.rows[0].block == (64, 32)  # a JSON list becomes a tuple
    with pytest.raises(ValueError, match=r"block must be null or \[block_q, block_k\]"):
        RoutingRow(device=GPU, kind="block_sparse", dtype="bfloat16", backend="triton", block=[64])


def test_table_errors_name_the_row_and_valid_values(tmp_path):
    with pytest.raises(ValueError, match="cannot serve block_sparse"):
        RoutingRow(device=GPU, kind="block_sparse", dtype="bfloat16", backend="sdpa_flash")
    with pytest.raises(ValueError, match="kind must be one of"):
        RoutingRow(device=GPU, kind="window", dtype="bfloat16", backend="triton")
    with pytest.raises(ValueError, match="n_min <= n_max"):
        RoutingRow(device=GPU, kind="causal", dtype="bfloat16", backend="triton", n_min=10, n_max=5)
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"format": 1, "rows": [{"device": GPU, "kind": "causal", "dtype": "bfloat16",
                                                      "backend": "triton", "speed": 3}]}))
    with pytest.raises(ValueError, match=r"rows\[0\] has unknown keys \['speed'\]"):
        load_table(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_table(tmp_path / "missing.json")


def test_table_round_trips_and_shipped_table_parses(tmp_path):
    table = RoutingTable((RoutingRow(device=GPU, kind="dense", dtype="float16", backend="sdpa_efficient",
                                     n_min=1, n_max=2048, ms={"sdpa_flash": None, "sdpa_efficient": 0.5}),), "x")
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table.to_json()))
    assert load_table(path).rows == table.rows
    shipped = load_table(routing.SHIPPED_TABLE)
    assert isinstance(shipped, RoutingTable)


def test_env_names_another_table(tmp_path, monkeypatch):
    table = RoutingTable((RoutingRow(device=GPU, kind="causal", dtype="bfloat16", backend="triton"),), "env")
    path = tmp_path / "env_table.json"
    path.write_text(json.dumps(table.to_json()))
    monkeypatch.setenv(routing.TABLE_ENV, str(path))
    assert route(GPU, _call()).backend == "triton"


# --- the dispatcher with a mocked CUDA device -----------------------------------------------------------------

def _flash_cpu(q, k, v, causal, scale, attn_mask=None):
    if k.shape[1] != q.shape[1]:
        raise RuntimeError("number of heads in key/value must equal number of heads in query (stand-in)")
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=attn_mask,
                                                                       scale=scale)


def _stand_in_ops(calls):
    """CPU stand-ins with the CUDA ops' signatures and output conventions (the efficient op pads its LSE)."""

    def flash(q, k, v, dropout, causal, debug, *, scale):
        calls.append("flash")
        o, lse = _flash_cpu(q, k, v, causal, scale)
        return o, lse, None, None, q.shape[2], k.shape[2], None, None, None

    def flash_backward(do, q, k, v, o, lse, cq, ck, mq, mk, dropout, causal, seed, offset, *, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, o, lse, 0.0, causal,
                                                                                    scale=scale)

    def efficient(q, k, v, bias, lse_flag, dropout, causal, *, scale):
        calls.append("efficient")
        mask = None if bias is None else bias[:, :, :1].contiguous()  # [B, H, 1, Nk]: the stand-in broadcasts
        o, lse = _flash_cpu(q, k, v, causal, scale, mask)
        pad = (-q.shape[2]) % 32
        lse = torch.cat([lse, torch.full((*lse.shape[:2], pad), 123.0)], -1)  # junk rows, as the CUDA op pads
        return o, lse, torch.tensor(0), torch.tensor(0)

    def efficient_backward(do, q, k, v, bias, o, lse, seed, offset, dropout, mask, causal, *, scale):
        attn = None if bias is None else bias[:, :, :1].contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, lse[..., :q.shape[2]].contiguous(), 0.0, causal, attn_mask=attn, scale=scale)
        return dq, dk, dv, None

    def flex(q, k, v, *, block_mask, scale, enable_gqa, return_aux):
        """Eager FlexAttention evaluates only the ``mask_mod`` (the compiled kernel also skips unlisted blocks):
        the stand-in folds the block structure into the mask_mod to give the compiled semantics."""
        calls.append("flex")
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        blocks = block_mask.to_dense().bool()  # [B, H, Mq, Mk]
        bq, bk = block_mask.BLOCK_SIZE
        inner = block_mask.mask_mod

        def listed(b, h, q_idx, kv_idx):
            return blocks[b, h, q_idx // bq, kv_idx // bk] & inner(b, h, q_idx, kv_idx)

        mask = BlockMask.from_kv_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, BLOCK_SIZE=(bq, bk),
                                        mask_mod=listed, seq_lengths=block_mask.seq_lengths)
        return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=enable_gqa, return_aux=return_aux)

    return dict(flash=flash, flash_backward=flash_backward, efficient=efficient,
                efficient_backward=efficient_backward, flex=flex)


@pytest.fixture
def fake_gpu(monkeypatch):
    """CPU tensors routed as if on a CUDA device named ``GPU`` with the stand-in ops and no Triton; returns the
    list of ops called."""
    calls = []
    for name, fn in _stand_in_ops(calls).items():
        monkeypatch.setattr(tk.OPS, name, fn)
    monkeypatch.setattr(dispatch, "_cuda_device_name", lambda q: GPU)
    monkeypatch.setattr(dispatch, "_triton_verify", lambda op, q, **kw: (False, "mocked: no triton"))
    monkeypatch.setattr(tk, "_REPEAT_KV", {})
    monkeypatch.setattr(dispatch, "_FAILED_ROUTES", set())
    monkeypatch.setenv(routing.TABLE_ENV, "")
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    dispatch._log_once.cache_clear()
    yield calls
    dispatch._log_once.cache_clear()


@pytest.fixture
def interpreted_k1(fake_gpu, monkeypatch):
    """The mocked GPU with Triton K1 really running, in the Triton interpreter: these tests are marked
    ``interpret`` (``make test-interpret`` sets TRITON_INTERPRET=1); selected by hand without it they skip, since
    K1 on CPU tensors exists only in the interpreter."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("K1 on CPU tensors runs only in the Triton interpreter: TRITON_INTERPRET=1 (make test-interpret)")
    pytest.importorskip("triton", reason="K1 needs the triton package")
    monkeypatch.setattr(dispatch, "_triton_verify", lambda op, q, **kw: (True, "interpreter"))
    return fake_gpu


def _use_table(monkeypatch, tmp_path, *rows):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(RoutingTable(tuple(rows), "test").to_json()))
    monkeypatch.setenv(routing.TABLE_ENV, str(path))


def _qkv(b, hq, hk, n, d, dtype=torch.float32, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(b, h, n, d, generator=gen, dtype=torch.float64).to(dtype) for h in (hq, hk, hk)]
    return [t.requires_grad_(grad) for t in out]


def _ref(q, k, v, **kw):
    return attention_reference(q.double(), k.double(), v.double(), **kw)


@pytest.mark.parametrize("causal", [True, False])
def test_fp32_calls_run_the_efficient_op_with_its_lse_sliced(fake_gpu, causal):
    q, k, v = _qkv(2, 4, 4, 100, 32)  # 100 rows: the stand-in pads the LSE to 128 with junk
    o, lse = litctx_kernels.attention(q, k, v, causal=causal)
    assert fake_gpu == ["efficient"]
    o_ref, lse_ref = _ref(q, k, v, causal=causal)
    assert lse.shape == (2, 4, 100) and lse.dtype == torch.float32
    assert_attention_close(o.double(), lse.double(), o_ref, lse_ref, ratio=1e-5)


def test_half_calls_run_flash_and_gqa_falls_back_to_repeated_kv(fake_gpu, caplog):
    q, k, v = _qkv(1, 6, 2, 96, 32, dtype=torch.float16, grad=True)
    with caplog.at_level(logging.INFO, logger="litctx.kernels"):
        o, lse = litctx_kernels.attention(q, k, v, causal=True)
        litctx_kernels.attention(q.detach(), k.detach(), v.detach(), causal=True)
    assert fake_gpu == ["flash", "flash", "flash"]  # the refused grouped call, the repeated one, then repeated only
    assert any("refused 3 query heads per kv head" in r.getMessage() for r in caplog.records)
    o_ref, lse_ref = _ref(q, k, v, causal=True)
    assert_attention_close(o.double(), lse.double(), o_ref, lse_ref, ratio=5e-3)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((o.double() * w).sum(), (q, k, v))
    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o2, _ = attention_reference(qr, kr, vr, causal=True)
    ref = torch.autograd.grad((o2 * w).sum(), (qr, kr, vr))
    for g, r, name in zip(grads, ref, "qkv"):
        assert g.shape == r.shape, name  # kv gradients folded back to the kv heads
        assert_close(g.double(), r, 5e-3, name=f"d{name}")
    routed = [r.getMessage() for r in caplog.records if "sdpa_flash" in r.getMessage() and "->" in r.getMessage()]
    assert len(routed) == 1 and "default for causal calls" in routed[0]  # logged once


def test_gradient_through_the_lse_is_exact(fake_gpu):
    q, k, v = _qkv(1, 2, 2, 64, 16, grad=True)
    o, lse = litctx_kernels.attention(q, k, v, causal=True)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    loss = (o.double() * w).sum() + (lse.double() * torch.linspace(-1, 1, 64, dtype=torch.float64)).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o2, lse2 = attention_reference(qr, kr, vr, causal=True)
    ref = torch.autograd.grad((o2 * w).sum() + (lse2 * torch.linspace(-1, 1, 64, dtype=torch.float64)).sum(),
                              (qr, kr, vr))
    for g, r, name in zip(grads, ref, "qkv"):
        assert_close(g.double(), r, 1e-5, name=f"d{name}")


def test_key_mask_goes_to_the_efficient_op_unless_a_row_has_no_key(fake_gpu, caplog):
    q, k, v = _qkv(2, 4, 2, 80, 32)
    keep = torch.ones(2, 1, 80, dtype=torch.bool)
    keep[0, 0, 5:40] = False  # evicted entries: every row still has key 0
    keep[1, 0, 70:] = False
    o, lse = litctx_kernels.attention(q, k, v, causal=True, key_mask=keep)
    assert fake_gpu == ["efficient", "efficient"]  # the stand-in refuses grouped heads, then runs repeated K/V
    o_ref, lse_ref = _ref(q, k, v, causal=True, key_mask=keep.expand(2, 4, 80))
    assert_attention_close(o.double(), lse.double(), o_ref, lse_ref, ratio=1e-5)
    # left padding under a causal mask leaves the first rows without keys: not routed (SDPA would give NaN)
    padded = torch.ones(2, 1, 80, dtype=torch.bool)
    padded[0, 0, :10] = False
    fake_gpu.clear()
    with caplog.at_level(logging.INFO, logger="litctx.kernels"):
        o, lse = litctx_kernels.attention(q, k, v, causal=True, key_mask=padded)
    assert fake_gpu == []
    assert any("leaves rows without keys" in r.getMessage() for r in caplog.records)
    o_ref, lse_ref = _ref(q, k, v, causal=True, key_mask=padded.expand(2, 4, 80))
    assert_attention_close(o.double(), lse.double(), o_ref, lse_ref, ratio=1e-5)


def test_calls_that_are_not_routed(fake_gpu):
    q, k, v = _qkv(1, 2, 2, 64, 16)
    litctx_kernels.attention(q, k, v, causal=True, window=16)  # windows
    litctx_kernels.attention(q[:, :, :8], k, v, causal=True)  # a chunk at the end: bottom-right alignment
    litctx_kernels.attention(q, k, v, causal=True, score_mode="lssa")
    assert fake_gpu == []
    # one decode row sees every key: a dense (non-causal) call
    o, lse = litctx_kernels.attention(q[:, :, -1:], k, v, causal=True)
    assert fake_gpu == ["efficient"]
    o_ref, lse_ref = _ref(q[:, :, -1:], k, v, causal=True)
    assert_attention_close(o.double(), lse.double(), o_ref, lse_ref, ratio=1e-5)


def test_block_sparse_calls_follow_the_table_to_flex(fake_gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(dispatch, "_triton_verify", lambda op, q, **kw: (True, "mocked"))
    _use_table(monkeypatch, tmp_path, RoutingRow(device=GPU, kind="block_sparse", dtype="float32", backend="flex"))
    q, k, v = _qkv(1, 4, 2, 384, 32)
    blocks = torch.zeros(1, 4, 3, 3, dtype=torch.bool)
    blocks[..., 1, 0] = blocks[..., 2, 2] = True  # query block 0 lists nothing (o = 0, lse = -inf)
    blocks[0, 1, 2, 1] = True  # one head differs
    layout = BlockLayout.from_block_mask(blocks, 128, 128, (384, 384))
    o, lse = litctx_kernels.attention(q, k, v, causal=True, layout=layout)
    assert fake_gpu == ["flex"]
    o_ref, lse_ref = _ref(q, k, v, causal=True, layout=layout)
    assert_attention_close(o.double(), lse.double(), o_ref, lse_ref, ratio=1e-5)


def test_a_backend_that_fails_is_skipped_from_then_on(fake_gpu, monkeypatch, caplog):
    def broken(*args, **kwargs):
        fake_gpu.append("broken")
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    monkeypatch.setattr(tk.OPS, "efficient", broken)
    q, k, v = _qkv(1, 2, 2, 64, 16)
    with caplog.at_level(logging.WARNING, logger="litctx.kernels"):
        o, lse = litctx_kernels.attention(q, k, v, causal=True)
        litctx_kernels.attention(q, k, v, causal=True)
    assert fake_gpu == ["broken"]  # tried once; then (no other candidate here) the reference path
    assert any("sdpa_efficient failed" in r.getMessage() for r in caplog.records)
    o_ref, lse_ref = _ref(q, k, v, causal=True)
    assert_attention_close(o.double(), lse.double(), o_ref, lse_ref, ratio=1e-5)


def test_backend_override_skips_routing(fake_gpu, monkeypatch):
    q, k, v = _qkv(1, 2, 2, 64, 16)
    litctx_kernels.attention(q, k, v, causal=True, backend="reference")
    assert fake_gpu == []
    litctx_kernels.attention(q, k, v, causal=True, backend="torch")  # PyTorch's own kernels: still routed
    assert fake_gpu == ["efficient"]


def test_decode_calls_have_their_own_rows(fake_gpu, monkeypatch, tmp_path):
    _use_table(monkeypatch, tmp_path, RoutingRow(device=GPU, kind="decode", dtype="float32", backend="triton"))
    monkeypatch.setattr(dispatch, "_triton_verify", lambda op, q, **kw: (True, "mocked"))
    q, k, v = _qkv(1, 2, 2, 64, 16)
    assert dispatch._cuda_route(q[:, :, -1:], k, v, choice="auto", causal=True, q_offset=None, window=None,
                                layout=None, key_mask=None)[0] == "triton"
    assert dispatch._cuda_route(q, k, v, choice="auto", causal=False, q_offset=None, window=None, layout=None,
                                key_mask=None)[0] == "sdpa_efficient"  # 64 rows: a dense prefill, default


@pytest.mark.interpret
def test_routed_triton_runs_the_reduced_layout(interpreted_k1):
    """A layout the table sends to Triton K1 (the default for layouts) runs it directly, and a layout covering the
    causal mask becomes a plain causal call (SDPA by default). Needs TRITON_INTERPRET=1 (the interpreter run)."""
    fake_gpu = interpreted_k1
    q, k, v = _qkv(1, 4, 2, 256, 32)
    layout = BlockLayout.random_causal(256, 64, 0.5, heads=4, seed=5)
    o, lse = litctx_kernels.attention(q, k, v, causal=True, layout=layout)
    assert fake_gpu == []  # K1, not an SDPA stand-in
    o_ref, lse_ref = _ref(q, k, v, causal=True, layout=layout)
    assert_attention_close(o.double(), lse.double(), o_ref, lse_ref, ratio=1e-5)
    full = BlockLayout.causal(256, 256, 64, 64)
    litctx_kernels.attention(q, k, v, causal=True, layout=full)
    assert fake_gpu == ["efficient", "efficient"]  # covers the mask: causal, fp32 -> the efficient op (GQA retry)


@pytest.mark.interpret
def test_routed_triton_tile_runs_a_fine_layout_at_the_tuned_tile(interpreted_k1, monkeypatch, tmp_path):
    """A table row sending a fine layout (16 x 16 blocks; the interpreter's tuned forward tile is 32 x 16) to
    ``triton_tile`` runs K1 with that tile and gives the fine layout's attention; with a gradient the same call
    runs K1 at the layout's blocks (the candidate is forward only)."""
    fake_gpu = interpreted_k1
    import litctx_kernels.triton.attention as ta

    _use_table(monkeypatch, tmp_path, RoutingRow(device=GPU, kind="block_sparse", dtype="float32",
                                                 backend="triton_tile", block=[16, 16]))
    tiles = []
    real = ta.triton_attention

    def spy(*args, **kw):
        tiles.append(kw.get("tile"))
        return real(*args, **kw)

    monkeypatch.setattr(ta, "triton_attention", spy)
    q, k, v = _qkv(1, 2, 1, 96, 32)
    layout = BlockLayout.random_causal(96, 16, 0.4, heads=2, seed=3)
    o, lse = litctx_kernels.attention(q, k, v, causal=True, layout=layout)
    assert tiles == [(32, 16)] and fake_gpu == []
    o_ref, lse_ref = _ref(q, k, v, causal=True, layout=layout)
    assert_attention_close(o.double(), lse.double(), o_ref, lse_ref, ratio=1e-5)
    q.requires_grad_(True)
    litctx_kernels.attention(q, k, v, causal=True, layout=layout)
    assert tiles == [(32, 16), None]
