"""Measure every routed backend of ``litctx_kernels.attention`` on this GPU and write the routing table.

For each kind (:mod:`litctx_kernels.routing`: ``causal`` and ``dense`` prefill, ``decode`` (one query row over
N keys), ``key_mask`` (30% of keys masked, causal), ``block_sparse`` (a random causal layout at
``--density`` for each of ``--blocks``: 128 x 128 as Prism, XAttention and mean pooling select, 64 x 32 as SALE
does, where K1 at its own tile (``triton_tile``) competes with K1 at the layout's blocks)), dtype, head shape
and length, every candidate that can serve the call is timed
(forward, and forward + backward for prefill kinds) with ``triton.testing.do_bench`` (median of repetitions; the
first call compiles and is excluded), and its output is checked against a candidate that already passed
(max abs difference, recorded; a candidate that fails or disagrees is recorded as None and never wins). The
fastest per (kind, dtype, head dim, forward/backward, layout blocks, length) becomes a row; a length covers the
lengths above the previous measured one (the last row extends to any length). Rows are written as the table JSON
(``--out``); ``--install`` also copies it to ``litctx_kernels/routing_table.json`` (the shipped table).

    python -m bench.gpu_routing --out results/gpu/routing_table.json --budget-s 150
    python -m bench.gpu_routing --out results/gpu/routing_table.json --install     # then commit the table

Without a CUDA device it exits with status 2 and times nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from bench._report import save_json

KINDS = ("causal", "decode", "key_mask", "block_sparse", "dense")  # most used first (a budget cut skips the rest)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def tuned_tile(d: int, dtype: torch.dtype) -> tuple:
    """K1's tuned forward tile ``(BLOCK_M, BLOCK_N)`` for this head dim and dtype."""
    from litctx_kernels.triton._compat import attention_config

    cfg = attention_config("fwd", d, dtype)
    return cfg.block_m, cfg.block_n


def candidates_for(kind: str, dtype: torch.dtype, d: int, grad: bool, block: tuple = (0, 0)) -> List[str]:
    from litctx_kernels.routing import CallShape, eligible_backends

    tile = tuned_tile(d, dtype)
    fine = (kind == "block_sparse" and min(block) > 0 and all(t % b == 0 for t, b in zip(tile, block))
            and tuple(block) != tile)
    call = CallShape(kind=kind, dtype=str(dtype).replace("torch.", ""), n_q=1, n_k=1, head_dim=d, head_dim_v=d,
                     triton=True, grad=grad, block=tuple(block), fine_layout=fine)
    return eligible_backends(call)


def runner(backend: str, kind: str, q, k, v, extra: Dict) -> Callable:
    """A zero-argument call of ``backend`` on this case, returning ``(o, lse)``."""
    from litctx_kernels.torch_kernels import flex_attention_layout, sdpa_attention
    from litctx_kernels.triton.attention import triton_attention

    causal = kind in ("causal", "key_mask", "block_sparse")
    km, layout = extra.get("key_mask"), extra.get("layout")
    if backend == "triton":
        return lambda: triton_attention(q, k, v, causal=causal, layout=layout, key_mask=km)
    if backend == "triton_tile":
        tile = tuned_tile(q.shape[-1], q.dtype)
        return lambda: triton_attention(q, k, v, causal=causal, layout=layout, tile=tile)
    if backend == "flex":
        return lambda: flex_attention_layout(q, k, v, layout, causal=True, q_offset=0)
    return lambda: sdpa_attention(q, k, v, backend, causal=causal, key_mask=km)


def sparse_layout(n: int, block: tuple, density: float, heads: int, seed: int, device):
    """A random causal layout with ``block = (block_q, block_k)``: square blocks from
    :meth:`BlockLayout.random_causal`; otherwise a random causal layout at the smaller side, coarsened to the
    block (its density is then somewhat above ``density``; the record keeps the realised one)."""
    from litctx_kernels import BlockLayout

    bq, bk = block
    side = min(bq, bk)
    lay = BlockLayout.random_causal(n, side, density, heads=heads, seed=seed, device=device)
    return lay if bq == bk else lay.coarsen(bq, bk)


