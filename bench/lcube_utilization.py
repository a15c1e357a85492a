"""L-CUBE at CPU scale: long-context utilization and conditional KL of a transformer and a GRU against exact
oracles, at several sequence lengths.

For every length L and seed, the script trains the ``lcube`` recipe's transformer and its GRU baseline
(``lcube_gru``) for the same number of steps and tokens per step, then tests them on fresh sequences:

* ``utilization`` = the model's estimate of the bipartite MI ``I_hat_BP(L/2; L)`` over the exact ``I_BP``;
* ``kl`` = mean KL per token from the exact conditional ``p(x_t | x_{<t})`` to the model's prediction.

Beside them, computed exactly from the generator: the full-context oracle (utilization 1, KL 0) and
window-limited oracles that see only the last ``w`` tokens (what windowed attention could reach at best).

Every finished run is stored in ``--cache`` (JSON), so an interrupted benchmark continues where it
stopped; ``--report-only`` rebuilds the report from the cache. The report goes between markers in
``docs/results.md`` and the figure to ``docs/figures/lcube_utilization.png``.

    python -m bench.lcube_utilization --lengths 256 512 1024 2048 --seeds 0 1 --steps 1200
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
from typing import Dict, List

from bench._report import REPO, save_figure, save_json, write_section


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=1200, help="optimizer steps per run")
    p.add_argument("--tokens-per-step", type=int, default=8192, help="batch size = tokens-per-step / L")
    p.add_argument("--models", nargs="+", default=["lcube", "lcube_gru"], help="recipes to compare")
    p.add_argument("--windows", type=int, nargs="+", default=[16, 64, 256], help="window-oracle sizes")
    p.add_argument("--dim", type=int, default=32, help="token dimension (>= the top level's width)")
    p.add_argument("--test-sequences", type=int, default=128)
    p.add_argument("--cache", type=Path, default=REPO / "results" / "lcube_utilization.json")
    p.add_argument("--results", type=Path, default=REPO / "docs" / "results.md")
    p.add_argument("--figure", type=Path, default=REPO / "docs" / "figures" / "lcube_utilization.png")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from the cache")
    return p.parse_args(argv)


def data_overrides(args, L: int) -> List[str]:
    batch = max(1, args.tokens_per_step // L)
    return [f"data.args.length={L}", f"data.args.dim={args.dim}", f"data.args.batch_size={batch}",
            f"data.args.test_sequences={args.test_sequences}", "data.args.val_sequences=32"]


def train_and_test(args, recipe: str, L: int, seed: int) -> Dict[str, float]:
    from recipes.api import build
    from recipes.fit import run_stages

    overrides = data_overrides(args, L) + [
        f"seed={seed}", f"trainer.max_steps={args.steps}", "trainer.max_epochs=null",
        "trainer.check_val_every_n_epoch=1000", "trainer.num_sanity_val_steps=0", "checkpoint.monitor=null",
        "logging.progress=none", "logging.tensorboard=false", f"name=bench-L{L}-s{seed}-n{args.steps}",
        "resume=auto", "trainer.extra.enable_model_summary=false",
    ]
    start = time.time()
    run = build(recipe, overrides)
    metrics = run_stages(run)
    out = {k.split("/", 1)[1]: float(v) for k, v in metrics.items() if k.startswith("test/")}
    out["seconds"] = time.time() - start
    out["params"] = sum(p.numel() for p in run.model.parameters())
    return out


def oracle_curves(args, L: int) -> Dict[str, float]:
    from datamodules.lcube import LCubeDataConfig
    from datamodules.synth.hierarchical_gaussian import HierarchicalGaussian

    cfg = LCubeDataConfig(length=L, dim=args.dim)
    g = HierarchicalGaussian(cfg.generator_config())
    full = g.entropies(0)
    ibp = g.bipartite_mi()
    out = {"bmi_true": ibp, "widths": g.widths}
    for w in args.windows:
        if w >= L:
            continue
        out[f"window{w}_utilization"] = g.window_oracle_bmi(w) / ibp
        out[f"window{w}_kl"] = float((g.window_entropies(w) - full).mean())
    return out


def _runs_for(args, cache: Dict, recipe: str, L: int) -> List[Dict[str, float]]:
    """Cached results of ``recipe`` at length ``L`` for this invocation's seeds, steps and tokens per step."""
    out = []
    for key, result in cache.get("runs", {}).items():
        r, length, seed, steps, tokens = key.split("|")
        if (r, int(length), int(steps), int(tokens)) == (recipe, L, args.steps, args.tokens_per_step) and int(seed) in args.seeds:
            out.append(result)
    return out


def _stats(values: List[float]) -> str:
    if not values:
        return "n/a"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.3f}"
    return f"{mean:.3f} [{min(values):.3f}, {max(values):.3f}]"


