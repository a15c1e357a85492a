"""IndexMem (learned KV eviction with latent memory) against the eviction heuristics at matched memory, on the
long-context suite with SmolLM2-135M-Instruct.

    python -m bench.indexmem                      # train the bank if needed, run (or continue), write the report
    python -m bench.indexmem --report-only
    python -m bench.indexmem --samples 4 --lengths 2048 --ratios 0.9

Budgets are the *total* per-KV-head memory at compression ratio r (kvpress convention: r = 0.9 keeps 10% of the
context). IndexMem's latent memory costs 33 tokens of KV per head (``d * d + d`` floats at ``d = 64``), so its
cache keeps 33 entries fewer; every heuristic keeps the full budget in cache entries (the fair-budget rule of
``../shared/research/kv_methods.md`` section 7.4). Arms:

* ``indexmem`` - the trained indexer picks the entries, evicted ones go to the memory (cache B - 33 + memory);
* ``indexer@B-33`` - the same entries, no memory (what the memory adds); ``indexer`` - the indexer alone at B;
* ``snapkv+mem`` - SnapKV's entries (B - 33) plus the trained memory (the heuristic + memory ablation);
* ``snapkv``, ``h2o``, ``tova`` and their OBCache variants (``+obc``, the OBCache ``kv`` score) at B.

The bank is trained by ``python -m recipes.fit --recipe indexmem_smollm2`` into ``runs/bench_indexmem/train``
(``--weights`` takes another). Each sample's context is prefilled once and every arm compresses that prefill
(:func:`lightning_modules.llm.decoding.generate.record_prefill`), asks the question and decodes greedily (kvpress's
compress-then-ask protocol). One record per (sample, arm, ratio) goes to
``results/indexmem_smollm2.jsonl``, so a rerun continues. A learned arm's record names its bank (``bank``, a
hash of the weights; records without one are the session-17 bank, ``s17``); the report pools banks and shows each
one's accuracy (``--bank ID`` keeps one, ``--rerun-learned`` redoes the learned arms with this bank). Reported:
accuracy per arm x ratio x length, IndexMem minus the best heuristic per cell with a 95% paired bootstrap interval,
and the ablations.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Tuple

from bench._report import REPO, pyplot, save_figure, write_section

from litctx_common.io import append_jsonl, read_jsonl
from litctx_common.timing import clock

RESULTS = REPO / "results" / "indexmem_smollm2.jsonl"
FIGURE = REPO / "docs" / "figures" / "indexmem_smollm2.png"
TRAIN_RUN = REPO / "runs" / "bench_indexmem" / "train"
TASKS = ["niah_multikey", "kv_retrieval", "qa_facts", "variable_tracking"]
HEURISTICS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "snapkv": ("snapkv", {"window": 32}),
    "snapkv+obc": ("snapkv", {"window": 32, "score": "obcache_kv"}),
    "h2o": ("h2o", {}),
    "h2o+obc": ("h2o", {"score": "obcache_kv"}),
    "tova": ("tova", {}),
    "tova+obc": ("tova", {"score": "obcache_kv"}),
}
LEARNED = ("indexmem", "indexer@B-33", "indexer", "snapkv+mem")
LEGACY_BANK = "s17"  # learned records written before records named their bank (the session-17 training)


def bank_id(bank_dir: Path) -> str:
    """A short hash of a trained bank's weights file: a learned arm's records name the bank that produced them."""
    return hashlib.sha256((Path(bank_dir) / "indexmem.safetensors").read_bytes()).hexdigest()[:12]


def record_bank(r: Dict[str, Any]) -> str | None:
    """The bank of a learned arm's record (``None`` for heuristics and the full cache)."""
    return r.get("bank", LEGACY_BANK) if r["arm"] in LEARNED else None


def train_bank(args) -> Path:
    """The bank folder: ``--weights``, or train ``indexmem_smollm2`` into :data:`TRAIN_RUN` (resumable)."""
    if args.weights:
        return Path(args.weights)
    folder = TRAIN_RUN / "indexmem"
    if not (folder / "indexmem.safetensors").is_file():
        argv = [sys.executable, "-m", "recipes.fit", "--recipe", "indexmem_smollm2", f"run_dir={TRAIN_RUN}",
                "resume=auto", "trainer.accelerator=cpu"]
        print("[bench.indexmem]", " ".join(argv[1:]), flush=True)
        if subprocess.run(argv, cwd=REPO, env=dict(os.environ)).returncode != 0:
            raise SystemExit("training the IndexMem bank failed; rerun the same command to continue")
    return folder


