"""MEG-XL's claim at CPU scale: does long-context pre-training help word decoding with scarce labels?

For the synthetic study with its slow context process **on** and **off** (``synthetic.context``), and for each
seed:

1. pre-train two backbones for the same number of optimizer steps and about the same number of tokens:
   **long** (150-s contexts, batch 1, 3-s masked blocks) and **short** (5-s contexts, batch 30, 2-s blocks, so
   both mask ~40% of their tokens);
2. train word decoding on held-out subjects (05, 06) with each fraction of ``--label-fractions`` of the labelled
   training samples, on the long backbone, the short backbone and a **scratch** (random) one, with identical
   settings: ``--protocol linear`` (default; the research note's test) fits a multinomial logistic regression
   (scikit-learn, to convergence) on the frozen backbone's pooled word features; ``probe`` trains the recipe's
   MLP head on a frozen backbone by SGD; ``finetune`` trains everything (backbone at 0.3x the head's rate).
   The same linear probe on the preprocessed signal itself (no network) is reported as a reference;
3. record test top-10 accuracy (among the 50 most frequent words; the synthetic vocabulary has 40, so chance is
   10/40 = 0.25) and its class-balanced version.

Runs are cached in ``bench/results/meg_context.json`` (a rerun skips finished runs); the table goes into
``docs/results.md`` and the figure into ``docs/figures/meg_context.png``.

    python -m bench.meg_context                      # 3 seeds, context on and off (about 30 min on 2 cores)
    python -m bench.meg_context --seeds 0 --report-only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

from bench._report import REPO, load_cache, pyplot, save_figure, save_json, write_section
from litctx_common.stats import mean_sd

PRE = {"long": {"context_s": 150.0, "stride_s": 15.0, "batch_size": 1, "mask_s": 3.0},
       "short": {"context_s": 5.0, "stride_s": 0.625, "batch_size": 30, "mask_s": 2.0}}
INITS = ("long", "short", "scratch")
LABELS = {"long": "long (150 s)", "short": "short (5 s)", "scratch": "none (random backbone)",
          "signal": "no network (the signal itself)"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--contexts", nargs="+", default=["on", "off"], choices=["on", "off"])
    p.add_argument("--pretrain-epochs", type=int, default=2)
    p.add_argument("--finetune-epochs", type=int, default=12)
    p.add_argument("--label-fractions", type=float, nargs="+", default=[0.25, 1.0],
                   help="fractions of the labelled training samples (each gets its own table)")
    p.add_argument("--protocol", default="linear", choices=["linear", "probe", "finetune"])
    p.add_argument("--probe-c", type=float, default=0.01, help="inverse L2 strength of the linear probe")
    p.add_argument("--probe-chunks", type=int, default=12,
                   help="the probe pools each 3-s word window in this many parts (12: about one token each)")
    p.add_argument("--runs-root", type=Path, default=REPO / "runs" / "bench-meg")
    p.add_argument("--cache", type=Path, default=REPO / "bench" / "results" / "meg_context.json")
    p.add_argument("--results", type=Path, default=REPO / "docs" / "results.md")
    p.add_argument("--figure", type=Path, default=REPO / "docs" / "figures" / "meg_context.png")
    p.add_argument("--report-only", action="store_true")
    return p.parse_args(argv)


def _common(args, context: str, seed: int) -> List[str]:
    synth = json.dumps({"subjects": 6, "duration_s": 600.0, "context": context == "on"})
    return [f"seed={seed}", f"data.args.seed={seed}", f"data.args.synthetic={synth}", "logging.progress=none",
            "logging.tensorboard=false", "trainer.extra.enable_model_summary=false", "then.recipe=null", "resume=auto"]


def pretrain(args, context: str, kind: str, seed: int) -> Dict[str, object]:
    from recipes.api import build
    from recipes.fit import run_stages

    p = PRE[kind]
    run_dir = args.runs_root / f"pre-{context}-{kind}-s{seed}"
    overrides = _common(args, context, seed) + [
        f"data.args.context_s={p['context_s']}", f"data.args.stride_s={p['stride_s']}",
        f"data.args.batch_size={p['batch_size']}", f"method.args.mask_s={p['mask_s']}",
        f"trainer.max_epochs={args.pretrain_epochs}", "stages=[fit]", f"run_dir={run_dir}"]
    start = time.time()
    run = build("meg_xl", overrides)
    run_stages(run)
    best = run._ckpt("best")
    score = run.trainer.checkpoint_callback.best_model_score
    return {"ckpt": best, "val_acc": float(score) if score is not None else None, "seconds": time.time() - start,
            "steps": int(run.trainer.global_step)}


def finetune(args, context: str, init: str, seed: int, ckpt) -> Dict[str, float]:
    from recipes.api import build
    from recipes.fit import run_stages

    run_dir = args.runs_root / f"{args.protocol}-{context}-{init}-s{seed}-f{args.label_fraction}"
    overrides = _common(args, context, seed) + [
        f"data.args.train_fraction={args.label_fraction}", f"trainer.max_epochs={args.finetune_epochs}",
        f"run_dir={run_dir}", "~callbacks.report"]
    if ckpt:
        overrides.append(f"init_from={ckpt}")
    if args.protocol == "probe":
        overrides.append("optim.lr_scale={backbone: 0.0}")  # frozen backbone (random for scratch)
    elif not ckpt:
        overrides.append("optim.lr_scale={}")  # from scratch: one learning rate for everything
    start = time.time()
    run = build("meg_xl_finetune", overrides)
    metrics = run_stages(run)
    return {"top10": float(metrics["test/top10_acc"]), "balanced": float(metrics["test/top10_balanced"]),
            "chance": float(metrics["test/top10_chance"]), "seconds": time.time() - start,
            "steps": int(run.trainer.global_step)}


def _word_data(args, context: str, seed: int):
    """The fine-tuning recipe's DataModule (set up) and method config, without building a model or Trainer."""
    from lightning_modules.meg.module import MEGXLWordConfig
    from recipes import registry
    from recipes.config import load_config

    run = load_config("meg_xl_finetune", _common(args, context, seed)
                      + [f"data.args.train_fraction={args.label_fraction}"]).run
    dm = registry.create_datamodule(run.data.name, run.data.args)
    dm.setup("fit")
    return dm, MEGXLWordConfig(**run.method.args)


