"""CPU block-sparse attention against dense SDPA (and compiled FlexAttention) in one process.

For N in {4K, 16K, 32K}, 8 heads, d = 64, causal, fp32, B = 1: random per-head causal block layouts
(128 x 128 blocks, diagonal and sink always kept) at pair densities {5, 10, 25, 50, 100}%. Timed, best of
``--repeats``: dense causal SDPA (PyTorch's fused CPU flash kernel), ``litctx_kernels.attention`` with the layout
(the dispatcher: at 100% it recognises the full causal layout and runs the dense kernel), the block-sparse
path forced at every density (the native fp32 forward for these inference calls), the previous flash-call
path (``native=False``) and compiled FlexAttention with the same block mask (inference only on CPU; its first
call per shape, the compile, is reported separately and excluded). ``--lengths 16384 --densities 0.1``
limits a run to the acceptance rows (forward and forward + backward at 16K, 10%).
Forward and backward at N = 16K: the native forward and backward against the previous route (flash-call forward,
CPU flash backward per bucket), both against SDPA's forward and backward. Reports time, speed-up over SDPA and the
fraction of the FLOP bound (speed-up x density) reached, forward and forward + backward; writes
``docs/results.md``, ``results/attention_cpu.json`` and
``docs/figures/attention_cpu.png`` (``--plot-only`` redraws it from the JSON).

    python -m bench.attention_cpu            # ~5 minutes on 2 cores
    python -m bench.attention_cpu --quick    # N = 4K only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench._report import REPO, save_figure, save_json, write_section

import litctx_kernels
from litctx_kernels import BlockLayout
from litctx_kernels.cpu_sparse import NATIVE_BACKWARD_ENV, block_sparse_attention_cpu, native_kernel, native_status
from litctx_common.timing import time_call

DENSITIES = (0.05, 0.10, 0.25, 0.50, 1.00)


@contextlib.contextmanager
def _env(name: str, value: str):
    """Set an environment variable for the block (the kernels' switches are read per call)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def best_of(fn, repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``fn()`` (CPU wall time)."""
    return time_call(fn, repeats, device="cpu", reduce="min")


def flex_runner(n: int):
    """Compiled FlexAttention on CPU (``dynamic=False``: one compile per shape, reused across layouts), or None
    with the reason. CPU FlexAttention is inference only and cannot return the LSE (``return_lse`` raises on
    CPU in torch 2.14), so it cannot back ``litctx_kernels.attention``, which returns ``(o, lse)``."""
    try:
        from torch.nn.attention.flex_attention import flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)
    except Exception as exc:  # noqa: BLE001 - report, don't fail the benchmark
        return None, f"unavailable: {type(exc).__name__}: {exc}"

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def run(q, k, v, layout: BlockLayout):
        with torch.no_grad():
            return compiled(q, k, v, block_mask=layout.to_flex(mask_mod=causal))

    return run, "compiled (torch.compile, CPU C++ template, inference only)"


