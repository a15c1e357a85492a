"""The PCFG study at CPU scale: KL to the exact next-token conditionals against training, for the transformer
and n-gram baselines; then layer-wise probes for the inside algorithm's constituent labels.

For each seed: train the ``pcfg`` recipe (depth 4 = 16 tokens, 8 symbols per level, a 4-layer causal
transformer, 1,500 steps of 64 fresh strings), reading its validation KL after every epoch; fit unigram, bigram
and trigram models on the same number of fresh strings the transformer had seen at each point, and score them on
the same validation set; then probe the final model: a logistic regression per (layer, level) on 2,000 strings,
scored on 1,000 others, for the argmax-inside label of each span (``lightning_modules/pcfg/probes.py``). The
hand-set log-depth construction (``lightning_modules/pcfg/construction.py``) is scored on the same strings.

    python -m bench.pcfg                 # 3 seeds, about 5 minutes on 2 cores
    python -m bench.pcfg --report-only   # rewrite the table and figure from results/pcfg.json
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

from bench._report import REPO, cached_run, load_cache, pyplot, save_figure, save_json, write_section
from litctx_common.stats import mean_sd

ORDERS = {1: "unigram", 2: "bigram", 3: "trigram"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--probe-train", type=int, default=2000)
    p.add_argument("--probe-test", type=int, default=1000)
    p.add_argument("--cache", type=Path, default=REPO / "results" / "pcfg.json")
    p.add_argument("--results", type=Path, default=REPO / "docs" / "results.md")
    p.add_argument("--figure", type=Path, default=REPO / "docs" / "figures" / "pcfg.png")
    p.add_argument("--report-only", action="store_true")
    return p.parse_args(argv)


def _val_curve(run_dir: Path) -> List[tuple]:
    rows = list(csv.DictReader(open(run_dir / "logs" / "metrics.csv")))
    return [(int(r["step"]) + 1, float(r["val/kl"])) for r in rows if r.get("val/kl")]


def run_seed(args, seed: int) -> Dict[str, object]:
    import torch

    from lightning_modules.pcfg.module import conditional_kl
    from lightning_modules.pcfg.ngram import NGramModel
    from lightning_modules.pcfg.probes import layer_states, probe_accuracy, probe_dataset, span_labels
    from recipes.api import build
    from recipes.fit import run_stages

    start = time.time()
    run = build("pcfg", [f"seed={seed}", f"data.args.seed={seed}", f"trainer.max_epochs={args.epochs}",
                         "logging.progress=none", "logging.tensorboard=false",
                         "trainer.extra.enable_model_summary=false", f"name=bench-pcfg-s{seed}-e{args.epochs}",
                         "resume=auto"])
    metrics = run_stages(run)
    curve = _val_curve(run.run_dir)
    seconds = time.time() - start
    dm, cfg = run.datamodule, run.datamodule.cfg
    val = dm.eval_set("val")
    batch_strings = cfg.batch_size
    ngram = {}
    gen = torch.Generator().manual_seed(10_000 + seed)
    for order in ORDERS:
        model, seen, points = NGramModel(order, cfg.symbols), 0, []
        for step, _ in curve:
            need = step * batch_strings
            while seen < need:
                chunk = min(need - seen, 20_000)
                model.fit(dm.grammar.sample(chunk, gen))
                seen += chunk
            points.append((step, float(conditional_kl(val.cond.double(), model.log_probs(val.x)).mean())))
        ngram[ORDERS[order]] = points
    model = run.model.eval()  # holds the best checkpoint's weights: the test stage restored them
    g = torch.Generator().manual_seed(20_000 + seed)
    xtr, xte = dm.grammar.sample(args.probe_train, g), dm.grammar.sample(args.probe_test, g)
    acc = probe_accuracy(probe_dataset(layer_states(model, xtr), span_labels(dm.grammar, xtr)),
                         probe_dataset(layer_states(model, xte), span_labels(dm.grammar, xte)))
    return {"test_kl": float(metrics["test/kl"]), "curve": curve, "ngram": ngram, "seconds": seconds,
            "probes": {f"{layer}|{level}": v for (layer, level), v in acc.items()}}


def construction_kl() -> float:
    """KL (float64) of the hand-set log-depth construction on the recipe's 512 validation strings."""
    from datamodules.pcfg import PCFGDataConfig, PCFGDataModule
    from lightning_modules.pcfg.construction import LogDepthParser

    dm = PCFGDataModule(PCFGDataConfig(depth=4, symbols=8, productions=3))
    val = dm.eval_set("val")
    exact = dm.grammar.next_token_logprobs(val.x)
    built = LogDepthParser(dm.grammar)(val.x)
    return float((exact.exp() * (exact - built)).nan_to_num(0.0).sum(-1).mean())