def _pooled(model, dataset, chunks: int, stride: int):
    """``(features [n_words, chunks*C*d], word ids [n_words])`` of a frozen backbone (``model`` is None: the
    preprocessed signal itself, averaged over ``chunks`` parts of each word window)."""
    import torch

    from lightning_modules.meg.module import pool_spans

    feats, ids = [], []
    with torch.no_grad():
        for i in range(len(dataset)):
            item = {k: v.unsqueeze(0) for k, v in dataset[i].items()}
            if model is None:
                meg = item["meg"]  # [1, C, S]: one "token" per sample
                f = pool_spans(meg.unsqueeze(-1), item["word_spans"], 1, chunks)
            else:
                f = pool_spans(model.features(item), item["word_spans"], stride, chunks)
            feats.append(f.flatten(2)[0])
            ids.append(item["word_ids"][0])
    return torch.cat(feats).numpy(), torch.cat(ids).numpy()


def linear_probe(args, context: str, init: str, seed: int, ckpt) -> Dict[str, float]:
    """Multinomial logistic regression on frozen pooled features; top-10 accuracy on the test split."""
    import numpy as np
    import torch
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    from lightning_modules.io import load_weights
    from lightning_modules.meg.module import MEGXLPretrainModule

    start = time.time()
    dm, cfg = _word_data(args, context, seed)
    model = None
    if init != "signal":
        torch.manual_seed(seed)
        base = {k: getattr(cfg, k) for k in ("sfreq", "stride", "levels", "codes", "code_dim", "d_model", "n_layers",
                                              "n_heads", "mlp_ratio", "dropout", "fourier_features")}
        model = MEGXLPretrainModule(base).eval()
        if ckpt:
            load_weights(model, ckpt, strict=True, prefixes=model.init_prefixes)
        else:  # scratch: a random backbone; the tokenizer is fitted on the labelled training samples
            train = dm.split("train")
            model.tokenizer.fit(torch.cat([train[i]["meg"][train[i]["sensor_mask"]] for i in range(len(train))]))
    xtr, ytr = _pooled(model, dm.split("train"), args.probe_chunks, cfg.stride)
    xte, yte = _pooled(model, dm.split("test"), args.probe_chunks, cfg.stride)
    scaler = StandardScaler().fit(xtr)
    clf = LogisticRegression(C=args.probe_c, max_iter=500).fit(scaler.transform(xtr), ytr)
    proba = clf.predict_proba(scaler.transform(xte))
    top = clf.classes_[np.argsort(-proba, axis=1)[:, :10]]
    hit = np.array([y in t for y, t in zip(yte, top)])
    per_class = [hit[yte == c].mean() for c in np.unique(yte)]
    return {"top10": float(hit.mean()), "balanced": float(np.mean(per_class)), "chance": 10 / len(dm.vocab),
            "seconds": time.time() - start, "train_words": int(len(ytr)), "test_words": int(len(yte))}


def _key(args, *parts) -> str:
    key = "|".join(str(p) for p in parts) + f"|pe{args.pretrain_epochs}"
    if parts[0] == "ft":
        key += f"|f{args.label_fraction}|{args.protocol}"
        key += (f"|C{args.probe_c}|k{args.probe_chunks}" if args.protocol == "linear"
                else f"|fe{args.finetune_epochs}")
    return key


def _inits(args):
    return INITS + (("signal",) if args.protocol == "linear" else ())