def learned_policies(bank: Any, ratio: float) -> Dict[str, Any]:
    from lightning_modules.indexmem.config import IndexMemConfig

    base = IndexMemConfig(compression_ratio=ratio)
    out = {"indexmem": base.build(bank), "indexer": replace(base, memory=False).build(bank),
           "snapkv+mem": replace(base, scorer="snapkv").build(bank)}
    aux = out["indexmem"].budget.aux_tokens
    plain = replace(base, memory=False).build(bank)
    out["indexer@B-33"] = replace(plain, budget=replace(plain.budget, aux_tokens=aux), name=f"indexer@B-{aux}")
    return out


def run_suite(args, bank_dir: Path) -> None:
    import torch

    from datamodules.longctx_tasks import Haystack, build_sample
    from datamodules.text import pydoc_documents
    from lightning_modules.indexmem.bank import IndexMemBank
    from lightning_modules.kv_eviction.config import policy_grid
    from lightning_modules.llm.decoding.generate import record_prefill
    from lightning_modules.llm.decoding.stopping import stop_token_ids
    from lightning_modules.llm.model.loading import load_causal_lm
    from lightning_modules.llm.eval.suite_metrics import score_prediction

    torch.manual_seed(0)
    model, tok = load_causal_lm("smollm2-135m")
    model.requires_grad_(False)
    bank = IndexMemBank.load(bank_dir)
    bank.check_model(model)
    this_bank = bank_id(bank_dir)
    # a learned arm counts as done for a sample only with this bank; with --rerun-learned other banks' records
    # are redone, otherwise (default) a learned record of any bank stands (the report pools banks, marked)
    done = {(r["id"], r["arm"], r["ratio"]) for r in read_jsonl(RESULTS)
            if not (args.rerun_learned and record_bank(r) not in (None, this_bank))}
    haystack = Haystack(pydoc_documents(), tok)
    stops = stop_token_ids(tok, model)
    keys = [(n, t, i) for n in args.lengths for i in range(args.samples) for t in args.tasks]
    t0 = clock(model.device)
    for count, (length, task, index) in enumerate(keys):
        sid = f"{task}-{length}-{index}"
        heur = {(m, r): p for (m, r), p in policy_grid(HEURISTICS, args.ratios).items()}
        learned = {(m, r): p for r in args.ratios for m, p in learned_policies(bank, r).items()}
        todo = {k: p for k, p in {**heur, **learned}.items() if (sid, k[0], k[1]) not in done}
        if not todo:
            continue
        s = build_sample(task, length, index, haystack, tok, 0)
        rec = record_prefill(model, s["context_ids"].unsqueeze(0))
        q = s["question_ids"].unsqueeze(0)
        results = {}
        for ratio in sorted({r for _, r in todo}):
            group = {f"{m}@{r}": p for (m, r), p in todo.items() if r == ratio and m in HEURISTICS}
            if group:
                results.update(rec.generate(group, s["max_new_tokens"], stops, q, None, batched=len(group) > 1))
            for (m, r), p in todo.items():  # a compensator cannot share a batch: one by one
                if r == ratio and m not in HEURISTICS:
                    results.update(rec.generate({f"{m}@{r}": p}, s["max_new_tokens"], stops, q, None))
        recs = []
        for (m, r), _ in todo.items():
            res = results[f"{m}@{r}"]
            text = tok.decode(res.tokens[0], skip_special_tokens=True)
            recs.append({"id": sid, "task": task, "length": length, "depth": s["depth"], "arm": m, "ratio": r,
                         "score": score_prediction(text, s["answers"], s["metric"]), "prediction": text,
                         "compressed_bytes": res.compressed_bytes, "compress_s": res.compress_seconds,
                         **({"bank": this_bank} if m in LEARNED else {})})
        append_jsonl(RESULTS, recs)
        print(f"[{count + 1}/{len(keys)}] {sid}: {len(recs)} runs ({(clock(model.device) - t0) / 60:.1f} min)",
              flush=True)


