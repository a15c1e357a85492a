"""MEG-XL's claim at CPU scale: does long-context pre-training help word decoding with scarce labels?

For the claim study (``STUDY``: the main job's synthetic study with its topic tied to source 0's slow state,
``topic_source: 0``) with its slow process **on** and **off** (``synthetic.context`` and ``synthetic.slow_states``
together), and for each seed:

1. pre-train two backbones from the same starting point (:func:`initial_weights`: one tokenizer fitted on the long
   run's training windows, one random backbone) for about the same number of optimizer steps and tokens:
   **long** (150-s contexts, batch 1) and **short** (6-s contexts, batch 25), both with MEG-XL's 3-s masked
   blocks; then **gate (a)**: both scored on the same masked tokens of the fine-tuning subjects' 150-s windows,
   the long model seeing the whole window, the short one 6-s chunks (:meth:`MEGXLPretrainModule.masked_ce`);
   ``--pretrain-only`` stops there;
2. train word decoding on held-out subjects (05, 06) with each fraction of ``--label-fractions`` of the labelled
   training samples, on the long backbone, the short backbone and a **scratch** (random) one, with identical
   settings: ``--protocol linear`` (default; the research note's test) fits a multinomial logistic regression
   (scikit-learn, to convergence) on the frozen backbone's pooled word features; ``probe`` trains the recipe's
   MLP head on a frozen backbone by SGD; ``finetune`` trains everything (backbone at 0.3x the head's rate).
   The same linear probe on the preprocessed signal itself (no network) is reported as a reference;
3. record test top-10 accuracy (among the 50 most frequent words; the synthetic vocabulary has 40, so chance is
   10/40 = 0.25) and its class-balanced version.

Runs are cached in ``results/meg_context.json`` (a rerun skips finished runs); the table goes into
``docs/results.md`` and the figure into ``docs/figures/meg_context.png``.

    python -m bench.meg_context                      # 3 seeds, context on and off (about 60 min on 2 cores)
    python -m bench.meg_context --seeds 0 --report-only

**Oracle** (``--oracle``; no pre-training): how much a masked 3-s block's level-0 code can be predicted from the
same channel's +-1 s (short), from a histogram of its codes over the 150-s window (long) and from both, by
:func:`lightning_modules.meg.oracle.code_oracle` (multinomial logistic regression, fitted on the training subjects
01-03 and scored on the held-out subject 04), for each tokenizer setting of ``--oracle-settings`` (levels x codes,
fitted as ``MEGXLPretrainModule.fit_tokenizer`` does) and the synthetic study's slow states on and off; the table
(nats below the marginal) goes into ``docs/results.md``, the numbers into ``results/meg_oracle.json``.

    python -m bench.meg_context --oracle             # 4 settings x slow states on/off (a few minutes on 2 cores)
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
       "short": {"context_s": 6.0, "stride_s": 0.6, "batch_size": 25, "mask_s": 3.0}}
"""The two pre-training contexts: the same tokens per step (150 s) and about the same steps per epoch; the short
one is two 3-s sub-segments with MEG-XL's 3-s block, so it is scored on exactly the chunks it was trained on."""
SHORT_EVAL_S = 6.0
"""Gate (a) scores the short model on 6-s chunks (2 sub-segments) of the 150-s evaluation windows."""
STUDY = {"subjects": 6, "duration_s": 600.0, "topic_source": 0}
"""The claim study (issue 56): the main job's synthetic study with the topic tied to source 0's slow state, so the
words depend on a latent that tens of seconds of signal reveal (``SyntheticMEGConfig.topic_source``)."""
LABELS = {"long": "long (150 s)", "short": "short (6 s)", "random": "none (random backbone)",
          "scratch": "none, every weight at the full rate (supervised from scratch)",
          "signal": "no network (the signal itself)"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--contexts", nargs="+", default=["on", "off"], choices=["on", "off"])
    p.add_argument("--pretrain-epochs", type=int, default=4)
    p.add_argument("--finetune-steps", type=int, default=300,
                   help="optimizer steps of every fine-tuning run, whatever its label budget")
    p.add_argument("--val-every-steps", type=int, default=25,
                   help="validate about this often (whole epochs); the best checkpoint by validation top-10 is tested")
    p.add_argument("--label-fractions", type=float, nargs="+", default=[0.1, 0.25, 1.0],
                   help="fractions of the labelled training samples (each gets its own table)")
    p.add_argument("--protocol", default="finetune", choices=["finetune", "linear", "probe"])
    p.add_argument("--probe-c", type=float, default=0.01, help="inverse L2 strength of the linear probe")
    p.add_argument("--probe-chunks", type=int, default=12,
                   help="the probe pools each 3-s word window in this many parts (12: about one token each)")
    p.add_argument("--runs-root", type=Path, default=REPO / "runs" / "bench-meg")
    p.add_argument("--cache", type=Path, default=REPO / "results" / "meg_context.json")
    p.add_argument("--results", type=Path, default=REPO / "docs" / "results.md")
    p.add_argument("--figure", type=Path, default=REPO / "docs" / "figures" / "meg_context.png")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--oracle", action="store_true",
                   help="run only the code oracle (no pre-training) and write its section of docs/results.md")
    p.add_argument("--oracle-settings", nargs="+", default=["1x16", "2x16", "2x32", "4x64"],
                   help="tokenizer settings LEVELSxCODES for the oracle")
    p.add_argument("--oracle-states", nargs="+", default=["on", "off"], choices=["on", "off"],
                   help="the synthetic study's slow states (synthetic.slow_states) for the oracle")
    p.add_argument("--oracle-cache", type=Path, default=REPO / "results" / "meg_oracle.json")
    p.add_argument("--pretrain-only", action="store_true",
                   help="pre-train and measure gate (a) only (no word decoding)")
    p.add_argument("--gate-b", action="store_true",
                   help="run only gate (b): word decoding from the signal alone vs with the true latent topic")
    p.add_argument("--cache-dir", default=None,
                   help="data cache (the synthetic study and its preprocessed arrays); default $LITCTX_CACHE_DIR")
    return p.parse_args(argv)


