"""Continued pretraining of SmolLM2-135M-Instruct, side by side at one token budget: plain (``cpt_plain``: RoPE
and dense attention unchanged), RePo (``repo_cpt``) and L2A (``l2a_cpt``), plus the pretrained model untouched
(``base``: does the task mix teach anything at all?).

    python -m bench.cpt                       # run (or continue) every arm, then the timing, then the report
    python -m bench.cpt --arms base plain     # some arms only
    python -m bench.cpt --report-only         # rewrite the docs/results.md section from the records

Every trained arm is one ``recipes.fit`` run (in its own process, ``resume=auto``: a killed arm continues from its
last checkpoint) in ``runs/bench_cpt/<arm>`` with the same data (the installed-documentation corpus and the task mix
of ``cpt_plain``), the same ``--steps`` x 2 x 512 tokens, the same seed and schedule, followed by one ``recipes.evaluate
--run`` test pass (perplexity at 512 / 1024 / 2048 tokens: 1x, 2x, 4x the training length; the long-context suite:
noisy-context ``niah_multikey`` and ``qa_facts``, structured ``table_lookup`` and ``graph_hops``, retrieval
``kv_retrieval``, at 512 and 1024 tokens). The report gives perplexities, suite accuracy per family with 95% paired
bootstrap intervals against the plain run (per sample), and for L2A the share of tokens that skip global attention per
layer, the KV bytes after pruning (``l2a_prune.json``), and (``--timing``) the training-step and prefill times of
the trained L2A model against the trained plain model, measured interleaved in one process, with the attention
pairs both compute.

Records: ``results/cpt_smollm2.json`` (one entry per arm and one for the timing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from bench._report import REPO, load_cache, pyplot, save_figure, save_json, train_loss_first_last, write_section

RESULTS = REPO / "results" / "cpt_smollm2.json"
FIGURE = REPO / "docs" / "figures" / "cpt_smollm2.png"
RUNS = REPO / "runs" / "bench_cpt"
RECIPES = {"plain": "cpt_plain", "repo": "repo_cpt", "l2a": "l2a_cpt", "base": "cpt_plain", "repo_warm": "repo_cpt"}
ARM_OVERRIDES = {
    # the second RePo attempt: the fork's anneal knob as a warm start (p = 1 -> 0 over 3/4 of the steps: training
    # starts from the base model exactly) and a 100x learning rate for the position maps, which must grow from
    # N(0, 0.02^2) weights to positions spanning the context within the budget
    "repo_warm": lambda args: [f"method.args.warm_start_steps={max(1, args.steps * 3 // 4)}",
                               "optim.lr_scale={'model.model.layers.*.self_attn.*_map': 100.0}"],
}
ARM_ORDER = ("base", "plain", "repo", "repo_warm", "l2a")
FAMILIES = {"noisy": ("niah_multikey", "qa_facts"), "structured": ("table_lookup", "graph_hops"),
            "retrieval": ("kv_retrieval",)}


def _overrides(args) -> List[str]:
    tasks = [t for fam in FAMILIES.values() for t in fam]
    return [f"data.args.train_batches={args.steps}", f"seed={args.seed}",
            f"callbacks.suite.args={{tasks: [{', '.join(tasks)}], lengths: [512, 1024], "
            f"samples_per_cell: {args.samples}}}", "trainer.accelerator=cpu"]


def _cli(module: str, argv: List[str]) -> None:
    print("[bench.cpt] python -m", module, " ".join(argv), flush=True)
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO, env=dict(os.environ))
    if proc.returncode != 0:
        raise SystemExit(f"{module} failed (exit {proc.returncode}); rerun the same command to continue")


def run_arm(arm: str, args) -> Dict[str, Any]:
    """Train (unless ``base``) and test one arm; returns its record."""
    run_dir = RUNS / arm
    if arm == "base":
        return _base(args)
    if not (run_dir / "DONE").is_file():
        extra = ARM_OVERRIDES[arm](args) if arm in ARM_OVERRIDES else []
        _cli("recipes.fit", ["--recipe", RECIPES[arm], *_overrides(args), *extra, "stages=[fit]",
                             f"run_dir={run_dir}", "resume=auto"])
    if not (run_dir / "eval" / "test-last.json").is_file():
        _cli("recipes.evaluate", ["--run", str(run_dir), "--ckpt", "last"])
    return _collect(arm, run_dir)


def _base(args) -> Dict[str, Any]:
    """The pretrained model under the same evaluation (no training)."""
    from recipes.api import build

    run_dir = RUNS / "base"
    out = run_dir / "eval" / "test-pretrained.json"
    if not out.is_file():
        run = build(RECIPES["base"], _overrides(args) + [f"run_dir={run_dir}"], stage="test")
        metrics = run.trainer.test(run.model, datamodule=run.datamodule, verbose=False)[0]
        out.parent.mkdir(parents=True, exist_ok=True)
        save_json(out, {k: float(v) for k, v in metrics.items()})
    return _collect("base", run_dir, out)


def _collect(arm: str, run_dir: Path, metrics_file: Optional[Path] = None) -> Dict[str, Any]:
    metrics = json.loads((metrics_file or run_dir / "eval" / "test-last.json").read_text())
    records = [json.loads(line) for line in (run_dir / "suite_records.jsonl").read_text().splitlines() if line.strip()]
    ckpts = {r["checkpoint"] for r in records}
    latest = [r for r in records if r["checkpoint"] == sorted(ckpts)[-1]] if len(ckpts) > 1 else records
    rec = {"arm": arm, "metrics": metrics, "suite": [{k: r[k] for k in ("id", "task", "length", "score")}
                                                     for r in latest]}
    prune = run_dir / "l2a_prune.json"
    if prune.is_file():
        rec["prune"] = json.loads(prune.read_text())
    if (run_dir / "logs" / "metrics.csv").is_file():
        rec["train_loss_first_last"] = train_loss_first_last(run_dir)
    return rec


# ---------------------------------------------------------------------------------------------- timing
def timing(args) -> Dict[str, Any]:
    """Training-step and prefill seconds of the trained L2A model against the trained plain model (interleaved
    repeats in this process; medians), and the attention query-key pairs each computes on the same input."""
    import statistics

    import torch
    import torch.nn.functional as F

    from lightning_modules.l2a.layer import l2a_layers, reset_routing_stats, routing_stats
    from lightning_modules.llm.model.loading import load_causal_lm
    from litctx_common.timing import Stopwatch

    torch.manual_seed(0)
    plain, tok = load_causal_lm(str(RUNS / "plain" / "hf"))
    l2a, _ = load_causal_lm(str(RUNS / "l2a" / "hf"), expect_surgery="l2a")
    from datamodules.corpus import corpus_documents

    text = "\n\n".join(corpus_documents("installed_docs")[-200:])
    ids_all = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out: Dict[str, Any] = {}

    def step(model, ids, trainable):
        for n, p in model.named_parameters():
            p.requires_grad_(trainable(n))
        model.train()
        logits = model(input_ids=ids, use_cache=False).logits
        F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:]).backward()
        model.zero_grad(set_to_none=True)

    l2a_train = ("self_attn", "norm", "sigmoid_linear")
    train_ids = ids_all[:, : 2 * 512].reshape(2, 512)
    arms = {"plain (all trainable)": (plain, lambda n: True),
            "plain (L2A's trainable set)": (plain, lambda n: any(t in n for t in l2a_train)),
            "l2a": (l2a, lambda n: any(t in n for t in l2a_train))}
    times: Dict[str, List[float]] = {k: [] for k in arms}
    for r in range(args.repeats + 1):
        for name, (model, trainable) in arms.items():
            watch = Stopwatch()
            with watch:
                step(model, train_ids, trainable)
            if r > 0:
                times[name].append(watch.seconds)
    out["train_step_s"] = {k: statistics.median(v) for k, v in times.items()}
    prefill: Dict[str, Dict[str, float]] = {}
    pairs: Dict[str, Dict[str, float]] = {}
    for n in args.prefill_lengths:
        ids = ids_all[:, :n]
        t = {"plain": [], "l2a": []}
        for r in range(args.repeats + 1):
            for name, model in (("plain", plain), ("l2a", l2a)):
                model.eval()
                if name == "l2a":
                    reset_routing_stats(model)
                watch = Stopwatch()
                with torch.no_grad(), watch:
                    model(input_ids=ids, use_cache=False)
                if r > 0:
                    t[name].append(watch.seconds)
        prefill[str(n)] = {k: statistics.median(v) for k, v in t.items()}
        rates = routing_stats(l2a)
        layers = l2a_layers(l2a)
        window = next(iter(layers.values())).self_attn.window
        dense_pairs = len(layers) * n * (n + 1) / 2
        local = len(layers) * sum(min(i + 1, window) for i in range(n))
        # routed tokens at position i read i + 1 keys; the routing rate is flat enough in position for the mean
        glob = sum(r * n * (n + 1) / 2 for i, r in rates.items() if layers[i].self_attn.has_global)
        pairs[str(n)] = {"dense": dense_pairs, "l2a_local": local, "l2a_global": glob,
                         "l2a_over_dense": (local + glob) / dense_pairs,
                         "route_rate_mean": sum(rates.values()) / len(rates)}
    out["prefill_s"] = prefill
    out["attention_pairs"] = pairs
    out["repeats"] = args.repeats
    return out


# ---------------------------------------------------------------------------------------------- L2A at init
def l2a_init_probe(args, batches: int = 4) -> Dict[str, Any]:
    """Test-split cross-entropy of SmolLM2 as loaded, as L2A at initialisation with every token routed (local
    and global paths both copies of the base attention, so the attention output is added twice) and with none
    routed (the window-W local path alone): what the router sees in its first steps."""
    import torch

    from lightning_modules.l2a.layer import apply_l2a
    from lightning_modules.llm.model.loading import load_causal_lm
    from recipes.api import build

    run = build(RECIPES["plain"], _overrides(args), stage="test")
    run.datamodule.setup("test")
    loader = run.datamodule.test_dataloader()
    loader = loader[0] if isinstance(loader, (list, tuple)) else loader
    data = [b["input_ids"] for _, b in zip(range(batches), loader)]
    from recipes.config import load_config

    window = int(load_config(RECIPES["l2a"], _overrides(args)).tree.method.args.l2a.window)

    def ce(model) -> float:
        total, n = 0.0, 0
        with torch.no_grad():
            for ids in data:
                logits = model(input_ids=ids).logits[:, :-1].float()
                total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                                 ids[:, 1:].reshape(-1), reduction="sum"))
                n += ids[:, 1:].numel()
        return total / n

    out: Dict[str, Any] = {"window": window, "tokens": int(sum(d[:, 1:].numel() for d in data))}
    for name, threshold in (("base", None), ("all_routed", 0.5), ("local_only", 0.6)):
        model, _ = load_causal_lm("smollm2-135m")
        if threshold is not None:  # zero-initialised routers give sigma(0) = 0.5: >= 0.5 routes all, 0.6 none
            apply_l2a(model, {"window": window, "threshold": threshold})
            model.eval()
        out[name] = {"ce": ce(model)}
        out[name]["ppl"] = math.exp(out[name]["ce"])
    return out


# ---------------------------------------------------------------------------------------------- report
def _family_scores(rec: Dict[str, Any], family: str) -> Dict[str, float]:
    return {r["id"]: float(r["score"]) for r in rec["suite"] if r["task"] in FAMILIES[family]}


def report(cache: Dict[str, Any], args) -> str:
    from lightning_modules.llm.eval.suite_metrics import paired_bootstrap

    runs = cache["runs"]
    arms = [a for a in ARM_ORDER if a in runs]
    lines = [f"`python -m bench.cpt --steps {args.steps} --samples {args.samples} --seed {args.seed}`: SmolLM2-135M-"
             f"Instruct, {args.steps} steps x 2 x 512 tokens per trained arm ({args.steps * 1024:,} tokens, one seed), "
             "the installed-documentation corpus with cpt_plain's task mix, AdamW lr 1e-4 cosine, 2 CPU cores.", "",
             "| arm | ppl @512 (1x) | ppl @1024 (2x) | ppl @2048 (4x) | " + " | ".join(
                 f"{fam} acc" for fam in FAMILIES) + " | suite acc |",
             "|---|---|---|---|" + "---|" * len(FAMILIES) + "---|"]
    for arm in arms:
        m = runs[arm]["metrics"]
        accs = []
        for fam in FAMILIES:
            s = list(_family_scores(runs[arm], fam).values())
            accs.append(f"{100 * sum(s) / len(s):.1f}% ({len(s)})" if s else "-")
        lines.append(f"| {arm} | {m.get('test/ppl_len512', float('nan')):.2f} | {m.get('test/ppl_len1024', float('nan')):.2f} | "
                     f"{m.get('test/ppl_len2048', float('nan')):.2f} | " + " | ".join(accs)
                     + f" | {100 * m.get('test/suite_acc', float('nan')):.1f}% |")
    if "plain" in runs:
        lines += ["", "Accuracy differences against the plain run (percentage points, paired by sample, 95% bootstrap "
                  "interval):", "", "| arm | " + " | ".join(FAMILIES) + " |", "|---|" + "---|" * len(FAMILIES)]
        for arm in [a for a in arms if a != "plain"]:
            cells = []
            for fam in FAMILIES:
                a, b = _family_scores(runs[arm], fam), _family_scores(runs["plain"], fam)
                ids = sorted(set(a) & set(b))
                if not ids:
                    cells.append("-")
                    continue
                d = paired_bootstrap([a[i] for i in ids], [b[i] for i in ids])
                cells.append(f"{100 * d['diff']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}] (n={len(ids)})")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        pm = runs["plain"]["metrics"].get("test/ppl_len512")
        for arm in [a for a in ARM_ORDER if a not in ("base", "plain")]:
            if arm in runs and pm:
                am = runs[arm]["metrics"].get("test/ppl_len512")
                lines.append(f"\n{arm}: perplexity at the training length {am:.2f} vs plain {pm:.2f} "
                             f"({100 * (am / pm - 1):+.1f}%).")
    if "l2a" in runs:
        m = runs["l2a"]["metrics"]
        layers = sorted(int(k.rsplit("_l", 1)[1]) for k in m if k.startswith("test/l2a_route_l"))
        skip = m.get("test/l2a_skip")
        lines += ["", f"L2A: share of tokens that skip global attention on the test text (mean over layers): "
                      f"**{100 * skip:.1f}%**." if skip is not None else ""]
        if layers:
            lines.append("Per layer (share skipping): " + ", ".join(
                f"{i}: {100 * (1 - m[f'test/l2a_route_l{i}']):.0f}%" for i in layers) + ".")
        prune = runs["l2a"].get("prune")
        if prune:
            lines.append(f"Pruning (routing rate < 1% on validation): layers {prune['pruned']} lose their global path; "
                         f"KV bytes of an {prune['tokens']}-token cache: dense {prune['kv_bytes_dense'] / 2**20:.1f} MiB, "
                         f"L2A before pruning {prune['kv_bytes_before'] / 2**20:.1f} MiB, after "
                         f"{prune['kv_bytes_after'] / 2**20:.1f} MiB ({100 * prune['saved_fraction']:.1f}% saved; "
                         f"{100 * (1 - prune['kv_bytes_after'] / prune['kv_bytes_dense']):.1f}% below dense).")
    probe = runs.get("l2a_init")
    if probe:
        lines += ["", f"L2A at initialisation (test split, {probe['tokens']:,} tokens, window {probe['window']}): "
                      f"perplexity {probe['base']['ppl']:.2f} as loaded, {probe['all_routed']['ppl']:,.0f} with every "
                      f"token routed (local and global paths both start as the base attention, so its output is added "
                      f"twice), {probe['local_only']['ppl']:.2f} with none routed (the local path alone)."]
    t = runs.get("timing")
    if t:
        ts = t["train_step_s"]
        same_set = ts["plain (L2A's trainable set)"]
        lines += ["", f"Timing (medians of {t['repeats']} interleaved repeats, 2 x 512 tokens per training step):",
                  "", "| | plain (all trainable) | plain (L2A's trainable set) | L2A |", "|---|---|---|---|",
                  f"| training step (s) | {ts['plain (all trainable)']:.2f} | {same_set:.2f} | {ts['l2a']:.2f} "
                  f"({ts['l2a'] / same_set:.2f}x) |"]
        for n, p in t["prefill_s"].items():
            pairs = t["attention_pairs"][n]
            lines.append(f"| prefill {n} tokens (s) | {p['plain']:.2f} | | {p['l2a']:.2f} "
                         f"({p['l2a'] / p['plain']:.2f}x; attention pairs {100 * pairs['l2a_over_dense']:.0f}% of dense) |")
    return "\n".join(lines)


def figure(cache: Dict[str, Any]) -> None:
    plt = pyplot()
    runs = cache["runs"]
    arms = [a for a in ARM_ORDER if a in runs]
    if plt is None or not arms:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for arm in arms:
        m = runs[arm]["metrics"]
        xs = [512, 1024, 2048]
        axes[0].plot(xs, [m.get(f"test/ppl_len{x}", math.nan) for x in xs], marker="o", label=arm)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("evaluation length (tokens; trained at 512)")
    axes[0].set_ylabel("test perplexity")
    axes[0].legend()
    width = 0.8 / len(arms)
    for k, arm in enumerate(arms):
        vals = []
        for fam in FAMILIES:
            s = list(_family_scores(runs[arm], fam).values())
            vals.append(100 * sum(s) / len(s) if s else 0)
        axes[1].bar([i + k * width for i in range(len(FAMILIES))], vals, width, label=arm)
    axes[1].set_xticks([i + 0.4 - width / 2 for i in range(len(FAMILIES))], list(FAMILIES))
    axes[1].set_ylabel("suite accuracy (%)")
    axes[1].legend()
    fig.tight_layout()
    save_figure(fig, FIGURE)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=["base", "plain", "repo", "l2a"], choices=list(RECIPES))
    parser.add_argument("--steps", type=int, default=160, help="optimiser steps per trained arm (2 x 512 tokens)")
    parser.add_argument("--samples", type=int, default=12, help="suite samples per (task, length)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats (after one warm-up)")
    parser.add_argument("--prefill-lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    cache = load_cache(RESULTS)
    if not args.report_only:
        for arm in args.arms:
            if arm not in cache["runs"]:
                cache["runs"][arm] = run_arm(arm, args)
                save_json(RESULTS, cache)
        if "l2a_init" not in cache["runs"]:
            cache["runs"]["l2a_init"] = l2a_init_probe(args)
            save_json(RESULTS, cache)
        if not args.no_timing and "timing" not in cache["runs"] and (RUNS / "l2a" / "hf").is_dir() \
                and (RUNS / "plain" / "hf").is_dir():
            cache["runs"]["timing"] = timing(args)
            save_json(RESULTS, cache)
    body = report(cache, args)
    figure(cache)
    write_section("cpt", body + f"\n\n![continued pretraining](figures/{FIGURE.name})", "Continued pretraining: "
                  "plain vs RePo vs L2A (SmolLM2-135M)")
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
