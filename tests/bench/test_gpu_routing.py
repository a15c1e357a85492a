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