def plot(rows, figure: Path) -> None:
    """Speed-up over dense SDPA against density, per length: the sparse path, the dispatcher, FlexAttention
    and the FLOP bound (1 / density)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    lengths = sorted({r["n"] for r in rows})
    for n, color in zip(lengths, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        rs = sorted((r for r in rows if r["n"] == n), key=lambda r: r["actual_density"])
        xs = [r["actual_density"] for r in rs]
        ax.plot(xs, [r["sparse_speedup"] for r in rs], "o-", color=color, label=f"sparse path, N={n // 1024}K")
        ax.plot(xs, [r["speedup"] for r in rs], "x", color=color, markersize=8)
        flex = [(r["actual_density"], r["flex_speedup"]) for r in rs if "flex_speedup" in r]
        if flex:
            ax.plot(*zip(*flex), "s--", color=color, alpha=0.5, markersize=4, label=f"FlexAttention (compiled), N={n // 1024}K")
    grid = [0.04 + i * 0.01 for i in range(97)]
    ax.plot(grid, [1 / x for x in grid], "k:", label="FLOP bound 1/density")
    ax.axhline(1.0, color="0.5", linewidth=1, label="dense SDPA")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("density (fraction of causal pairs computed)")
    ax.set_ylabel("speed-up over dense causal SDPA (forward)")
    ax.set_title("CPU block-sparse attention, 8 heads, d = 64 (x: dispatcher)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, figure)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--densities", type=float, nargs="+", default=list(DENSITIES))
    p.add_argument("--backward-length", type=int, default=16384, help="N for the forward+backward timing")
    p.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    p.add_argument("--quick", action="store_true", help="N = 4K only, one repeat")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", type=Path, default=REPO / "results" / "attention_cpu.json")
    p.add_argument("--results", type=Path, default=REPO / "docs" / "results.md")
    p.add_argument("--figure", type=Path, default=REPO / "docs" / "figures" / "attention_cpu.png")
    p.add_argument("--plot-only", action="store_true", help="redraw the figure from --cache without timing")
    args = p.parse_args()
    if args.plot_only:
        plot(json.loads(args.cache.read_text())["forward"], args.figure)
        print(f"wrote {args.figure}")
        return
    if args.quick:
        args.lengths, args.repeats, args.backward_length = [4096], 1, 4096
    torch.manual_seed(args.seed)
    flex, flex_note = (None, "skipped (--no-flex)") if args.no_flex else flex_runner(args.lengths[0])
    native_kernel()  # build / load once, outside the timings
    nat = native_status()
    state = "ready" if nat.get("module") is not None else "unavailable: " + nat.get("reason", "?")
    native_note = f"native kernels {state} (build or load {nat.get('seconds', 0.0):.1f} s, excluded)"
    print(native_note, flush=True)
    densities = tuple(args.densities)
    rows, bwd_rows = [], []
    for n in args.lengths:
        q, k, v = [torch.randn(1, args.heads, n, args.dim) for _ in range(3)]
        reps = args.repeats if n <= 16384 else max(1, args.repeats - 1)
        t_sdpa = best_of(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps)
        print(f"N={n}: SDPA causal {t_sdpa:.3f}s", flush=True)
        for density in densities:
            layout = BlockLayout.random_causal(n, args.block, density, heads=args.heads, seed=args.seed)
            actual = layout.density()
            ref_o = None
            t_disp = best_of(lambda: litctx_kernels.attention(q, k, v, layout=layout), reps)
            t_sparse = best_of(lambda: block_sparse_attention_cpu(q, k, v, layout), reps)
            t_calls = best_of(lambda: block_sparse_attention_cpu(q, k, v, layout, native=False), reps)
            o_sparse, _ = block_sparse_attention_cpu(q, k, v, layout)
            o_calls, _ = block_sparse_attention_cpu(q, k, v, layout, native=False)
            row = dict(n=n, density=density, actual_density=actual, sdpa_s=t_sdpa, dispatch_s=t_disp,
                       sparse_s=t_sparse, flash_calls_s=t_calls, speedup=t_sdpa / t_disp,
                       sparse_speedup=t_sdpa / t_sparse, bound_fraction=(t_sdpa / t_disp) * actual,
                       sparse_bound_fraction=(t_sdpa / t_sparse) * actual,
                       native_vs_calls_max_abs_diff=float((o_sparse - o_calls).abs().max()))
            if flex is not None:
                try:
                    t0 = time.perf_counter()
                    ref_o = flex(q, k, v, layout)  # compile (first call of this shape) + check
                    row["flex_first_call_s"] = time.perf_counter() - t0
                    row["flex_s"] = best_of(lambda: flex(q, k, v, layout), reps)
                    row["dispatch_vs_flex"] = row["flex_s"] / t_disp
                    row["flex_speedup"] = t_sdpa / row["flex_s"]
                    row["flex_vs_sparse"] = row["flex_s"] / t_disp
                    row["flex_max_abs_diff"] = float((ref_o - o_sparse).abs().max())
                except Exception as exc:  # noqa: BLE001
                    flex, flex_note = None, f"failed at N={n}: {type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            print(f"  density {density:4.0%} (actual {actual:.3f}): dispatch {t_disp:.3f}s ({row['speedup']:.2f}x), "
                  f"sparse path {t_sparse:.3f}s ({row['sparse_speedup']:.2f}x, {row['sparse_bound_fraction']:.0%} "
                  f"of bound), flash-call path {t_calls:.3f}s" + (f", flex {row['flex_s']:.3f}s (first call "
                  f"{row['flex_first_call_s']:.1f}s)" if "flex_s" in row else ""), flush=True)
        if n == args.backward_length:
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

            def fb_sdpa():
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
                o.backward(torch.ones_like(o))

            t_fb = best_of(fb_sdpa, max(1, reps - 1))
            for density in [x for x in densities if x < 1.0]:
                layout = BlockLayout.random_causal(n, args.block, density, heads=args.heads, seed=args.seed)

                def fb_sparse():
                    o, _ = litctx_kernels.attention(qg, kg, vg, layout=layout)
                    o.backward(torch.ones_like(o))

                t = best_of(fb_sparse, max(1, reps - 1))  # the native forward and backward (fp32)
                with _env(NATIVE_BACKWARD_ENV, "0"):  # the previous route: flash-call forward and backward
                    t_calls = best_of(fb_sparse, max(1, reps - 1))
                actual = layout.density()
                bwd_rows.append(dict(n=n, density=density, actual_density=actual, sdpa_fwd_bwd_s=t_fb,
                                     sparse_fwd_bwd_s=t, speedup=t_fb / t, bound_fraction=t_fb / t * actual,
                                     flash_calls_fwd_bwd_s=t_calls, flash_calls_speedup=t_fb / t_calls,
                                     flash_calls_bound_fraction=t_fb / t_calls * actual))
                print(f"  fwd+bwd density {density:4.0%}: native {t:.3f}s ({t_fb / t:.2f}x, {t_fb / t * actual:.0%} "
                      f"of bound), flash calls {t_calls:.3f}s ({t_fb / t_calls:.2f}x) vs SDPA {t_fb:.3f}s", flush=True)
    meta = dict(torch=torch.__version__, threads=torch.get_num_threads(), cpu=platform.processor() or platform.machine(),
                heads=args.heads, dim=args.dim, block=args.block, repeats=args.repeats, seed=args.seed,
                flex=flex_note, native=native_note, densities=list(densities))
    save_json(args.cache, dict(meta=meta, forward=rows, backward=bwd_rows))
    body = [f"Command: `python -m bench.attention_cpu` (fp32, B = 1, {args.heads} heads, d = {args.dim}, "
            f"{args.block} x {args.block} blocks, causal, random per-head layouts with diagonal + sink, seed "
            f"{args.seed}, best of {args.repeats} (N = 32K: {max(1, args.repeats - 1)}); torch {torch.__version__}, "
            f"{meta['threads']} threads; densities {', '.join(f'{x:.0%}' for x in densities)}). "
            f"FlexAttention: {flex_note}; its first call per shape (compile, excluded) is the last column. "
            f"`litctx_kernels.attention` and the sparse path run the {native_note}; *flash calls* is the "
            "previous block-sparse forward (`native=False`: gathered K/V, one CPU flash call per bucket). "
            "*of FLOP bound* = speed-up x density (forward: the sparse path's).",
            "",
            "| N | density (actual) | SDPA s | dispatch s | speed-up | sparse path s | speed-up | of FLOP bound | "
            "flash calls s | flex s | flex / dispatch | flex compile s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        flex_s = f"{r['flex_s']:.3f}" if "flex_s" in r else "-"
        ratio = f"{r['dispatch_vs_flex']:.2f}x" if "dispatch_vs_flex" in r else "-"
        comp = f"{r['flex_first_call_s']:.1f}" if "flex_first_call_s" in r else "-"
        body.append(f"| {r['n']} | {r['density']:.0%} ({r['actual_density']:.3f}) | {r['sdpa_s']:.3f} | "
                    f"{r['dispatch_s']:.3f} | {r['speedup']:.2f}x | {r['sparse_s']:.3f} | {r['sparse_speedup']:.2f}x | "
                    f"{r['sparse_bound_fraction']:.0%} | {r['flash_calls_s']:.3f} | {flex_s} | {ratio} | {comp} |")
    if bwd_rows:
        body += ["", "Forward + backward (`litctx_kernels.attention(...)` then `.backward()`, against SDPA's forward + "
                 "backward): *native* is the native forward and backward; *flash calls* the previous route "
                 f"(`{NATIVE_BACKWARD_ENV}=0`: the flash-call forward and the CPU flash backward per bucket).", "",
                 "| N | density | SDPA fwd+bwd s | native fwd+bwd s | speed-up | of FLOP bound | flash calls fwd+bwd s "
                 "| speed-up | of FLOP bound |", "|---|---|---|---|---|---|---|---|---|"]
        for r in bwd_rows:
            body.append(f"| {r['n']} | {r['density']:.0%} | {r['sdpa_fwd_bwd_s']:.3f} | {r['sparse_fwd_bwd_s']:.3f} | "
                        f"{r['speedup']:.2f}x | {r['bound_fraction']:.0%} | {r['flash_calls_fwd_bwd_s']:.3f} | "
                        f"{r['flash_calls_speedup']:.2f}x | {r['flash_calls_bound_fraction']:.0%} |")
    plot(rows, args.figure)
    body += ["", f"![CPU block-sparse attention speed-up]({os.path.relpath(args.figure, args.results.parent)})"]
    write_section("attention_cpu", "\n".join(body), "Attention kernels: CPU block-sparse path vs dense SDPA",
                  path=args.results)
    print(f"wrote {args.results} and {args.cache}")


if __name__ == "__main__":
    main()
