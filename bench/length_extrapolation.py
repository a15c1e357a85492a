"""Length extrapolation of softmax vs LSSA vs LSSAR attention (Softplus attention, ICML 2026).

The same small Llama (4 layers, d_model 128, 4 heads of 32, RoPE) is trained from scratch with each attention
setting, the same budget and the same seeds, then tested at 1x, 2x, 4x, 8x and 16x the training length. Two
settings (``--recipe``):

* ``lssa_copy`` (default): synthetic long-range copy and key-value retrieval over 60 symbols, trained at 128
  tokens; loss on the copied / retrieved tokens and retrieval-probe accuracy (every answer token the argmax).
  Every target needs attention as far back as the sequence is long, so beyond the training length the model must
  attend to positions it never saw.
* ``lssa_lm``: the installed-docs corpus with 30% passkey sequences (SmolLM2 tokenizer), trained at 256 tokens;
  loss on held-out text (the same number of tokens per length) and teacher-forced passkey accuracy.

The paper's claim: softmax's loss grows beyond the training length, LSSAR's stays nearly constant (GPT-2-small,
1K training length: 3.19 -> 6.28 vs 3.19 -> 3.32 at 8x).

Each (attention, seed) run is ``python -m recipes.fit --recipe <recipe>`` then ``python -m recipes.evaluate
--run``; finished runs are kept in ``results/length_extrapolation.json`` and ``runs/bench_lssa/``, so an
interrupted benchmark continues where it stopped. Writes the tables and a figure into ``docs/results.md``.

    python -m bench.length_extrapolation                             # lssa_copy: 3 settings x 3 seeds
    python -m bench.length_extrapolation --recipe lssa_lm --seeds 0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

from bench._report import REPO, load_cache, pyplot, save_figure, save_json, train_loss_first_last, write_section

RESULTS = REPO / "results" / "length_extrapolation.json"
FIGURE = REPO / "docs" / "figures" / "length_extrapolation.png"
RUNS = REPO / "runs" / "bench_lssa"
MODES = ("softmax", "lssa", "lssar")
SETTINGS = {
    # recipe -> (training length, evaluation lengths, default steps, what it trains on)
    "lssa_copy": (128, (128, 256, 512, 1024, 2048), 1000,
                  "synthetic copy + key-value retrieval over 60 symbols (16 x 128 tokens a step; loss on the copied / "
                  "retrieved tokens, 4 sequences per length; 20 retrieval probes per length)"),
    "lssa_lm": (256, (256, 512, 1024, 2048, 4096), 300,
                "the installed-docs corpus with 30% passkey sequences (4 x 256 tokens a step; loss on 8K held-out "
                "tokens per length; 12 passkey probes per length)"),
}


def _cli(module: str, argv: List[str]) -> None:
    print("[bench.length_extrapolation] python -m", module, " ".join(argv), flush=True)
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO, env=dict(os.environ))
    if proc.returncode != 0:
        raise SystemExit(f"{module} failed (exit {proc.returncode}); rerun the same command to continue")


def run_key(recipe: str, mode: str, seed: int, steps: int) -> str:
    return f"{mode}-s{seed}-n{steps}" if recipe == "lssa_lm" else f"{recipe}-{mode}-s{seed}-n{steps}"


def run_one(mode: str, seed: int, args) -> Dict[str, Any]:
    """Train and test one (attention, seed); returns its record."""
    run_dir = RUNS / run_key(args.recipe, mode, seed, args.steps)
    train_len, lengths = SETTINGS[args.recipe][:2]
    if not (run_dir / "DONE").is_file():
        _cli("recipes.fit", ["--recipe", args.recipe, f"method.args.attention.score_mode={mode}",
                             f"method.args.seed={seed}", f"seed={seed}", f"data.args.train_batches={args.steps}",
                             "trainer.accelerator=cpu", "stages=[fit]", f"run_dir={run_dir}", "resume=auto"])
    out = run_dir / "eval" / "test-last.json"
    if not out.is_file():
        _cli("recipes.evaluate", ["--run", str(run_dir), "--ckpt", "last"])
    metrics = json.loads(out.read_text())
    rec: Dict[str, Any] = {"recipe": args.recipe, "mode": mode, "seed": seed, "steps": args.steps,
                           "loss": {str(n): metrics.get(f"test/loss_len{n}", metrics.get("test/loss") if n == train_len
                                                        else None) for n in lengths},
                           "passkey": {str(n): metrics.get(f"test/passkey_acc_len{n}") for n in lengths},
                           "passkey_loss": {str(n): metrics.get(f"test/passkey_loss_len{n}") for n in lengths}}
    if (run_dir / "logs" / "metrics.csv").is_file():
        rec["train_loss_first_last"] = train_loss_first_last(run_dir)
    return rec


def _stats(values: List[float]) -> str:
    from litctx_common.stats import mean_sd

    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    return mean_sd(vals).text(3)


def _runs(cache: Dict[str, Any], recipe: str, steps: int) -> List[Dict[str, Any]]:
    return [r for r in cache["runs"].values() if r.get("steps") == steps and r.get("recipe", "lssa_lm") == recipe]


def report_recipe(cache: Dict[str, Any], recipe: str, steps: int) -> str:
    train_len, lengths, _, what = SETTINGS[recipe]
    runs = _runs(cache, recipe, steps)
    if not runs:
        return ""
    seeds = sorted({r["seed"] for r in runs})
    head = "| attention | " + " | ".join(f"{n // train_len}x ({n})" for n in lengths) + " | 8x / 1x |"
    rule = "|---" * (len(lengths) + 2) + "|"
    lines = [f"**`{recipe}`**: `python -m bench.length_extrapolation --recipe {recipe} --steps {steps}` (seeds "
             f"{seeds}; mean ± sd over seeds; a 4-layer d_model-128 Llama trained from scratch at {train_len} tokens "
             f"for {steps} steps on {what}).", "",
             "Test loss (nats/token) by evaluation length:", "", head, rule]
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        if not rs:
            continue
        cells = [_stats([r["loss"].get(str(n)) for r in rs]) for n in lengths]
        ratio = [r["loss"][str(8 * train_len)] / r["loss"][str(train_len)] for r in rs
                 if r["loss"].get(str(8 * train_len)) and r["loss"].get(str(train_len))]
        lines.append(f"| {mode} (n={len(rs)}) | " + " | ".join(cells) + f" | {_stats(ratio)} |")
    lines += ["", "Passkey / retrieval-probe accuracy (teacher-forced, every answer token the argmax):", "",
              "| attention | " + " | ".join(f"{n // train_len}x ({n})" for n in lengths) + " |",
              "|---" * (len(lengths) + 1) + "|"]
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        if rs:
            cells = [_stats([r["passkey"].get(str(n)) for r in rs]) for n in lengths]
            lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(cache: Dict[str, Any], args) -> str:
    parts = [report_recipe(cache, recipe, SETTINGS[recipe][2] if recipe != args.recipe else args.steps)
             for recipe in SETTINGS]
    return "\n\n".join(p for p in parts if p)


def figure(cache: Dict[str, Any], args) -> None:
    plt = pyplot()
    if plt is None:
        return
    train_len, lengths = SETTINGS[args.recipe][:2]
    runs = _runs(cache, args.recipe, args.steps)
    if not runs:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        if not rs:
            continue
        for ax, key in zip(axes, ("loss", "passkey")):
            xs = [n // train_len for n in lengths]
            for i, r in enumerate(rs):
                ys = [r[key].get(str(n)) for n in lengths]
                ax.plot(xs, ys, marker="o", alpha=0.7, color={"softmax": "C0", "lssa": "C1", "lssar": "C2"}[mode],
                        label=mode if i == 0 else None)
    for ax, label in zip(axes, ("test loss (nats/token)", "passkey accuracy")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("evaluation length / training length")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"{args.recipe}: softmax vs LSSA vs LSSAR, trained at {train_len} tokens, tested to 16x "
                 f"(one line per seed)")
    fig.tight_layout()
    save_figure(fig, FIGURE)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.length_extrapolation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipe", default="lssa_copy", choices=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=None, help="optimiser steps per run (default: the setting's)")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = SETTINGS[args.recipe][2]
    cache = load_cache(RESULTS)
    if not args.report_only:
        for seed in args.seeds:  # seed-major: every setting gets seed 0 before any gets seed 1
            for mode in args.modes:
                key = run_key(args.recipe, mode, seed, args.steps)
                if key not in cache["runs"]:
                    cache["runs"][key] = run_one(mode, seed, args)
                    save_json(RESULTS, cache)
    body = report(cache, args)
    figure(cache, args)
    write_section("length_extrapolation", body + f"\n\n![length extrapolation](figures/{FIGURE.name}) "
                  f"({args.recipe})",
                  "Softplus attention: length extrapolation (softmax vs LSSA vs LSSAR)")
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