def report(args, bank_dir: Path, records: List[Dict[str, Any]]) -> str:
    from lightning_modules.llm.eval.suite_metrics import paired_bootstrap

    every = [r for r in records if r["length"] in args.lengths]
    recs = [r for r in every if r["ratio"] in args.ratios and r["arm"] != "full"]
    if not recs:
        return "No records yet: run `python -m bench.indexmem`."
    by: Dict[Tuple[str, float, int], Dict[str, float]] = {}
    for r in recs:
        by.setdefault((r["arm"], r["ratio"], r["length"]), {})[r["id"]] = float(r["score"])
    arms = list(LEARNED) + list(HEURISTICS)
    cells = sorted({(r["ratio"], r["length"]) for r in recs}, key=lambda c: (-c[0], c[1]))
    lines = [f"`python -m bench.indexmem` (SmolLM2-135M-Instruct, compress-then-ask, tasks {', '.join(args.tasks)}; "
             f"accuracy in %, n samples per cell; bank: `{bank_dir.relative_to(REPO) if bank_dir.is_relative_to(REPO) else bank_dir}`).",
             "", "| arm | " + " | ".join(f"{100 * (1 - r):.0f}% @ {n}" for r, n in cells) + " |",
             "|---" * (len(cells) + 1) + "|"]
    full = {n: {r["id"]: float(r["score"]) for r in every if r["arm"] == "full" and r["length"] == n}
            for _, n in cells}
    for arm in arms + ["full"]:
        row = []
        for r, n in cells:
            d = full[n] if arm == "full" else by.get((arm, r, n), {})
            row.append(f"{100 * sum(d.values()) / len(d):.1f} (n={len(d)})" if d else "-")
        lines.append(f"| {arm if arm != 'full' else 'full cache (reference)'} | " + " | ".join(row) + " |")
    lines += ["", "**IndexMem minus the best heuristic at matched memory** (the heuristic with the highest mean in "
              "the cell; paired by sample, 95% bootstrap interval, points):", ""]
    wins = 0
    for r, n in cells:
        im = by.get(("indexmem", r, n), {})
        heur = {a: by.get((a, r, n), {}) for a in HEURISTICS}
        heur = {a: d for a, d in heur.items() if d}
        if not im or not heur:
            continue
        best = max(heur, key=lambda a: sum(heur[a].values()) / len(heur[a]))
        ids = sorted(set(im) & set(heur[best]))
        bs = paired_bootstrap([im[i] for i in ids], [heur[best][i] for i in ids], seed=1)
        wins += bs["lo"] > 0
        parts = [f"* {100 * (1 - r):.0f}% budget @ {n}: vs {best} {100 * bs['diff']:+.1f} "
                 f"[{100 * bs['lo']:+.1f}, {100 * bs['hi']:+.1f}] (n={bs['n']})"]
        for a, b, what in (("indexmem", "indexer@B-33", "memory"), ("indexer@B-33", "snapkv", "indexer vs SnapKV"),
                           ("snapkv+mem", "snapkv", "memory on SnapKV")):
            da, db = by.get((a, r, n), {}), by.get((b, r, n), {})
            common = sorted(set(da) & set(db))
            if common:
                x = paired_bootstrap([da[i] for i in common], [db[i] for i in common], seed=1)
                parts.append(f"{what} ({a} - {b}) {100 * x['diff']:+.1f} [{100 * x['lo']:+.1f}, {100 * x['hi']:+.1f}]")
        lines.append("; ".join(parts))
    lines += ["", f"Cells where IndexMem's interval lies above the best heuristic: {wins} of {len(cells)} "
              f"(the acceptance asks for at least two budgets).", ""]
    banks: Dict[str, set] = {}
    for r in recs:
        b = record_bank(r)
        if b is not None:
            banks.setdefault(b, set()).add(r["id"])
    if banks:
        listed = "; ".join(f"`{b}` {len(ids)} samples" for b, ids in sorted(banks.items()))
        lines += ["Banks behind the learned arms (the records of several trainings of the recipe are pooled unless "
                  f"`--bank` picks one): {listed}", ""]
        if len(banks) > 1:
            lines += bank_table(recs, banks) + [""]
    lines += per_task_table(every, args)
    return "\n".join(lines)