def rows_from(measured: List[Dict], device: str) -> List[Dict]:
    """One table row per measured group and length: the fastest candidate that passed, covering the lengths above
    the group's previous measured length."""
    groups: Dict[tuple, List[Dict]] = {}
    for m in measured:
        block = m.get("block")
        groups.setdefault((m["kind"], m["dtype"], m["head_dim"], m["grad"], tuple(block) if block else None),
                          []).append(m)
    rows = []
    for (kind, dtype, d, grad, block), ms in groups.items():
        ms.sort(key=lambda m: m["n"])
        lo = 1
        for i, m in enumerate(ms):
            timed = {b: t for b, t in m["ms"].items() if t is not None}
            if not timed:
                continue
            best = min(timed, key=timed.get)
            hi = (1 << 62) if i == len(ms) - 1 else m["n"]
            rows.append({"device": device, "kind": kind, "dtype": dtype,
                         "backend": best, "n_min": lo, "n_max": hi, "head_dim": d, "grad": grad,
                         "block": list(block) if block else None, "ms": m["ms"], "shape": m["shape"]})
            lo = hi + 1
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the table JSON to write")
    ap.add_argument("--install", action="store_true", help="also copy the table to litctx_kernels/routing_table.json")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--heads", default="9/3x64,32/8x128", help="Hq/Hk x d cases (SmolLM2, Llama-3-8B)")
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--blocks", default="128x128,64x32",
                    help="block_sparse layouts' block_q x block_k (Prism / XAttention; SALE)")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--rep-ms", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_routing.py needs a CUDA device (none found); nothing was timed.", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    from litctx_kernels.routing import SHIPPED_TABLE, RoutingTable

    dev = torch.device("cuda")
    device = torch.cuda.get_device_name(dev)
    t0 = time.time()
    measured: List[Dict] = []
    skipped: List[str] = []
    out = Path(args.out)

    def save() -> None:
        rows = rows_from(measured, device)
        table = RoutingTable.from_json({"format": 1, "rows": rows,
                                        "source": f"bench/gpu_routing.py on {device}, torch {torch.__version__}"})
        save_json(out, {**table.to_json(), "measured": measured, "skipped": skipped, "wall_s": time.time() - t0})

    blocks = [tuple(int(x) for x in b.split("x")) for b in args.blocks.split(",")]
    cases = [(kind, dname, head, n, grad, block)
             for kind in args.kinds.split(",") for block in (blocks if kind == "block_sparse" else [None])
             for dname in args.dtypes.split(",") for head in args.heads.split(",")
             for n in (int(x) for x in args.lengths.split(","))
             for grad in ((False,) if kind == "decode" else (False, True))]
    for kind, dname, head, n, grad, block in cases:
        dtype = DTYPES[dname]
        hq, rest = head.split("/")
        hk, d = (int(x) for x in rest.split("x"))
        hq = int(hq)
        label = (f"{kind}{' %dx%d' % block if block else ''} {dname} {head} N={n} "
                 f"{'fwd+bwd' if grad else 'fwd'}")
        if time.time() - t0 > args.budget_s:
            skipped.append(label)
            continue
        gen = torch.Generator(device=dev).manual_seed(n)
        n_q = 1 if kind == "decode" else n
        q = torch.randn(1, hq, n_q, d, generator=gen, device=dev, dtype=dtype)
        k, v = (torch.randn(1, hk, n, d, generator=gen, device=dev, dtype=dtype) for _ in range(2))
        extra: Dict = {}
        if kind == "key_mask":
            extra["key_mask"] = torch.rand(1, hk, n, generator=gen, device=dev) > 0.3
            extra["key_mask"][..., 0] = True
        if kind == "block_sparse":
            extra["layout"] = sparse_layout(n, block, args.density, hq, n, dev)
        if grad:
            q, k, v = (t.requires_grad_(True) for t in (q, k, v))
            do = torch.randn(1, hq, n_q, d, device=dev, dtype=dtype)
        times: Dict[str, Optional[float]] = {}
        errors: Dict[str, str] = {}
        ref = None
        for backend in candidates_for(kind, dtype, d, grad, block or (0, 0)):
            fn = runner(backend, kind, q, k, v, extra)
            try:
                with torch.set_grad_enabled(grad):
                    o, _ = fn()
                diff = None if ref is None else float((o.float() - ref).abs().max())
                if ref is None:
                    ref = o.detach().float()
                elif diff > (1e-2 if dtype != torch.float32 else 1e-4) * 8:
                    raise RuntimeError(f"output differs from the first candidate by {diff:.3g}")
                if grad:
                    def step(fn=fn):
                        o, _ = fn()
                        o.backward(do)
                    times[backend] = float(do_bench(step, warmup=5, rep=args.rep_ms,
                                                    grad_to_none=[q, k, v], return_mode="median"))
                else:
                    with torch.no_grad():
                        times[backend] = float(do_bench(fn, warmup=5, rep=args.rep_ms,
                                                        return_mode="median"))
            except Exception as exc:  # noqa: BLE001 - a candidate that fails never wins
                times[backend] = None
                errors[backend] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rec = {"kind": kind, "dtype": str(dtype).replace("torch.", ""), "head_dim": d, "grad": grad,
               "n": n, "block": list(block) if block else None, "ms": times, "errors": errors,
               "shape": {"hq": hq, "hk": hk, "n_q": n_q, "n_k": n,
                         **({"density": round(extra["layout"].density(), 4)}
                            if kind == "block_sparse" else {})}}
        measured.append(rec)
        print(label, json.dumps(times), json.dumps(errors) if errors else "", flush=True)
        save()
        del q, k, v
        torch.cuda.empty_cache()
    save()
    if args.install:  # the table's own keys only (the measurements stay in --out)
        data = json.loads(out.read_text())
        save_json(SHIPPED_TABLE, {k: data[k] for k in ("format", "source", "rows")})
    print(f"wrote {out}: {len(rows_from(measured, device))} rows, {len(skipped)} cases skipped for time "
          f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