def study(context: str) -> Dict[str, object]:
    """The claim study with the slow process ``on`` (the topic process and the per-source slow states, the topic
    being source 0's state) or ``off``."""
    on = context == "on"
    return {**STUDY, "context": on, "slow_states": on}


def _common(args, context: str, seed: int) -> List[str]:
    synth = json.dumps(study(context))
    return [f"seed={seed}", f"data.args.seed={seed}", f"data.args.synthetic={synth}", "logging.progress=none",
            "logging.tensorboard=false", "trainer.extra.enable_model_summary=false", "then.recipe=null", "resume=auto"]


def _pre_overrides(args, context: str, kind: str, seed: int) -> List[str]:
    p = PRE[kind]
    return _common(args, context, seed) + [
        f"data.args.context_s={p['context_s']}", f"data.args.stride_s={p['stride_s']}",
        f"data.args.batch_size={p['batch_size']}", f"method.args.mask_s={p['mask_s']}",
        f"trainer.max_epochs={args.pretrain_epochs}", "stages=[fit]", "method.args.eval_short_context_s=null"]


def initial_weights(args, context: str, seed: int) -> Path:
    """The starting point both pre-training runs of a seed load (``init_from``): the tokenizer fitted, and the
    training codes counted, on the long run's training windows, and the seed's random backbone; so the two runs
    predict the same codes (one tokenizer) from the same initial weights, and only their context differs."""
    import torch

    from recipes.api import build

    path = args.runs_root / f"init-{context}-s{seed}.pt"
    if not path.is_file():
        run = build("meg_xl", _pre_overrides(args, context, "long", seed) + [f"run_dir={path.with_suffix('')}"],
                    write=False)
        run.datamodule.setup("fit")
        run.model.prepare_from_datamodule(run.datamodule)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(run.model.state_dict(), tmp)
        tmp.replace(path)
    return path