def per_task_table(every: List[Dict[str, Any]], args) -> List[str]:
    """Accuracy (%) per task and length, pooled over the budgets (the full cache once per sample)."""
    arms = ["indexmem", "indexer@B-33", "snapkv+mem", "snapkv", "tova", "full"]
    cols = sorted({(r["task"], r["length"]) for r in every}, key=lambda c: (c[1], args.tasks.index(c[0])
                                                                             if c[0] in args.tasks else 99))
    out = ["Per task (accuracy in %, pooled over the budgets above; n = samples x budgets):", "",
           "| arm | " + " | ".join(f"{t} @ {n}" for t, n in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for arm in arms:
        row = []
        for t, n in cols:
            s = [float(r["score"]) for r in every if r["arm"] == arm and r["task"] == t and r["length"] == n
                 and (arm == "full" or r["ratio"] in args.ratios)]
            row.append(f"{100 * sum(s) / len(s):.0f} (n={len(s)})" if s else "-")
        out.append(f"| {arm} | " + " | ".join(row) + " |")
    return out


def bank_table(recs: List[Dict[str, Any]], banks: Dict[str, set]) -> List[str]:
    """Accuracy (%) per bank, pooled over budgets and lengths: the learned arms with that bank beside SnapKV and
    TOVA on the same samples (does a retrained bank behave like the first?)."""
    out = ["| bank | samples | indexmem | indexer@B-33 | snapkv | tova |", "|---|---|---|---|---|---|"]
    for b, ids in sorted(banks.items()):
        row = []
        for arm in ("indexmem", "indexer@B-33", "snapkv", "tova"):
            s = [float(r["score"]) for r in recs if r["arm"] == arm and r["id"] in ids
                 and (record_bank(r) is None or record_bank(r) == b)]
            row.append(f"{100 * sum(s) / len(s):.1f}" if s else "-")
        out.append(f"| `{b}` | {len(ids)} | " + " | ".join(row) + " |")
    return out


def figure(args, recs: List[Dict[str, Any]]) -> None:
    plt = pyplot()
    if plt is None or not recs:
        return
    lengths = sorted({r["length"] for r in recs if r["length"] in args.lengths})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 3.8), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        for arm in list(LEARNED) + list(HEURISTICS):
            pts = []
            for r in sorted(args.ratios):
                s = [x["score"] for x in recs if x["arm"] == arm and x["ratio"] == r and x["length"] == n]
                if s:
                    pts.append((100 * (1 - r), 100 * sum(s) / len(s)))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=arm, lw=2.5 if arm == "indexmem" else 1.2)
        full = [x["score"] for x in recs if x["arm"] == "full" and x["length"] == n]
        if full:
            ax.axhline(100 * sum(full) / len(full), color="k", ls="--", lw=1, label="full cache")
        ax.set_title(f"{n} tokens")
        ax.set_xlabel("budget (% of the context, memory included)")
        ax.set_ylabel("accuracy (%)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, FIGURE)


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.indexmem", description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", default=None, help="a trained IndexMem folder (default: train one)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.9, 0.85, 0.75],
                        help="compression ratios (0.9 keeps 10%% of the context)")
    parser.add_argument("--samples", type=int, default=10, help="samples per (task, length)")
    parser.add_argument("--tasks", nargs="+", default=TASKS)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--bank", default=None, help="report only the learned records of this bank id (default: "
                        "pool every bank; ids are in the report)")
    parser.add_argument("--rerun-learned", action="store_true",
                        help="redo the learned arms whose records came from another bank")
    args = parser.parse_args(argv)
    bank_dir = Path(args.weights) if args.weights else TRAIN_RUN / "indexmem"
    if not args.report_only:
        bank_dir = train_bank(args)
        run_suite(args, bank_dir)
    records = read_jsonl(RESULTS)
    if args.bank:  # only this bank's learned records (the heuristics do not depend on the bank)
        records = [r for r in records if record_bank(r) in (None, args.bank)]
    body = report(args, bank_dir, records)
    figure(args, records)
    write_section("indexmem", body + f"\n\n![IndexMem](figures/{FIGURE.name})",
                  "IndexMem: learned eviction with latent memory vs heuristics (SmolLM2-135M)")
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
