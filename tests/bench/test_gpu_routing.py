"""``bench.gpu_routing`` turns measurements into table rows: the fastest passing candidate per length, each length
covering the lengths above the previous one, failed candidates never winning, and a table the router accepts."""

from __future__ import annotations

from bench.gpu_routing import candidates_for, rows_from
from litctx_kernels.routing import CallShape, RoutingTable, route

import torch


def _m(n, ms, kind="causal", grad=False):
    return {"kind": kind, "dtype": "bfloat16", "head_dim": 64, "grad": grad, "n": n, "ms": ms, "shape": {}}


def test_rows_cover_the_lengths_with_the_fastest_candidate():
    measured = [_m(2048, {"sdpa_flash": 1.0, "triton": 2.0}), _m(8192, {"sdpa_flash": 3.0, "triton": 2.5}),
                _m(32768, {"sdpa_flash": 9.0, "triton": None}), _m(2048, {"sdpa_flash": None, "triton": None}, "dense"),
                _m(2048, {"sdpa_flash": 5.0, "triton": 1.0}, grad=True)]
    rows = rows_from(measured, "G")
    table = RoutingTable.from_json({"format": 1, "rows": rows})
    fwd = [(r.backend, r.n_min, r.n_max) for r in table.rows if r.kind == "causal" and not r.grad]
    assert fwd == [("sdpa_flash", 1, 2048), ("triton", 2049, 8192), ("sdpa_flash", 8193, 1 << 62)]
    assert not [r for r in table.rows if r.kind == "dense"]  # nothing passed: no row, the default holds

    def call(n, grad=False):
        return CallShape(kind="causal", dtype="bfloat16", n_q=n, n_k=n, head_dim=64, head_dim_v=64, grad=grad)

    assert route("G", call(4096), table).backend == "triton"
    assert route("G", call(100_000), table).backend == "sdpa_flash"
    assert route("G", call(100_000, grad=True), table).backend == "triton"  # one grad row covers every length


def test_candidates_follow_the_router():
    assert candidates_for("block_sparse", torch.bfloat16, 64, False) == ["triton", "flex"]
    assert "sdpa_cudnn" not in candidates_for("causal", torch.bfloat16, 64, True)  # forward-only op
    assert candidates_for("key_mask", torch.float32, 64, False) == ["sdpa_efficient", "triton"]


def test_block_sparse_rows_are_kept_apart_by_layout_blocks():
    measured = [dict(_m(8192, {"triton": 2.0, "flex": 3.0, "triton_tile": 1.0}, "block_sparse"), block=[64, 32]),
                dict(_m(8192, {"triton": 2.0, "flex": 1.5}, "block_sparse"), block=[128, 128])]
    table = RoutingTable.from_json({"format": 1, "rows": rows_from(measured, "G")})
    assert sorted((r.block, r.backend) for r in table.rows) == [((64, 32), "triton_tile"), ((128, 128), "flex")]

    def call(block, fine):
        return CallShape(kind="block_sparse", dtype="bfloat16", n_q=8192, n_k=8192, head_dim=64, head_dim_v=64,
                         block=block, fine_layout=fine)

    assert route("G", call((64, 32), True), table).backend == "triton_tile"
    assert route("G", call((128, 128), False), table).backend == "flex"


def test_the_tile_candidate_is_offered_for_fine_layouts_forward_only(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the CUDA tiles: 128 x 64 forward for bf16, d 64
    assert candidates_for("block_sparse", torch.bfloat16, 64, False, (64, 32)) == ["triton", "flex", "triton_tile"]
    assert candidates_for("block_sparse", torch.bfloat16, 64, True, (64, 32)) == ["triton", "flex"]
    assert candidates_for("block_sparse", torch.bfloat16, 64, False, (128, 128)) == ["triton", "flex"]


def test_sparse_layouts_have_the_asked_blocks():
    from bench.gpu_routing import sparse_layout

    lay = sparse_layout(1024, (64, 32), 0.1, heads=2, seed=0, device="cpu")
    assert (lay.block_q, lay.block_k, lay.shape) == (64, 32, (1, 2))
    assert 0.1 <= lay.density() <= 0.4
    assert sparse_layout(1024, (128, 128), 0.1, heads=1, seed=0, device="cpu").block_q == 128