def report(args, cache) -> str:
    runs = [cache["runs"][str(s)] for s in args.seeds if str(s) in cache["runs"]]
    if not runs:
        return "no runs yet"
    lines = [f"`python -m bench.pcfg --seeds {' '.join(map(str, args.seeds))}` (recipe `pcfg`: depth 4 = 16 tokens, "
             f"8 symbols per level, 3 productions, grammar seed 0; {args.epochs} epochs x 100 steps x 64 fresh "
             "strings; n-grams fitted on as many fresh strings as the transformer had seen, add-0.5 smoothing; "
             "KL in nats per token on the 512 validation strings, mean ± sd over seeds).", "",
             f"| model | KL after {runs[0]['curve'][0][0] * 64:,} strings | KL after {runs[0]['curve'][-1][0] * 64:,} "
             "strings | per seed (end) |", "|---|---|---|---|"]
    first = [r["curve"][0][1] for r in runs]
    last = [r["curve"][-1][1] for r in runs]
    lines.append(f"| transformer (4 layers, d 64) | {mean_sd(first).text()} | {mean_sd(last).text()} | "
                 f"{', '.join(f'{v:.4f}' for v in last)} |")
    for name in ORDERS.values():
        f = [r["ngram"][name][0][1] for r in runs]
        e = [r["ngram"][name][-1][1] for r in runs]
        lines.append(f"| {name} | {mean_sd(f).text()} | {mean_sd(e).text()} | {', '.join(f'{v:.4f}' for v in e)} |")
    if "construction_kl" in cache:
        lines.append(f"| log-depth construction (hand-set, 8 layers, no training) | - | {cache['construction_kl']:.1e} | - |")
    test = [r["test_kl"] for r in runs]
    lines += ["", f"Transformer test KL (1,024 strings, best checkpoint): {mean_sd(test).text()}; trigram/transformer ratio at "
              f"the end: {statistics.mean(e) / statistics.mean(last):.1f}x.", ""]
    # probes: mean accuracy per layer and level
    keys = sorted({tuple(map(int, k.split("|"))) for k in runs[0]["probes"]})
    layers = sorted({k[0] for k in keys})
    levels = sorted({k[1] for k in keys})
    lines += ["Probe accuracy for the argmax-inside label of each span (rows: level k, spans of 2^k tokens; columns: "
              "layer, 0 = embedding), mean over seeds; last column: the majority-label baseline.", "",
              "| level | " + " | ".join(f"layer {layer}" for layer in layers) + " | majority |",
              "|---|" + "---|" * (len(layers) + 1)]
    for level in levels:
        accs = [statistics.mean(r["probes"][f"{layer}|{level}"]["acc"] for r in runs) for layer in layers]
        maj = statistics.mean(r["probes"][f"0|{level}"]["majority"] for r in runs)
        lines.append(f"| {level} | " + " | ".join(f"{a:.3f}" for a in accs) + f" | {maj:.3f} |")
    secs = statistics.mean(r["seconds"] for r in runs)
    lines += ["", f"Training time per seed: {secs:.0f} s."]
    return "\n".join(lines)


def plot(args, cache) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = [cache["runs"][str(s)] for s in args.seeds if str(s) in cache["runs"]]
    if not runs:
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [s for s, _ in runs[0]["curve"]]
    strings = [s * 64 for s in steps]
    mean = [statistics.mean(r["curve"][i][1] for r in runs) for i in range(len(steps))]
    ax.plot(strings, mean, marker="o", label="transformer")
    for name in ORDERS.values():
        ax.plot(strings, [statistics.mean(r["ngram"][name][i][1] for r in runs) for i in range(len(steps))],
                ls="--", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training strings seen")
    ax.set_ylabel("KL to the exact conditionals (nats/token)")
    ax.legend()
    ax.set_title("next-token KL against training")
    keys = sorted({tuple(map(int, k.split("|"))) for k in runs[0]["probes"]})
    layers = sorted({k[0] for k in keys})
    for level in sorted({k[1] for k in keys}):
        accs = [statistics.mean(r["probes"][f"{layer}|{level}"]["acc"] for r in runs) for layer in layers]
        maj = statistics.mean(r["probes"][f"0|{level}"]["majority"] for r in runs)
        line, = bx.plot(layers, accs, marker="o", label=f"level {level} (spans of {2 ** level})")
        bx.axhline(maj, color=line.get_color(), ls=":", lw=1)
    bx.set_xticks(layers)
    bx.set_xlabel("layer (0 = embedding)")
    bx.set_ylabel("probe accuracy (dotted: majority label)")
    bx.set_title("constituent labels by layer")
    bx.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, args.figure)


def main(argv=None) -> int:
    args = parse_args(argv)
    cache = load_cache(args.cache)
    if not args.report_only:
        for seed in args.seeds:
            cached_run(cache, args.cache, str(seed), lambda seed=seed: run_seed(args, seed))
            print(f"[pcfg] seed {seed}: test KL {cache['runs'][str(seed)]['test_kl']:.4f}", flush=True)
    if "construction_kl" not in cache:
        cache["construction_kl"] = construction_kl()
        save_json(args.cache, cache)
    body = report(args, cache)
    print(body)
    write_section("pcfg", body + "\n\n![PCFG](figures/pcfg.png)", "PCFG study: KL against n-grams, and probes",
                  args.results)
    plot(args, cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