def pretrain(args, context: str, kind: str, seed: int) -> Dict[str, object]:
    from recipes.api import build
    from recipes.fit import run_stages

    run_dir = args.runs_root / f"pre-{context}-{kind}-s{seed}"
    overrides = _pre_overrides(args, context, kind, seed) + [
        f"run_dir={run_dir}", f"init_from={initial_weights(args, context, seed)}"]
    start = time.time()
    run = build("meg_xl", overrides)
    run_stages(run)
    best = run.checkpoint_path("best")
    score = run.trainer.checkpoint_callback.best_model_score  # the recipe's monitor: val/loss
    last = {k: float(v) for k, v in run.trainer.callback_metrics.items() if k in ("val/loss", "val/loss_gap")}
    return {"ckpt": best, "val_loss": float(score) if score is not None else None,
            "val_loss_gap": last.get("val/loss_gap"), "seconds": time.time() - start,
            "steps": int(run.trainer.global_step)}


def gate_a_windows(args, context: str):
    """The evaluation windows of gate (a): non-overlapping 150-s windows of the fine-tuning subjects 05-06 (no
    pre-training run trained on or selected its checkpoint with them)."""
    from datamodules.meg import MEGDataConfig, MEGDataModule

    dm = MEGDataModule(MEGDataConfig(task="pretrain", sfreq=50.0, context_s=150.0, holdout="none", val_fraction=0.0,
                                     test_fraction=0.0, synthetic_subjects=["05", "06"], cache_dir=args.cache_dir,
                                     synthetic=study(context)))
    dm.setup("fit")
    return dm.split("train")


def gate_a_scores(args, context: str, seed: int, ckpts: Dict[str, str], windows) -> Dict[str, float]:
    """Masked-code cross-entropy on the same masked tokens of ``windows`` (one tokenizer per seed): the long model
    with its 150 s, the short one on 6-s chunks (its training context), the long one on 6-s chunks too, and the
    untrained starting point; ``gate_a`` = short - long (> 0: the long pre-training predicts better)."""
    from lightning_modules.io import load_weights
    from lightning_modules.meg.module import MEGXLPretrainModule
    from recipes.config import load_config

    cfg = load_config("meg_xl", _pre_overrides(args, context, "long", seed)).run.method.args
    start = time.time()

    def model(path):
        m = MEGXLPretrainModule(cfg)
        load_weights(m, path, strict=path.endswith(".ckpt"), prefixes=None if path.endswith(".ckpt") else
                     m.init_prefixes)
        return m

    long_, short = model(ckpts["long"]), model(ckpts["short"])
    out = {"long": long_.masked_ce(windows)["ce"], "short": short.masked_ce(windows, SHORT_EVAL_S)["ce"],
           "long_chunked": long_.masked_ce(windows, SHORT_EVAL_S)["ce"]}
    init = model(str(initial_weights(args, context, seed))).masked_ce(windows)
    out.update(initial=init["ce"], marginal=init["marginal"], tokens=init["tokens"])
    out["gate_a"] = out["short"] - out["long"]
    out["seconds"] = time.time() - start
    return out