def run_all(args, cache) -> None:
    for context in args.contexts:
        for seed in args.seeds:
            ckpts = {}
            for kind in PRE:
                key = _key(args, "pre", context, kind, seed)
                if key not in cache["runs"] or not Path(cache["runs"][key]["ckpt"]).is_file():
                    cache["runs"][key] = pretrain(args, context, kind, seed)
                    save_json(args.cache, cache)
                ckpts[kind] = cache["runs"][key]["ckpt"]
                print(f"[meg_context] pre {context} {kind} seed {seed}: {cache['runs'][key]}", flush=True)
            for fraction in args.label_fractions:
                args.label_fraction = fraction
                for init in _inits(args):
                    key = _key(args, "ft", context, init, seed)
                    if key not in cache["runs"]:
                        fn = linear_probe if args.protocol == "linear" else finetune
                        cache["runs"][key] = fn(args, context, init, seed, ckpts.get(init))
                        save_json(args.cache, cache)
                    print(f"[meg_context] ft {context} {init} seed {seed} labels {fraction}: {cache['runs'][key]}",
                          flush=True)


def _values(args, cache, context, init, field) -> List[float]:
    out = []
    for s in args.seeds:
        run = cache["runs"].get(_key(args, "ft", context, init, s))
        if run:
            out.append(run[field])
    return out


def _fmt(values: List[float]) -> str:
    return mean_sd(values).text(3) if values else "-"


def _protocol_text(args) -> str:
    if args.protocol == "linear":
        return (f"a logistic-regression probe (C={args.probe_c}) on frozen features pooled in {args.probe_chunks} "
                "parts per word window")
    return f"{args.protocol} ({args.finetune_epochs} epochs)"


def report(args, cache) -> str:
    lines = [f"`python -m bench.meg_context --seeds {' '.join(map(str, args.seeds))}`: pre-training "
             f"{args.pretrain_epochs} epochs; word decoding by {_protocol_text(args)}, trained on a fraction of the "
             "labelled training samples of subjects 05-06 and scored on their test split (200 words); mean ± sd "
             "over seeds; top-10 accuracy among the 40-word vocabulary (chance 0.25).", ""]
    for fraction in args.label_fractions:
        args.label_fraction = fraction
        lines += [f"Labels: {fraction:.0%} of the training samples.", "",
                  "| slow context process | pre-training | top-10 acc | balanced top-10 | per seed |",
                  "|---|---|---|---|---|"]
        for context in args.contexts:
            for init in _inits(args):
                top = _values(args, cache, context, init, "top10")
                bal = _values(args, cache, context, init, "balanced")
                lines.append(f"| {context} | {LABELS[init]} | {_fmt(top)} | {_fmt(bal)} | "
                             f"{', '.join(f'{v:.3f}' for v in top)} |")
        lines.append("")
    lines.append("")
    pre_rows = []
    for context in args.contexts:
        for kind in PRE:
            runs = [cache["runs"].get(_key(args, "pre", context, kind, s)) for s in args.seeds]
            runs = [r for r in runs if r]
            if runs:
                accs = [r["val_acc"] for r in runs if r.get("val_acc") is not None]
                secs = statistics.mean(r["seconds"] for r in runs)
                pre_rows.append(f"| {context} | {kind} | {_fmt(accs)} | {runs[0]['steps']} | {secs:.0f} s |")
    if pre_rows:
        lines += ["Pre-training (masked-code accuracy on the held-out subject 04, 4 levels x 64 codes; chance ~0.016):",
                  "", "| slow context process | context | val masked acc | steps | time per run |",
                  "|---|---|---|---|---|", *pre_rows, ""]
    return "\n".join(lines)


def plot(args, cache) -> None:
    plt = pyplot()
    if plt is None:
        return
    fractions = args.label_fractions
    fig, axes = plt.subplots(len(fractions), len(args.contexts), figsize=(4.5 * len(args.contexts),
                                                                         3.4 * len(fractions)),
                             sharey=True, squeeze=False)
    for ax, (fraction, context) in zip(axes.flat, [(f, c) for f in fractions for c in args.contexts]):
        args.label_fraction = fraction
        inits = _inits(args)
        for i, init in enumerate(inits):
            vals = _values(args, cache, context, init, "top10")
            if vals:
                ax.bar(i, statistics.mean(vals), color=["C0", "C1", "C7", "C2"][i], alpha=0.7)
                ax.scatter([i] * len(vals), vals, color="k", s=12, zorder=3)
        ax.axhline(0.25, color="grey", ls="--", lw=1, label="chance")
        ax.set_xticks(range(len(inits)), ["long\n150 s", "short\n5 s", "random", "signal"][:len(inits)])
        ax.set_title(f"context process {context}, {fraction:.0%} labels")
        ax.set_ylabel("test top-10 accuracy")
        ax.legend(loc="lower right")
    fig.suptitle("MEG word decoding: linear probe on frozen backbones (synthetic study)")
    fig.tight_layout()
    save_figure(fig, args.figure)


def main(argv=None) -> int:
    args = parse_args(argv)
    cache = load_cache(args.cache)
    if not args.report_only:
        run_all(args, cache)
    body = report(args, cache)
    print(body)
    write_section("meg_context", body + "\n![MEG context](figures/meg_context.png)",
                  "MEG-XL: long-context pre-training and word decoding", args.results)
    plot(args, cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