def report(args, cache: Dict) -> str:
    oracles = cache.get("oracles", {})
    lengths = [L for L in args.lengths if str(L) in oracles]
    names = {"lcube": "transformer", "lcube_gru": "GRU"}
    lines = [
        "Command: `python -m bench.lcube_utilization --lengths "
        + " ".join(map(str, args.lengths)) + " --seeds " + " ".join(map(str, args.seeds))
        + f" --steps {args.steps}` (CPU, 2 cores). Generated by the script; values are mean [min, max] over "
        f"seeds {args.seeds}.",
        "",
        f"Setup: L-CUBE generator with dim={args.dim}, beta=0.75, width=0.1, info_scale=0.1, haar basis "
        f"(I_BP(L/2; L) = 0.1 L^0.75). Each model trains {args.steps} steps of {args.tokens_per_step} tokens "
        f"(batch = {args.tokens_per_step}/L), then is tested on {args.test_sequences} fresh sequences with exact "
        "conditionals. Oracles are exact (no sampling).",
        "",
        "| L | I_BP (nats) | utilization: " + " | ".join(names.get(m, m) for m in args.models)
        + " | " + " | ".join(f"window-{w} oracle" for w in args.windows) + " | KL/token: "
        + " | ".join(names.get(m, m) for m in args.models) + " | " + " | ".join(f"window-{w} oracle" for w in args.windows)
        + " |",
        "|" + "---|" * (2 + 2 * (len(args.models) + len(args.windows))),
    ]
    for L in lengths:
        o = oracles[str(L)]
        row = [str(L), f"{o['bmi_true']:.2f}"]
        for m in args.models:
            row.append(_stats([r["utilization"] for r in _runs_for(args, cache, m, L)]))
        for w in args.windows:
            row.append(f"{o[f'window{w}_utilization']:.3f}" if f"window{w}_utilization" in o else "-")
        for m in args.models:
            row.append(_stats([r["kl"] for r in _runs_for(args, cache, m, L)]))
        for w in args.windows:
            row.append(f"{o[f'window{w}_kl']:.4f}" if f"window{w}_kl" in o else "-")
        lines.append("| " + " | ".join(row) + " |")
    mine = {m: [r for L in lengths for r in _runs_for(args, cache, m, L)] for m in args.models}
    secs = [r["seconds"] for rs in mine.values() for r in rs]
    params = {m: (rs[0]["params"] if rs else None) for m, rs in mine.items()}
    lines += [
        "",
        "Full-context oracle: utilization 1 and KL 0 at every length. Parameters: "
        + ", ".join(f"{names.get(m, m)} {p:,}" for m, p in params.items() if p)
        + (f". Training time per run: {min(secs):.0f}-{max(secs):.0f} s." if secs else "."),
        "",
        f"![L-CUBE utilization and KL]({os.path.relpath(args.figure, args.results.parent)})",
    ]
    return "\n".join(lines)


def plot(args, cache: Dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    oracles = cache["oracles"]
    lengths = [L for L in args.lengths if str(L) in oracles]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    names = {"lcube": "transformer", "lcube_gru": "GRU"}
    for m, marker in zip(args.models, "os^v"):
        for ax, key in zip(axes, ("utilization", "kl")):
            xs, mean, lo, hi = [], [], [], []
            for L in lengths:
                vals = [r[key] for r in _runs_for(args, cache, m, L)]
                if vals:
                    xs.append(L)
                    mean.append(statistics.fmean(vals))
                    lo.append(min(vals))
                    hi.append(max(vals))
            if xs:
                ax.plot(xs, mean, marker=marker, label=names.get(m, m))
                ax.fill_between(xs, lo, hi, alpha=0.2)
    axes[0].plot(lengths, [1.0] * len(lengths), "k-", linewidth=1, label="full-context oracle")
    styles = [("0.15", ":"), ("0.4", "-."), ("0.65", "--"), ("0.8", ":")]
    for w, (color, style) in zip(args.windows, styles):
        xs = [L for L in lengths if f"window{w}_utilization" in oracles[str(L)]]
        for ax, key in zip(axes, ("utilization", "kl")):
            ax.plot(xs, [oracles[str(L)][f"window{w}_{key}"] for L in xs], color=color, linestyle=style,
                    marker=".", label=f"window-{w} oracle")
    axes[0].set_ylabel("utilization  I_hat_BP / I_BP")
    axes[1].set_ylabel("conditional KL per token (nats)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length L")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("L-CUBE at CPU scale: models vs exact oracles")
    fig.tight_layout()
    save_figure(fig, args.figure)


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LITCTX_RUNS_DIR", str(REPO / "runs" / "bench"))
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cache = json.loads(args.cache.read_text()) if args.cache.exists() else {}
    cache.setdefault("runs", {})
    cache.setdefault("oracles", {})
    if not args.report_only:
        for L in args.lengths:
            if str(L) not in cache["oracles"]:
                t0 = time.time()
                cache["oracles"][str(L)] = oracle_curves(args, L)
                save_json(args.cache, cache)
                print(f"[bench] oracles L={L}: I_BP={cache['oracles'][str(L)]['bmi_true']:.2f} ({time.time() - t0:.0f}s)",
                      flush=True)
        for seed in args.seeds:
            for L in args.lengths:
                for recipe in args.models:
                    key = f"{recipe}|{L}|{seed}|{args.steps}|{args.tokens_per_step}"
                    if key in cache["runs"]:
                        continue
                    result = train_and_test(args, recipe, L, seed)
                    cache["runs"][key] = result
                    save_json(args.cache, cache)
                    print(f"[bench] {recipe} L={L} seed={seed}: utilization {result['utilization']:.3f} "
                          f"kl {result['kl']:.4f} ({result['seconds']:.0f}s)", flush=True)
    text = write_section("lcube_utilization", report(args, cache),
                         "L-CUBE: long-context utilization (`bench/lcube_utilization.py`)", args.results)
    plot(args, cache)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