def finetune(args, context: str, init: str, seed: int, ckpt: str) -> Dict[str, object]:
    """Word decoding by the fine-tuning recipe from ``ckpt`` (a pre-trained checkpoint, or the seed's initial
    weights for ``random`` and ``scratch``), on ``args.label_fraction`` of the labelled training samples, for
    ``--finetune-steps`` optimizer steps whatever the budget, validating about every ``--val-every-steps`` steps; the
    test split is scored with the best checkpoint by validation top-10 (the recipe's monitor). ``scratch`` trains
    every parameter at the full rate (a supervised decoder), the others the backbone at the recipe's 0.3x (``probe``:
    frozen). Returns the test metrics, the best and last validation top-10 and every test word's hit."""
    import math

    from recipes.api import build
    from recipes.fit import run_stages

    dm, _ = _word_data(args, context, seed)
    batches = len(dm.split("train"))
    run_dir = args.runs_root / f"{args.protocol}-{context}-{init}-s{seed}-f{args.label_fraction}"
    overrides = _common(args, context, seed) + [
        f"data.args.train_fraction={args.label_fraction}", f"trainer.max_steps={args.finetune_steps}",
        "trainer.max_epochs=null",
        f"trainer.check_val_every_n_epoch={max(1, math.ceil(args.val_every_steps / batches))}",
        f"run_dir={run_dir}", "~callbacks.report", f"init_from={ckpt}"]
    if args.protocol == "probe":
        overrides.append("optim.lr_scale={backbone: 0.0}")  # a frozen backbone
    elif init == "scratch":  # from scratch: one learning rate for everything ("{}" would merge into the recipe's)
        overrides.append("optim.lr_scale={backbone: 1.0}")
    start = time.time()
    run = build("meg_xl_finetune", overrides)
    metrics = run_stages(run)  # fit, then test on the best checkpoint by val/top10_acc (its weights stay loaded)
    hits, _ = run.model.word_hits(run.datamodule.split("test"))
    curve = _val_curve(run.run_dir / "logs" / "metrics.csv")
    return {"top10": float(metrics["test/top10_acc"]), "balanced": float(metrics["test/top10_balanced"]),
            "chance": float(metrics["test/top10_chance"]), "seconds": time.time() - start,
            "steps": int(run.trainer.global_step), "train_samples": batches, "val_curve": curve,
            "val_best": max((v for _, v in curve), default=None), "val_last": curve[-1][1] if curve else None,
            "hits": [int(h) for h in hits]}


def _val_curve(path: Path) -> List[List[float]]:
    """``[[step, val top-10], ...]`` from a run's CSV log (empty when it has none)."""
    import csv

    if not path.is_file():
        return []
    with path.open() as f:
        return [[int(r["step"]), float(r["val/top10_acc"])] for r in csv.DictReader(f) if r.get("val/top10_acc")]


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
        load_weights(model, ckpt, strict=True, prefixes=model.init_prefixes)  # random: the seed's initial weights
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
    # v3: the claim study (topic_source), one tokenizer and initial weights per seed, 6-s short context
    key = "|".join(str(p) for p in parts) + f"|pe{args.pretrain_epochs}|v3"
    if parts[0] == "ft":
        key += f"|f{args.label_fraction}|{args.protocol}"
        key += (f"|C{args.probe_c}|k{args.probe_chunks}" if args.protocol == "linear"
                else f"|st{args.finetune_steps}|ve{args.val_every_steps}")
    return key


def _inits(args):
    """The arms of a protocol: both pre-trained backbones and the seed's random initial weights; fine-tuning adds
    supervised training from scratch, the linear probe the signal itself."""
    return ("long", "short", "random") + {"finetune": ("scratch",), "linear": ("signal",)}.get(args.protocol, ())


