"""The timestep scaling paradox at CPU scale: accuracy against the number of frames T for LIF and TS neurons.

The temporal-order event task (``spiking_events`` / ``spiking_events_ts`` recipes): the same one-second streams
are binned into T in {4, 8, 16, 32, 64} frames, so the gap between the two bursts spans about T/2 steps. Every
(neuron, T, seed) trains for the same number of optimiser steps (``--epochs`` over ``--train-size`` streams) and
reports test accuracy on 512 held-out streams. Also: fused LIF scan against the step-by-step loop, forward +
backward at T = 64, in the same process.

    python -m bench.timestep_scaling                          # 5 T x 2 neurons x 3 seeds
    python -m bench.timestep_scaling --steps 4 16 64 --epochs 5   # the reduced run reported in docs/results.md

Results are cached per configuration in ``results/timestep_scaling.json`` (a rerun continues); the
table goes to ``docs/results.md`` and the plot to ``docs/figures/timestep_scaling.png``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings
from pathlib import Path
from typing import Dict

from bench._report import REPO, load_cache, save_figure, save_json, write_section
from litctx_common.timing import Stopwatch, clock

RECIPES = {"events": {"lif": "spiking_events", "ts": "spiking_events_ts"},
           "digits": {"lif": "spiking_digits", "ts": "spiking_digits_ts"},
           "gunpoint": {"lif": "spiking_gunpoint", "ts": "spiking_gunpoint_ts"}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--neurons", nargs="+", default=["lif", "ts"], choices=["lif", "ts"])
    p.add_argument("--dataset", default="events", choices=sorted(RECIPES),
                   help="events (temporal order), digits (scikit-learn digits, row by row; T multiple of 8) or "
                        "gunpoint (aeon's GunPoint series resampled to T)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--train-size", type=int, default=1024)
    p.add_argument("--task", default="order", choices=["order", "xor"])
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--cache", type=Path, default=None, help="default results/timestep_scaling[_digits].json")
    p.add_argument("--results", type=Path, default=REPO / "docs" / "results.md")
    p.add_argument("--figure", type=Path, default=None, help="default docs/figures/timestep_scaling[_digits].png")
    args = p.parse_args(argv)
    suffix = "" if args.dataset == "events" else f"_{args.dataset}"
    args.cache = args.cache or REPO / "results" / f"timestep_scaling{suffix}.json"
    args.figure = args.figure or REPO / "docs" / "figures" / f"timestep_scaling{suffix}.png"
    if args.dataset == "digits" and any(t % 8 for t in args.steps):
        p.error(f"--dataset digits needs --steps that are multiples of 8, got {args.steps}")
    return args


def train_and_test(args, neuron: str, steps: int, seed: int) -> Dict[str, float]:
    from recipes.api import build
    from recipes.fit import run_stages

    data = ([f"data.args.task={args.task}", f"data.args.train_size={args.train_size}"] if args.dataset == "events"
            else [])
    overrides = [f"seed={seed}", f"data.args.seed={seed}", f"data.args.steps={steps}", *data,
                 f"trainer.max_epochs={args.epochs}",
                 "logging.progress=none", "logging.tensorboard=false", "trainer.extra.enable_model_summary=false",
                 f"name=bench-{args.dataset}-{neuron}-T{steps}-s{seed}-e{args.epochs}-{args.task}", "resume=auto"]

    start = clock()
    run = build(RECIPES[args.dataset][neuron], overrides)
    metrics = run_stages(run)
    return {"acc": float(metrics["test/acc"]), "loss": float(metrics["test/loss"]), "seconds": clock() - start}


def _key(args, neuron: str, steps: int, seed: int) -> str:
    suffix = (f"{args.epochs}|{args.task}|{args.train_size}" if args.dataset == "events"
              else f"{args.epochs}|{args.dataset}")
    return f"{neuron}|{steps}|{seed}|{suffix}"


def _accs(args, cache, neuron: str, steps: int):
    return [cache["runs"][_key(args, neuron, steps, s)]["acc"] for s in args.seeds
            if _key(args, neuron, steps, s) in cache["runs"]]


def speed(neuron: str = "lif", steps: int = 64, repeats: int = 3) -> Dict[str, float]:
    """Best-of-``repeats`` forward + backward seconds of the loop and the fused scan on ``[T, 32, 64, 64]``."""
    import torch

    from lightning_modules.spiking import LIF, TSNeuron

    x = torch.rand(steps, 32, 64, 64) * 2
    out = {}
    for impl in ("loop", "fused"):
        layer = LIF(implementation=impl) if neuron == "lif" else TSNeuron(channels=64, implementation=impl,
                                                                             forget_period=16)
        watch = Stopwatch(x)
        for _ in range(repeats):
            xx = x.clone().requires_grad_(True)  # the copy is not timed
            with watch:
                layer(xx).sum().backward()
        out[impl] = min(watch.laps)
    out["speedup"] = out["loop"] / out["fused"]
    return out


def report(args, cache) -> str:
    if args.dataset == "events":
        what = (f"task `{args.task}`, {args.train_size} training streams, the same {args.epochs} epochs = "
                f"{args.epochs * args.train_size // 32} optimiser steps at every T, test on 512 streams")
    elif args.dataset == "digits":
        what = (f"scikit-learn digits row by row, 1,078 training images, the same {args.epochs} epochs at every T, "
                "test on 449 images")
    else:
        what = (f"GunPoint (aeon's copy) resampled to T, 50 training series, the same {args.epochs} epochs at every T, "
                "test on 105 series")
    lines = [f"Command: `python -m bench.timestep_scaling --dataset {args.dataset} --steps "
             f"{' '.join(map(str, args.steps))} --epochs {args.epochs}` ({what}; seeds "
             f"{', '.join(map(str, args.seeds))}; CPU, 2 cores).", "",
             "| neuron | " + " | ".join(f"T = {t}" for t in args.steps) + " |",
             "|---|" + "---|" * len(args.steps)]
    for neuron in args.neurons:
        cells = []
        for t in args.steps:
            accs = _accs(args, cache, neuron, t)
            cells.append(f"{statistics.fmean(accs):.3f} ({min(accs):.3f}-{max(accs):.3f}, n={len(accs)})" if accs else "-")
        lines.append(f"| {neuron.upper()} | " + " | ".join(cells) + " |")
    for key, name in (("speed_lif", "LIF"), ("speed_ts", "TS")):
        if key in cache:
            s = cache[key]
            lines += ["", f"Fused {name} scan vs the step-by-step loop, forward + backward, T = 64, [64, 32, 64, 64] fp32, "
                      f"best of 3: loop {s['loop']:.3f} s, fused {s['fused']:.3f} s (**{s['speedup']:.1f}x**)."]
    rel = os.path.relpath(args.figure, args.results.parent)
    lines += ["", f"![accuracy against T]({rel})"]
    return "\n".join(lines)


def plot(args, cache) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    for neuron, marker in zip(args.neurons, "os"):
        xs, mean, lo, hi = [], [], [], []
        for t in args.steps:
            accs = _accs(args, cache, neuron, t)
            if accs:
                xs.append(t)
                mean.append(statistics.fmean(accs))
                lo.append(min(accs))
                hi.append(max(accs))
        if xs:
            ax.plot(xs, mean, marker=marker, label=neuron.upper())
            ax.fill_between(xs, lo, hi, alpha=0.2)
    ax.axhline(0.5, color="0.5", linewidth=1, linestyle=":", label="chance")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("frames per sample T (same one-second streams)")
    ax.set_ylabel("test accuracy")
    title = {"events": "temporal-order events", "digits": "digits, row by row", "gunpoint": "GunPoint"}[args.dataset]
    ax.set_title(f"{title}, {args.epochs} epochs, {len(args.seeds)} seeds")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, args.figure)


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LITCTX_RUNS_DIR", str(REPO / "runs" / "bench"))
    cache = load_cache(args.cache)
    if not args.report_only:
        cache.pop("speed", None)  # an older layout ([64, 32, 4096], LIF only)
        for neuron in ("lif", "ts"):
            if f"speed_{neuron}" not in cache:
                cache[f"speed_{neuron}"] = speed(neuron)
                save_json(args.cache, cache)
                print(f"[bench] fused {neuron} {cache[f'speed_{neuron}']['speedup']:.1f}x the loop at T=64", flush=True)
        for seed in args.seeds:
            for t in args.steps:
                for neuron in args.neurons:
                    key = _key(args, neuron, t, seed)
                    if key in cache["runs"]:
                        continue
                    cache["runs"][key] = train_and_test(args, neuron, t, seed)
                    save_json(args.cache, cache)
                    r = cache["runs"][key]
                    print(f"[bench] {neuron} T={t} seed={seed}: acc {r['acc']:.3f} ({r['seconds']:.0f}s)", flush=True)
    section = "timestep_scaling" if args.dataset == "events" else f"timestep_scaling_{args.dataset}"
    text = write_section(section, report(args, cache),
                         f"Spiking: the timestep scaling paradox, {args.dataset} (`bench/timestep_scaling.py`)",
                         args.results)
    plot(args, cache)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
