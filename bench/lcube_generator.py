"""L-CUBE generator claims at CPU scale: controllable MI exponent, and exact conditionals that scale.

1. Bipartite MI law: for each target beta, the brute-force ``I_BP(L/2; L)`` (log-determinants of the dense
   covariance) over L = 32..512 and the fitted slope of log I_BP against log L.
2. Exact conditionals for long sequences: the tree Kalman filter against the dense baseline (Cholesky of the
   ``[L D, L D]`` covariance and one triangular solve per batch), time and largest error, in one run.

    python -m bench.lcube_generator
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench._report import REPO, write_section

from datamodules.synth.hierarchical_gaussian import HierarchicalGaussian


def brute_force_mi(sigma: torch.Tensor, n: int) -> float:
    ld = lambda m: torch.linalg.slogdet(m)[1].item()  # noqa: E731
    return 0.5 * (ld(sigma[:n, :n]) + ld(sigma[n:, n:]) - ld(sigma))


def slopes(betas, lengths):
    rows = []
    for beta in betas:
        # every level from L = 32 owns a dimension, and the haar basis still fits dim 8 at L = 512
        width = {0.0: 1.0, 0.25: 0.5, 0.5: 0.1, 0.75: 0.05}[beta]
        values = []
        for L in lengths:
            g = HierarchicalGaussian(length=L, dim=8, beta=beta, width=width, info_scale=0.05)
            values.append(brute_force_mi(g.covariance(), L // 2 * 8))
        slope = float(np.polyfit(np.log(lengths), np.log(values), 1)[0])
        rows.append((beta, width, values, slope))
    return rows


def dense_conditionals(g: HierarchicalGaussian, x: torch.Tensor):
    """Baseline: p(x_t | x_{<t}) for all t from the Cholesky factor of the dense covariance."""
    D = g.dim
    chol = torch.linalg.cholesky(g.covariance())
    flat = x.reshape(x.shape[0], -1).T  # [L D, n]
    xi = torch.linalg.solve_triangular(chol, flat, upper=False)
    blocks = torch.stack([chol[t * D:(t + 1) * D, t * D:(t + 1) * D] for t in range(g.length)])  # [L, D, D]
    own = torch.einsum("tij,tjn->tin", blocks, xi.T.reshape(x.shape[0], g.length, D).permute(1, 2, 0))
    mean = x - own.permute(2, 0, 1)
    return mean, blocks @ blocks.transpose(-1, -2)


def timing(lengths, dim, width, n, dense_limit):
    rows = []
    for L in lengths:
        g = HierarchicalGaussian(length=L, dim=dim, width=width, info_scale=0.1)
        x = g.sample(n, torch.Generator().manual_seed(0), dtype=torch.float64)
        t0 = time.perf_counter()
        exact = g.conditionals(x)
        t_filter = time.perf_counter() - t0
        t_dense = err = None
        if L * dim <= dense_limit:
            t0 = time.perf_counter()
            mean, cov = dense_conditionals(g, x)
            t_dense = time.perf_counter() - t0
            err = max((mean - exact.mean).abs().max().item(), (cov - exact.cov).abs().max().item())
        rows.append((L, g.state_dim, t_filter, t_dense, err))
        print(f"[bench] L={L}: filter {t_filter:.2f}s, dense {t_dense if t_dense is None else round(t_dense, 2)}s", flush=True)
    return rows


# another process running the filter's bare loop on torch's default thread pool (e.g. a second rank or sweep trial)
# (run with the repository as its working directory, so `python -c` finds the packages)
BUSY = ("from datamodules.synth.hierarchical_gaussian import HierarchicalGaussian\n"
        "g = HierarchicalGaussian(length=2048, dim=32)\nwhile True:\n    g.conditionals(stop=200, threads=None)")


def thread_pool_cost(steps=64):
    """Seconds per filter step (L = 2048, dim 32, state 73) on torch's default thread pool vs one thread."""
    g = HierarchicalGaussian(length=2048, dim=32)
    g.conditionals(stop=8)  # warm up
    t0 = time.perf_counter()
    g.conditionals(start=100, stop=100 + steps, threads=None)  # the bare loop, default threads
    pooled = (time.perf_counter() - t0) / steps
    t0 = time.perf_counter()
    g.conditionals(start=100, stop=100 + steps)  # single-threaded, as the library runs it
    single = (time.perf_counter() - t0) / steps
    return torch.get_num_threads(), pooled, single


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=REPO / "docs" / "results.md")
    p.add_argument("--timing-lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--width", type=float, default=0.018, help="small enough for the haar basis at the longest L")
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--dense-limit", type=int, default=16384, help="largest L*D for the dense baseline")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    lengths = [32, 64, 128, 256, 512]
    law = slopes([0.0, 0.25, 0.5, 0.75], lengths)
    speed = timing(args.timing_lengths, args.dim, args.width, args.sequences, args.dense_limit)
    lines = ["Command: `python -m bench.lcube_generator` (CPU, 2 cores, float64). Deterministic: "
             "no seeds involved in the MI law; timings are single runs.", "",
             "Bipartite MI law, brute force from the dense covariance (dim 8, info_scale 0.05):", "",
             "| target beta | width | I_BP(L/2; L) at L = " + ", ".join(map(str, lengths)) + " | fitted slope |",
             "|---|---|---|---|"]
    for beta, width, values, slope in law:
        lines.append(f"| {beta} | {width} | " + ", ".join(f"{v:.3f}" for v in values) + f" | {slope:.4f} |")
    lines += ["", f"Exact conditionals of {args.sequences} sequences (dim {args.dim}, width {args.width}, beta 0.75): tree Kalman "
              "filter vs dense Cholesky baseline:", "",
              "| L | filter state dim | filter (s) | dense Cholesky (s) | max abs difference |", "|---|---|---|---|---|"]
    for L, state, tf, td, err in speed:
        lines.append(f"| {L} | {state} | {tf:.2f} | " + (f"{td:.2f} | {err:.1e}" if td is not None else
                                                            f"not run (L*D > {args.dense_limit}) | -") + " |")
    idle = [thread_pool_cost() for _ in range(5)]
    busy = subprocess.Popen([sys.executable, "-c", BUSY], cwd=REPO)  # a second process on the same cores
    try:
        time.sleep(3)
        loaded = [thread_pool_cost() for _ in range(5)]
    finally:
        busy.kill()

    def span(rows, i):
        return f"{min(r[i] for r in rows) * 1e3:.2f}-{max(r[i] for r in rows) * 1e3:.2f} ms"

    lines += ["", f"Per filter step, L = 2048, dim 32, 5 repeats each (`conditionals` runs on one thread): on an idle "
              f"machine {span(idle, 1)} on torch's {idle[0][0]}-thread pool vs {span(idle, 2)} single-threaded; while "
              f"a second process runs the same loop on its thread pool, {span(loaded, 1)} vs {span(loaded, 2)}."]
    print(write_section("lcube_generator", "\n".join(lines), "L-CUBE generator (`bench/lcube_generator.py`)",
                        args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
