"""Ablations behind the L-CUBE model's design choices, on the ``lcube`` recipe at L = 256.

* ``position_embedding=none``: RoPE only. L-CUBE sequences are not shift-invariant, so the model has to know
  where it is in the hierarchy.
* ``random_context_start=0``: never train on a context that starts mid-sequence. The utilization estimate
  runs the model on a suffix alone, which is then out of distribution.
* ``basis=random``: the generator's unstructured loadings instead of the Haar ones. Judged against that
  data's own window oracles.

Each variant trains the recipe's default budget (8 epochs of 100 batches of 32 sequences) for every seed.
The table is written to docs/results.md.

    python -m bench.lcube_ablations --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

from bench._report import REPO, save_json, write_section

VARIANTS = {
    "default (learned positions, random starts 0.25, haar)": [],
    "position_embedding=none (RoPE only)": ["method.args.position_embedding=none"],
    "random_context_start=0": ["method.args.random_context_start=0.0"],
    "basis=random": ["data.args.basis=random"],
}


def run_variant(overrides, seed):
    from recipes.api import build
    from recipes.fit import run_stages

    run = build("lcube", overrides + [f"seed={seed}", "logging.progress=none", "logging.tensorboard=false",
                                      "trainer.extra.enable_model_summary=false"])
    metrics = run_stages(run)
    return {k.split("/", 1)[1]: float(v) for k, v in metrics.items() if k.count("/") == 1}


def oracle_kl(basis: str, window: int) -> float:
    from datamodules.lcube import LCubeDataConfig
    from datamodules.synth.hierarchical_gaussian import HierarchicalGaussian

    g = HierarchicalGaussian(LCubeDataConfig(length=256, dim=16, basis=basis).generator_config())
    return float((g.window_entropies(window) - g.entropies(0)).mean())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--cache", type=Path, default=REPO / "results" / "lcube_ablations.json")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LITCTX_RUNS_DIR", str(REPO / "runs" / "bench_ablations"))
    cache = json.loads(args.cache.read_text()) if args.cache.exists() else {}
    for name, overrides in VARIANTS.items():
        for seed in args.seeds:
            key = f"{name}|{seed}"
            if key not in cache:
                t0 = time.time()
                cache[key] = run_variant(overrides, seed)
                cache[key]["seconds"] = time.time() - t0
                save_json(args.cache, cache)
                print(f"[bench] {name} seed {seed}: kl {cache[key]['kl']:.4f} utilization {cache[key]['utilization']:.3f}",
                      flush=True)
    oracles = {b: {w: oracle_kl(b, w) for w in (4, 16, 64)} for b in ("haar", "random")}

    def cell(name, key):
        vals = [cache[f"{name}|{s}"][key] for s in args.seeds]
        return f"{statistics.fmean(vals):.3f} [{min(vals):.3f}, {max(vals):.3f}]"

    lines = [f"Command: `python -m bench.lcube_ablations --seeds {' '.join(map(str, args.seeds))}` "
             f"(CPU, 2 cores; mean [min, max] over seeds {args.seeds}). Recipe `lcube` at its defaults: L = 256, "
             "dim 16, transformer d_model 64 x 2 layers, 800 steps of 32 sequences; test on 256 fresh sequences.", "",
             "| variant | test KL/token | test utilization |", "|---|---|---|"]
    for name in VARIANTS:
        lines.append(f"| {name} | {cell(name, 'kl')} | {cell(name, 'utilization')} |")
    lines += ["", "Exact window-oracle KL/token on the same data (no training): "
              + "; ".join(f"{b} basis: " + ", ".join(f"w={w} {v:.3f}" for w, v in o.items()) for b, o in oracles.items())
              + "."]
    print(write_section("lcube_ablations", "\n".join(lines), "L-CUBE: design ablations of the model (`bench/lcube_ablations.py`)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
