"""GPU timing of the Triton attention kernels (CUDA only).

1. Dense causal K1 (``triton_attention``) vs torch SDPA (flash backend), forward and forward+backward,
   N in {4K, 8K, 16K}.
2. Block-sparse K1 forward (and forward + backward) at layout densities {5, 10, 25, 50, 100}% of the causal blocks, N in {16K, 32K, 64K};
   random causal layouts (128 x 128 blocks, per head, pair density as in ``BlockLayout.random_causal``) that always keep
   the diagonal block and the first (sink) block.

B = 1, H = 8, d = 64, bf16 by default. Timing with ``triton.testing.do_bench`` (CUDA events, median of the
repetitions); compilation happens in the first (warm-up) call. Results go to the JSON file given by ``--out``.
A wall-clock budget (``--budget-s``, default 210 s) skips whatever would run past it (recorded as skipped), so
the whole script fits in about 4 minutes on an H200 including compilation.

Usage: ``python -m bench.triton_attention_gpu --out results/triton_attention_gpu.json [--dtype fp16]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from bench._report import save_json
from litctx_kernels.flops import attention_flops, mask_pairs
from litctx_kernels.layouts import BlockLayout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dense-n", default="4096,8192,16384")
    ap.add_argument("--sparse-n", default="16384,32768,65536")
    ap.add_argument("--densities", default="0.05,0.1,0.25,0.5,1.0")
    ap.add_argument("--budget-s", type=float, default=210.0, help="skip cases that would start after this")
    ap.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time per case")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench/triton_attention_gpu.py needs a CUDA device (none found); nothing was timed.", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this script times compiled kernels.", file=sys.stderr)
        return 2

    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from litctx_kernels.triton.attention import triton_attention

    t_start = time.time()
    dev = torch.device("cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    b, h, d = 1, args.heads, args.head_dim
    result = {
        "script": "bench/triton_attention_gpu.py",
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "dtype": args.dtype, "B": b, "H": h, "d": d, "timing": "triton.testing.do_bench median (ms)",
        "dense": [], "sparse": [], "skipped": [], "complete": False,
    }

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every case, so a run killed from outside still leaves its measurements
        result["wall_s"] = time.time() - t_start
        save_json(out, result)

    def over_budget(label: str) -> bool:
        if time.time() - t_start > args.budget_s:
            result["skipped"].append(label)
            return True
        return False

    def bench(fn, grad_to_none=None) -> float:
        return float(do_bench(fn, warmup=25, rep=args.rep_ms, grad_to_none=grad_to_none, return_mode="median"))

    # ---------------- dense causal: triton K1/K2 vs SDPA flash ----------------
    for n in [int(x) for x in args.dense_n.split(",") if x]:
        if over_budget(f"dense N={n}"):
            continue
        gen = torch.Generator(device=dev).manual_seed(n)
        q, k, v = (torch.randn(b, h, n, d, generator=gen, device=dev, dtype=dtype) for _ in range(3))
        do = torch.randn_like(q)
        row = {"N": n}
        pairs = b * h * mask_pairs(n, n, causal=True)  # exact causal pairs, N (N + 1) / 2 per head

        def sdpa_fwd():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        with torch.no_grad():
            o_t, _ = triton_attention(q, k, v, causal=True)
            try:
                row["max_abs_diff_vs_sdpa"] = float((o_t.float() - sdpa_fwd().float()).abs().max())
                sdpa_ok = True
            except RuntimeError as exc:  # flash backend unavailable for this dtype/device
                row["sdpa_error"] = str(exc)[:300]
                sdpa_ok = False
            row["triton_fwd_ms"] = bench(lambda: triton_attention(q, k, v, causal=True))
            if sdpa_ok:
                row["sdpa_flash_fwd_ms"] = bench(sdpa_fwd)
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

        def tri_fb():
            o, _ = triton_attention(qg, kg, vg, causal=True)
            o.backward(do)

        def sdpa_fb():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
            o.backward(do)

        if not over_budget(f"dense fwd+bwd N={n}"):
            row["triton_fwd_bwd_ms"] = bench(tri_fb, grad_to_none=[qg, kg, vg])
            if sdpa_ok:
                row["sdpa_flash_fwd_bwd_ms"] = bench(sdpa_fb, grad_to_none=[qg, kg, vg])
        for key in ("triton_fwd", "sdpa_flash_fwd", "triton_fwd_bwd", "sdpa_flash_fwd_bwd"):
            if f"{key}_ms" in row:
                f = attention_flops(pairs, d, backward="bwd" in key)
                row[f"{key}_tflops"] = f / (row[f"{key}_ms"] * 1e-3) / 1e12
        if "sdpa_flash_fwd_ms" in row:
            row["fwd_ratio_triton_over_sdpa"] = row["triton_fwd_ms"] / row["sdpa_flash_fwd_ms"]
        if "sdpa_flash_fwd_bwd_ms" in row:
            row["fwd_bwd_ratio_triton_over_sdpa"] = row["triton_fwd_bwd_ms"] / row["sdpa_flash_fwd_bwd_ms"]
        result["dense"].append(row)
        print(json.dumps(row), flush=True)
        save()
        torch.cuda.empty_cache()

    # ---------------- block-sparse K1 forward ----------------
    densities = [float(x) for x in args.densities.split(",") if x]
    for n in [int(x) for x in args.sparse_n.split(",") if x]:
        if over_budget(f"sparse N={n}"):
            continue
        gen = torch.Generator(device=dev).manual_seed(n + 1)
        q, k, v = (torch.randn(b, h, n, d, generator=gen, device=dev, dtype=dtype) for _ in range(3))
        with torch.no_grad():
            dense_ms = bench(lambda: triton_attention(q, k, v, causal=True))
            sdpa_ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        do = torch.randn_like(q)

        def fwd_bwd(layout=None, sdpa=False):
            if sdpa:
                o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
            else:
                o, _ = triton_attention(qg, kg, vg, causal=True, layout=layout)
            o.backward(do)

        dense_fb_ms = bench(fwd_bwd, grad_to_none=[qg, kg, vg])
        sdpa_fb_ms = bench(lambda: fwd_bwd(sdpa=True), grad_to_none=[qg, kg, vg])
        for dens in densities:
            if over_budget(f"sparse N={n} density={dens}"):
                continue
            lay = BlockLayout.random_causal(n, 128, dens, heads=h, seed=int(dens * 1000) + n, device=dev)
            blocks = lay.to_block_mask()
            m = blocks.shape[-1]
            causal_blocks = m * (m + 1) // 2
            block_density = float(blocks.sum()) / (h * causal_blocks)
            pair_density = lay.density()
            with torch.no_grad():
                ms = bench(lambda: triton_attention(q, k, v, causal=True, layout=lay))
            fb_ms = bench(lambda: fwd_bwd(layout=lay), grad_to_none=[qg, kg, vg])
            row = {"N": n, "target_density": dens, "pair_density": pair_density, "block_density": block_density,
                   "block": 128, "sparse_fwd_ms": ms, "dense_causal_fwd_ms": dense_ms, "sdpa_causal_fwd_ms": sdpa_ms,
                   "speedup_vs_dense": dense_ms / ms, "speedup_vs_sdpa": sdpa_ms / ms,
                   "sparse_fwd_bwd_ms": fb_ms, "dense_fwd_bwd_ms": dense_fb_ms, "sdpa_fwd_bwd_ms": sdpa_fb_ms,
                   "fwd_bwd_speedup_vs_sdpa": sdpa_fb_ms / fb_ms,
                   "ideal_speedup": 1.0 / pair_density}
            result["sparse"].append(row)
            print(json.dumps(row), flush=True)
            save()
        torch.cuda.empty_cache()

    result["complete"] = True
    save()
    print(f"wrote {out} ({result['wall_s']:.0f} s; skipped: {result['skipped'] or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