def run_all(args, cache) -> None:
    windows_of: Dict[str, object] = {}
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
            key = _key(args, "gate_a", context, seed)
            if key not in cache["runs"]:
                if context not in windows_of:
                    windows_of[context] = gate_a_windows(args, context)
                cache["runs"][key] = gate_a_scores(args, context, seed, ckpts, windows_of[context])
                save_json(args.cache, cache)
            print(f"[meg_context] gate (a) {context} seed {seed}: {cache['runs'][key]}", flush=True)
            for fraction in ([] if args.pretrain_only else args.label_fractions):
                args.label_fraction = fraction
                for init in _inits(args):
                    key = _key(args, "ft", context, init, seed)
                    if key not in cache["runs"]:
                        fn = linear_probe if args.protocol == "linear" else finetune
                        source = ckpts.get(init) or str(initial_weights(args, context, seed))
                        cache["runs"][key] = fn(args, context, init, seed, None if init == "signal" else source)
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
    return (f"{args.protocol} ({args.finetune_steps} steps, the best checkpoint by validation top-10 tested; the "
            "backbone at 0.3x the head's rate, every weight at the full rate for scratch)")


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
                losses = [r["val_loss"] for r in runs if r.get("val_loss") is not None]
                gaps = [r["val_loss_gap"] for r in runs if r.get("val_loss_gap") is not None]
                secs = statistics.mean(r["seconds"] for r in runs)
                pre_rows.append(f"| {context} | {kind} | {_fmt(losses)} | {_fmt(gaps)} | {runs[0]['steps']} | "
                                f"{secs:.0f} s |")
    if pre_rows:
        lines += ["Pre-training (the recipe's 2 levels x 32 codes; held-out subject 04): best validation masked-code "
                  "cross-entropy, and the last validation's nats below the training code marginals:",
                  "", "| slow context | context | best val CE (nats) | nats below the marginals | steps | "
                  "time per run |", "|---|---|---|---|---|---|", *pre_rows, ""]
    lines += _gate_a_rows(args, cache)
    lines += _paired(args, cache)
    return "\n".join(lines)


