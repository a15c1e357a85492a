"""Length extrapolation of softmax vs LSSA vs LSSAR attention (Softplus attention, ICML 2026).

The same small Llama (the ``lssa_lm`` recipe: 4 layers, d_model 128, 4 heads of 32, RoPE, trained from scratch at
256 tokens on the installed-docs corpus with 30% passkey sequences) is trained with each attention setting and
the same budget and seeds, then tested at 1x, 2x, 4x, 8x and 16x the training length: next-token loss on held-out
text (the same number of tokens per length) and teacher-forced passkey accuracy (12 probes per length, every
answer token the argmax). The paper's claim: softmax's loss grows beyond the training length, LSSAR's stays
nearly constant (GPT-2-small, 1K training length: 3.19 -> 6.28 vs 3.19 -> 3.32 at 8x).

Each (attention, seed) run is ``python -m recipes.fit --recipe lssa_lm`` then ``python -m recipes.evaluate
--run``; finished runs are kept in ``bench/results/length_extrapolation.json`` and ``runs/bench_lssa/``, so an
interrupted benchmark continues where it stopped. Writes the table and a figure into ``docs/results.md``.

    python -m bench.length_extrapolation                      # 3 settings x 3 seeds, 300 steps each
    python -m bench.length_extrapolation --seeds 0 --steps 100
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

from bench._report import REPO, load_cache, pyplot, save_figure, save_json, train_loss_first_last, write_section

RESULTS = REPO / "bench" / "results" / "length_extrapolation.json"
FIGURE = REPO / "docs" / "figures" / "length_extrapolation.png"
RUNS = REPO / "runs" / "bench_lssa"
MODES = ("softmax", "lssa", "lssar")
TRAIN_LEN = 256
LENGTHS = (256, 512, 1024, 2048, 4096)


def _cli(module: str, argv: List[str]) -> None:
    print("[bench.length_extrapolation] python -m", module, " ".join(argv), flush=True)
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO, env=dict(os.environ))
    if proc.returncode != 0:
        raise SystemExit(f"{module} failed (exit {proc.returncode}); rerun the same command to continue")


def run_key(mode: str, seed: int, steps: int) -> str:
    return f"{mode}-s{seed}-n{steps}"


def run_one(mode: str, seed: int, args) -> Dict[str, Any]:
    """Train and test one (attention, seed); returns its record."""
    run_dir = RUNS / run_key(mode, seed, args.steps)
    if not (run_dir / "DONE").is_file():
        _cli("recipes.fit", ["--recipe", "lssa_lm", f"method.args.attention.score_mode={mode}",
                             f"method.args.seed={seed}", f"seed={seed}", f"data.args.train_batches={args.steps}",
                             "trainer.accelerator=cpu", "stages=[fit]", f"run_dir={run_dir}", "resume=auto"])
    out = run_dir / "eval" / "test-last.json"
    if not out.is_file():
        _cli("recipes.evaluate", ["--run", str(run_dir), "--ckpt", "last"])
    metrics = json.loads(out.read_text())
    rec: Dict[str, Any] = {"mode": mode, "seed": seed, "steps": args.steps,
                           "loss": {str(n): metrics.get(f"test/loss_len{n}", metrics.get("test/loss") if n == TRAIN_LEN
                                                        else None) for n in LENGTHS},
                           "passkey": {str(n): metrics.get(f"test/passkey_acc_len{n}") for n in LENGTHS},
                           "passkey_loss": {str(n): metrics.get(f"test/passkey_loss_len{n}") for n in LENGTHS}}
    if (run_dir / "logs" / "metrics.csv").is_file():
        rec["train_loss_first_last"] = train_loss_first_last(run_dir)
    return rec


def _stats(values: List[float]) -> str:
    from litctx_common.stats import mean_sd

    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    return mean_sd(vals).text(3)


def report(cache: Dict[str, Any], args) -> str:
    runs = [r for r in cache["runs"].values() if r.get("steps") == args.steps]
    seeds = sorted({r["seed"] for r in runs})
    head = "| attention | " + " | ".join(f"{n // TRAIN_LEN}x ({n})" for n in LENGTHS) + " | 8x / 1x |"
    rule = "|---" * (len(LENGTHS) + 2) + "|"
    lines = [f"`python -m bench.length_extrapolation --steps {args.steps}` (seeds {seeds}; mean ± sd over seeds; "
             f"a 4-layer d_model-128 Llama trained from scratch at {TRAIN_LEN} tokens, {args.steps} steps of 4 x "
             f"{TRAIN_LEN} tokens, 30% passkey sequences; loss on 8K held-out tokens per length).", "",
             "**Test loss (nats/token) by evaluation length**", "", head, rule]
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        if not rs:
            continue
        cells = [_stats([r["loss"].get(str(n)) for r in rs]) for n in LENGTHS]
        ratio = [r["loss"][str(8 * TRAIN_LEN)] / r["loss"][str(TRAIN_LEN)] for r in rs
                 if r["loss"].get(str(8 * TRAIN_LEN)) and r["loss"].get(str(TRAIN_LEN))]
        lines.append(f"| {mode} (n={len(rs)}) | " + " | ".join(cells) + f" | {_stats(ratio)} |")
    lines += ["", "**Passkey accuracy (teacher-forced, 12 probes per length and seed)**", "",
              "| attention | " + " | ".join(f"{n // TRAIN_LEN}x ({n})" for n in LENGTHS) + " |",
              "|---" * (len(LENGTHS) + 1) + "|"]
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        if rs:
            cells = [_stats([r["passkey"].get(str(n)) for r in rs]) for n in LENGTHS]
            lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(cache: Dict[str, Any], args) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = [r for r in cache["runs"].values() if r.get("steps") == args.steps]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        if not rs:
            continue
        for ax, key in zip(axes, ("loss", "passkey")):
            xs = [n // TRAIN_LEN for n in LENGTHS]
            for i, r in enumerate(rs):
                ys = [r[key].get(str(n)) for n in LENGTHS]
                ax.plot(xs, ys, marker="o", alpha=0.7, color={"softmax": "C0", "lssa": "C1", "lssar": "C2"}[mode],
                        label=mode if i == 0 else None)
    for ax, label in zip(axes, ("test loss (nats/token)", "passkey accuracy")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("evaluation length / training length")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("softmax vs LSSA vs LSSAR: trained at 256 tokens, tested to 16x (one line per seed)")
    fig.tight_layout()
    save_figure(fig, FIGURE)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.length_extrapolation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300, help="optimiser steps per run (4 x 256 tokens)")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    cache = load_cache(RESULTS)
    if not args.report_only:
        for seed in args.seeds:  # seed-major: every setting gets seed 0 before any gets seed 1
            for mode in args.modes:
                key = run_key(mode, seed, args.steps)
                if key not in cache["runs"]:
                    cache["runs"][key] = run_one(mode, seed, args)
                    save_json(RESULTS, cache)
    body = report(cache, args)
    figure(cache, args)
    write_section("length_extrapolation", body + f"\n\n![length extrapolation](figures/{FIGURE.name})",
                  "Softplus attention: length extrapolation (softmax vs LSSA vs LSSAR)")
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