def _gate_a_rows(args, cache) -> List[str]:
    """Gate (a): short minus long masked-code cross-entropy per seed, on the same masked tokens."""
    from litctx_common.stats import t_interval

    rows = []
    for context in args.contexts:
        runs = {s: cache["runs"].get(_key(args, "gate_a", context, s)) for s in args.seeds}
        runs = {s: r for s, r in runs.items() if r}
        if not runs:
            continue
        gaps = [r["gate_a"] for r in runs.values()]
        ci = t_interval(gaps) if len(gaps) >= 2 else None
        col = lambda f: _fmt([r[f] for r in runs.values()])  # noqa: E731
        rows.append(f"| {context} | {col('marginal')} | {col('initial')} | {col('long')} | {col('long_chunked')} | "
                    f"{col('short')} | {_fmt(gaps)} | " + (f"[{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "-") + " | "
                    + ", ".join(f"{g:+.3f}" for g in gaps) + " |")
    if not rows:
        return []
    return ["Gate (a): masked-code cross-entropy (nats per masked token, mean over levels) on the same masked tokens "
            "of the fine-tuning subjects' 150-s windows (05-06; no run trained on or was selected on them), one "
            "tokenizer and one initial backbone per seed: the long model with its 150 s, the long and the short model "
            f"on {SHORT_EVAL_S:g}-s chunks. Gate: short - long >= 0.03 with the slow process on, ~0 off.", "",
            "| slow process | marginals | initial weights | long (150 s) | long on 6-s chunks | short (6 s) | "
            "short - long | 95% interval | per seed |", "|---|---|---|---|---|---|---|---|---|", *rows, ""]


def _paired(args, cache) -> List[str]:
    """Long minus short backbone, paired by seed, per label fraction and context setting: mean, sd and a 95%
    t-interval (the acceptance test of the issue: long > short at 25% labels with the context on, and the gap
    closing with it off)."""
    from litctx_common.stats import t_interval

    rows = []
    for fraction in args.label_fractions:
        args.label_fraction = fraction
        for context in args.contexts:
            long_, short = {}, {}
            for s in args.seeds:
                a = cache["runs"].get(_key(args, "ft", context, "long", s))
                b = cache["runs"].get(_key(args, "ft", context, "short", s))
                if a and b:
                    long_[s], short[s] = a["top10"], b["top10"]
            diffs = [long_[s] - short[s] for s in long_]
            if len(diffs) >= 2:
                m, sd = statistics.mean(diffs), statistics.stdev(diffs)
                lo, hi = t_interval(diffs)
                rows.append(f"| {fraction:.0%} | {context} | {m:+.3f} | {sd:.3f} | [{lo:+.3f}, {hi:+.3f}] | "
                            f"{', '.join(f'{d:+.3f}' for d in diffs)} |")
    if not rows:
        return []
    return ["Long minus short backbone (top-10, paired by seed; 95% t-interval over seeds):", "",
            "| labels | slow context | mean | sd | 95% interval | per seed |", "|---|---|---|---|---|---|", *rows, ""]


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
        ax.set_xticks(range(len(inits)), ["long\n150 s", "short\n6 s", "random", "signal"][:len(inits)])
        ax.set_title(f"context process {context}, {fraction:.0%} labels")
        ax.set_ylabel("test top-10 accuracy")
        ax.legend(loc="lower right")
    fig.suptitle("MEG word decoding: linear probe on frozen backbones (synthetic study)")
    fig.tight_layout()
    save_figure(fig, args.figure)


# ---------------------------------------------------------------------------------------------- gate (b)
GATE_B_L2 = 0.1
"""The word-state probe's L2 (both arms): at 1e-2 the per-state corrections overfit on a first study draw
(window + state below the window alone), so it was raised once, before the claim study's gate was measured."""


def gate_b_datamodule(context: str, cache_dir=None):
    """Word windows of every subject of the claim study (each recording cut in time: 80% train, 10% val, 10% test),
    with the slow process ``on`` or ``off``."""
    from datamodules.meg import MEGDataConfig, MEGDataModule

    on = context == "on"
    dm = MEGDataModule(MEGDataConfig(task="words", sfreq=50.0, holdout="none", val_fraction=0.1, test_fraction=0.1,
                                     synthetic_subjects=[f"{s:02d}" for s in range(1, STUDY["subjects"] + 1)],
                                     cache_dir=cache_dir, synthetic={**STUDY, "context": on, "slow_states": on}))
    dm.setup("fit")
    return dm


def word_topics(dataset) -> List[int]:
    """The true topic at every word onset of a :class:`datamodules.meg.WordSamples` split, in its order (from the
    synthetic recordings' ``_topics.tsv``)."""
    from datamodules.synth.meg import read_topics, topic_at

    timelines: Dict[int, list] = {}
    out = []
    for r, onsets, _ in dataset.groups:
        rec = dataset.recordings[r]
        if r not in timelines:
            timelines[r] = read_topics(rec.path)
        out += [topic_at(timelines[r], s / rec.sfreq) for s in onsets]
    return out


def gate_b_run(dm, chunks: int) -> Dict[str, object]:
    """:func:`lightning_modules.meg.oracle.word_state_probe` on the preprocessed signal pooled in ``chunks`` parts
    of each word window, with the true topic as the latent state (train -> test)."""
    import numpy as np

    from datamodules.synth.meg import SyntheticMEGConfig
    from lightning_modules.meg.oracle import word_state_probe

    start = time.time()
    sets = []
    for name in ("train", "test"):
        x, y = _pooled(None, dm.split(name), chunks, 1)
        sets.append((x, y, np.asarray(word_topics(dm.split(name)))))
    topics = SyntheticMEGConfig(**dm.cfg.synthetic).topics
    result = word_state_probe(sets[0], sets[1], len(dm.vocab), topics, k=10, l2=GATE_B_L2)
    return {**result.as_dict(), "chunks": chunks, "seconds": time.time() - start}


def _gate_b_key(context: str, chunks: int) -> str:
    from datamodules.synth.meg import SyntheticMEGConfig

    on = context == "on"
    study = SyntheticMEGConfig(**{**STUDY, "context": on, "slow_states": on}).fingerprint()
    return f"gate_b|{study}|l2{GATE_B_L2}|k{chunks}|context-{context}"


def gate_b_all(args) -> dict:
    cache = load_cache(args.oracle_cache)
    for context in args.contexts:
        key = _gate_b_key(context, args.probe_chunks)
        if key not in cache["runs"]:
            cache["runs"][key] = gate_b_run(gate_b_datamodule(context, args.cache_dir), args.probe_chunks)
            save_json(args.oracle_cache, cache)
        r = cache["runs"][key]
        print(f"[meg_context] gate (b) context {context}: window {r['window']:.3f}, window + topic "
              f"{r['window_state']:.3f} ({r['gain']:+.3f}; {r['seconds']:.0f} s)", flush=True)
    return cache


def gate_b_report(args, cache) -> str:
    lines = [f"`python -m bench.meg_context --gate-b`: can context help word decoding at all? Top-10 accuracy on the "
             "held-out words (10% of every recording, in time) of the claim study (`STUDY`: 6 subjects x 600 s, "
             f"`topic_source: 0`) by a multinomial logistic regression (L2 {GATE_B_L2}, L-BFGS) on the preprocessed "
             f"signal of each word's 3-s window pooled in {args.probe_chunks} parts, alone (**window**) and with the "
             "true latent topic at the word (**window + topic**: shared weights plus a correction and a word prior "
             "per topic; `lightning_modules/meg/oracle.py: word_state_probe`). No network. Gate (b) of issue 56: "
             "window + topic beats window by >= 0.05 with the slow process on.", "",
             "| slow process | train words | test words | window | window + topic | gain | gate (b) | time |",
             "|---|---|---|---|---|---|---|---|"]
    for context in args.contexts:
        r = cache["runs"].get(_gate_b_key(context, args.probe_chunks))
        if r:
            gate = ("passes" if r["gain"] >= 0.05 else "fails") if context == "on" else "(control)"
            lines.append(f"| {context} | {r['train_words']} | {r['test_words']} | {r['window']:.3f} | "
                         f"{r['window_state']:.3f} | {r['gain']:+.3f} | {gate} | {r['seconds']:.0f} s |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- the oracle
ORACLE_SYNTH = STUDY
"""The claim study (also the main job's, ``configs/recipes/meg_xl.yaml``); ``slow_states`` is set per arm (off: the
topics switch on their own, ``topic_source`` needs the slow states)."""


def _settings(args) -> List[tuple]:
    out = []
    for text in args.oracle_settings:
        try:
            levels, codes = (int(v) for v in text.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--oracle-settings {text!r}: expected LEVELSxCODES, e.g. 2x16") from None
        out.append((levels, codes))
    return out


def oracle_datamodule(states: str, cache_dir=None):
    """The main job's pre-training data (50 Hz, 150-s windows; subjects 01-03 train, 04 held out), with
    non-overlapping training windows, for the synthetic study with slow states ``on`` or ``off``."""
    from datamodules.meg import MEGDataConfig, MEGDataModule

    dm = MEGDataModule(MEGDataConfig(task="pretrain", sfreq=50.0, context_s=150.0, holdout="last", test_fraction=0.0,
                                     synthetic_subjects=["01", "02", "03", "04"], cache_dir=cache_dir,
                                     synthetic={**ORACLE_SYNTH, "slow_states": states == "on"}))
    dm.setup("fit")
    return dm


def oracle_run(dm, levels: int, codes: int) -> Dict[str, object]:
    """Fit the tokenizer as the pre-training module does and run :func:`code_oracle` (train -> val)."""
    from lightning_modules.meg.module import MEGXLPretrainModule
    from lightning_modules.meg.oracle import OracleConfig, code_oracle

    start = time.time()
    model = MEGXLPretrainModule({"sfreq": dm.cfg.sfreq, "levels": levels, "codes": codes})
    model.fit_tokenizer(dm)
    fitted = time.time() - start
    result = code_oracle(dm.split("train"), dm.split("val"), model.tokenizer, OracleConfig(sfreq=dm.cfg.sfreq))
    return {**result.as_dict(), "tokenizer_seconds": fitted, "seconds": time.time() - start}


def _oracle_key(states: str, levels: int, codes: int) -> str:
    """The cache key: the synthetic study's fingerprint (so a change of its physics reruns), the oracle's
    settings, the slow states and the tokenizer setting."""
    import hashlib

    from datamodules.synth.meg import SyntheticMEGConfig
    from lightning_modules.meg.oracle import OracleConfig

    study = SyntheticMEGConfig(**ORACLE_SYNTH, slow_states=states == "on").fingerprint()
    oracle = hashlib.sha1(repr(OracleConfig()).encode()).hexdigest()[:8]
    return f"oracle|{study}|{oracle}|states-{states}|{levels}x{codes}"


def oracle_all(args) -> dict:
    cache = load_cache(args.oracle_cache)
    for states in args.oracle_states:
        dm = None
        for levels, codes in _settings(args):
            key = _oracle_key(states, levels, codes)
            if key not in cache["runs"]:
                dm = dm or oracle_datamodule(states, args.cache_dir)
                cache["runs"][key] = oracle_run(dm, levels, codes)
                save_json(args.oracle_cache, cache)
            r = cache["runs"][key]
            print(f"[meg_context] oracle slow states {states} {levels}x{codes}: marginal {r['marginal']:.3f}, gains "
                  + ", ".join(f"{k} {v:+.3f}" for k, v in r["gain"].items()) + f" ({r['seconds']:.0f} s)", flush=True)
    return cache


def oracle_report(args, cache) -> str:
    cmd = "python -m bench.meg_context --oracle" + (
        f" --oracle-settings {' '.join(args.oracle_settings)}" if args.oracle_settings != parse_args([]).oracle_settings
        else "")
    lines = [f"`{cmd}`: a masked 3-s block's level-0 code (the 12 tokens of one 3-s sub-segment of a 150-s window, "
             "one channel) predicted from that channel's codes in +-1 s around the block (**short**, 4 tokens each "
             "side, one-hot per position), from the histogram of its codes over the rest of the 150-s window "
             "(**long**, as log frequencies), and from **both**; multinomial logistic regression "
             "(`lightning_modules/meg/oracle.py`: "
             "standardised features, L2 1e-3, L-BFGS to convergence) fitted on subjects 01-03 and scored on the "
             "held-out subject 04 of the claim study (`STUDY`: 6 subjects x 600 s, `topic_source: 0`; 50 Hz). "
             "Gains are nats per masked token below the marginal (the training codes' frequencies); the tokenizer is "
             "fitted as `MEGXLPretrainModule.fit_tokenizer` does. Acceptance (issue 23, default study): short >= 0.15 "
             "and long >= short + 0.05.", "",
             "| slow states | tokenizer (levels x codes) | marginal CE | short gain | long gain | both gain | "
             "long - short | time |", "|---|---|---|---|---|---|---|---|"]
    for states in args.oracle_states:
        for levels, codes in _settings(args):
            r = cache["runs"].get(_oracle_key(states, levels, codes))
            if not r:
                continue
            g = r["gain"]
            lines.append(f"| {states} | {levels} x {codes} | {r['marginal']:.3f} | {g['short']:+.3f} | "
                         f"{g['long']:+.3f} | {g['both']:+.3f} | {g['long'] - g['short']:+.3f} | "
                         f"{r['seconds']:.0f} s |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    studies = {"gate_b": (gate_b_all, gate_b_report, "meg_gate_b",
                          "MEG-XL: does the latent topic help word decoding? (gate b)"),
               "oracle": (oracle_all, oracle_report, "meg_oracle",
                          "MEG-XL: how predictable are the masked codes? (code oracle)")}
    for flag, (run, write, section, heading) in studies.items():
        if getattr(args, flag):  # a study without pre-training: its own cache and section
            body = write(args, run(args))
            print(body)
            write_section(section, body, heading, args.results)
            return 0
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
