"""LoSA against dense, Quest and a fixed (SparseD-like) pattern on the denoising steps of a trained block-diffusion
LM, on the multi-key task (the answer block reads several prompt regions: KV inflation).

    python -m bench.losa --model runs/bdlm_cpu/<run>/hf           # run (or continue), then write the report
    python -m bench.losa --model ... --lengths 512 --samples 10 --budgets 16 64
    python -m bench.losa --report-only

Per sample the prompt is prefilled once (dense in every arm: the arms differ only on denoising steps) and each arm
samples the answer block from that prefill with the model's sampler (8 steps per block unless ``--steps``).
Arms (``lightning_modules.losa.config.prefix_grid``): ``dense``; at each per-query budget ``b`` (prefix entries per
query, Quest pages of 16): ``quest_b{b}`` (every block query, every step), ``fixed_b{b}`` (pages fixed by the dense
first step), ``losa_ka{k}_b{b}`` for each ``k_a`` and ``losa_thr{x}_b{b}`` (the threshold variant). One JSON
record per (sample, arm) goes to ``results/losa_<recipe>_<run>.jsonl``, so a rerun continues. Reported per
context length and arm: exact match, token accuracy, union-of-pages density over all denoising steps and over
the steps after the first, K/V bytes read per denoising step relative to dense, prefix+block attention CPU time
relative to dense, LoSA minus Quest at equal budget (exact match and token accuracy, 95% paired bootstrap; density
ratios over the later steps and over all steps) and the active share per layer; a figure of accuracy against
density.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from bench._report import REPO, pyplot, save_figure, write_section

from litctx_common.io import append_jsonl, read_jsonl
from litctx_common.stats import mean_of

RESULTS_DIR = REPO / "results"
FIGURE_DIR = REPO / "docs" / "figures"


def results_path(model: str) -> Path:
    """``results/losa_<recipe>_<run>.jsonl`` for ``runs/<recipe>/<run>/hf`` (else the folder's own name)."""
    folder = Path(model).resolve()
    parts = [folder.parent.parent.name, folder.parent.name] if folder.name == "hf" else [folder.name]
    return RESULTS_DIR / f"losa_{'_'.join(p for p in parts if p)}.jsonl"


def load(model_dir: str):
    """The block-diffusion model, its tokenizer (None for a synthetic-vocabulary model) and its setting."""
    from lightning_modules.bdlm.block_attention import block_setting
    from lightning_modules.llm.model.loading import load_causal_lm

    has_tokenizer = (Path(model_dir) / "tokenizer_config.json").is_file()
    model, tok = load_causal_lm(model_dir, with_tokenizer=has_tokenizer, expect_surgery="block_diffusion")
    model.requires_grad_(False)
    return model, tok, block_setting(model)


def samples(tok: Any, setting: Any, length: int, n: int, seed: int) -> List[Dict[str, Any]]:
    from datamodules.synth.multi_key import MultiKeyConfig, MultiKeyDataModule

    cfg = MultiKeyConfig(tokenizer="model" if tok is not None else None, block_size=setting.block_size,
                         context_tokens=length, eval_size=n, seed=seed, batch_size=1)
    dm = MultiKeyDataModule(cfg, tokenizer=tok)
    data = dm.split("test")
    return [dm.collate([data[i]]) for i in range(n)]


def run_sample(model: Any, batch: Dict[str, Any], arms: List[Any], steps: int, done: set, out: Path) -> None:
    import torch

    from lightning_modules.bdlm.module import score_answers
    from lightning_modules.bdlm.block_sampler import BlockDiffusionSampler, BlockSamplerConfig, left_pad_to_blocks
    from lightning_modules.bdlm.block_attention import block_setting
    from lightning_modules.llm.runtime.cached_lm import CachedLM
    from lightning_modules.losa.method import install_block_sparse

    setting = block_setting(model)
    p, a = int(batch["prompt_len"]), int(batch["answer_len"])
    todo = [arm for arm in arms if (batch["id"][0], arm.label) not in done]
    if not todo:
        return
    ids, mask = left_pad_to_blocks(batch["input_ids"][:, :p], batch["attention_mask"][:, :p], setting.block_size,
                                   int(batch["pad_id"]))
    lm = CachedLM(model)
    with torch.no_grad():
        first = lm.feed(ids, mask)
    held = lm.snapshot()
    records = []
    for arm in todo:
        lm.restore(held)
        with install_block_sparse(model, arm) as (session, hook):
            res = BlockDiffusionSampler(lm, BlockSamplerConfig(steps=steps), [hook]).run(
                first, a, [int(batch["eos_id"])])
        exact, acc = score_answers(res.tokens, batch)
        s = session.summary()
        records.append({"id": batch["id"][0], "length": int(batch["length"][0]), "arm": arm.label,
                        "method": arm.method, "budget": getattr(arm, "budget", None),
                        "active": getattr(arm, "active", None) if arm.method == "losa" else None,
                        "exact": float(exact[0]), "token_acc": float(acc[0]), "density": s["density"],
                        "density_later": s["density_later"], "bytes_per_step": s["bytes_per_step"],
                        "dense_bytes_per_step": s["dense_bytes_per_step"], "seconds": s["seconds"],
                        "prefix_valid": int(mask.sum()),
                        "active_share_by_layer": {str(k): v for k, v in s["active_share_by_layer"].items()},
                        "tokens": res.tokens[0]})
    append_jsonl(out, records)


def report(records: List[Dict[str, Any]], model: str, figure: Optional[Path]) -> str:
    from lightning_modules.llm.eval.suite_metrics import paired_bootstrap

    by: Dict[tuple, Dict[str, Dict[str, Any]]] = {}
    for r in records:
        by.setdefault((r["length"],), {}).setdefault(r["arm"], {})[r["id"]] = r
    lines = [f"Model `{model}`; command `python -m bench.losa --model {model}`; one greedy sample per prompt "
             f"(deterministic), so the spread is over prompts: 95% paired bootstrap intervals over them.", ""]
    for (length,), arms in sorted(by.items()):
        dense = arms.get("dense", {})
        ids = sorted(set.intersection(*[set(v) for v in arms.values()])) if arms else []
        lines += [f"### {length}-token prompts ({len(ids)} samples in every arm)", "",
                  "| arm | exact match | token acc | density (all steps) | density (later steps) | bytes / dense "
                  "| attention time / dense |", "|---|---|---|---|---|---|---|"]
        d_bytes = mean_of([dense[i]["bytes_per_step"] for i in ids]) if dense else float("nan")
        d_sec = mean_of([dense[i]["seconds"] for i in ids]) if dense else float("nan")
        for arm in sorted(arms, key=_arm_key):
            rs = [arms[arm][i] for i in ids]
            lines.append(f"| {arm} | {100 * mean_of([r['exact'] for r in rs]):.0f}% "
                         f"| {mean_of([r['token_acc'] for r in rs]):.3f} "
                         f"| {mean_of([r['density'] for r in rs]):.3f} | {mean_of([r['density_later'] for r in rs]):.3f} "
                         f"| {mean_of([r['bytes_per_step'] for r in rs]) / d_bytes:.3f} "
                         f"| {mean_of([r['seconds'] for r in rs]) / d_sec:.2f} |")
        lines += ["", "LoSA minus Quest at the same per-query budget: exact match and token accuracy (percentage "
                  "points, 95% paired bootstrap over prompts) and the ratio of union densities, over the sparse "
                  "(later) steps as the paper counts density, and over all steps (LoSA's dense first step "
                  "included). *yes*: LoSA reads less and neither accuracy is lower; *tie*: it reads less and an "
                  "accuracy is lower but its interval includes 0; **no**: it reads as much or more, or an "
                  "accuracy is lower with the interval below 0.", "",
                  "| budget | selection | exact-match diff [95% CI] | token-acc diff [95% CI] | density LoSA / Quest "
                  "(later steps) | LoSA holds? | density LoSA / Quest (all steps) | holds on all steps? |",
                  "|---|---|---|---|---|---|---|---|"]
        for arm in sorted(arms, key=_arm_key):
            if not arm.startswith("losa_"):
                continue
            budget = arm.rsplit("_b", 1)[1]
            quest = arms.get(f"quest_b{budget}")
            if not quest:
                continue
            cis = [paired_bootstrap([arms[arm][i][key] for i in ids], [quest[i][key] for i in ids])
                   for key in ("exact", "token_acc")]
            ratios = [mean_of([arms[arm][i][key] for i in ids]) / mean_of([quest[i][key] for i in ids])
                      for key in ("density_later", "density")]
            lines.append(f"| {budget} | {arm.split('_')[1]} | "
                         + " | ".join(f"{100 * c['diff']:+.1f} [{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}]"
                                      for c in cis)
                         + "".join(f" | {r:.2f} | {losa_verdict(r, cis)}" for r in ratios) + " |")
        for family in sorted({a.rsplit("_b", 1)[0] for a in arms if a.startswith("losa_thr")}):
            shares = [r["active_share_by_layer"] for arm in arms if arm.rsplit("_b", 1)[0] == family
                      for r in arms[arm].values() if r["active_share_by_layer"]]
            if shares:
                layers = sorted(shares[0], key=int)
                lines += ["", f"Active share per layer ({family}, later steps; top-k_a arms have k_a / B by "
                          f"construction): " + ", ".join(f"L{k} {mean_of([s[k] for s in shares]):.2f}" for k in layers)]
        lines.append("")
    if figure is not None:
        _figure(by, figure)
        lines.append(f"![accuracy against density]({figure.relative_to(REPO / 'docs').as_posix()})")
    return "\n".join(lines)


def losa_verdict(density_ratio: float, intervals: List[Dict[str, float]]) -> str:
    """``yes`` (reads less, no accuracy lower), ``tie`` (reads less, a lower accuracy whose paired interval
    includes 0) or ``**no**`` (reads as much or more, or an accuracy lower with its interval below 0)."""
    if not density_ratio < 1 or any(c["hi"] < 0 for c in intervals):
        return "**no**"
    return "yes" if all(c["diff"] >= 0 for c in intervals) else "tie"


def _arm_key(arm: str):
    if arm == "dense":
        return (0, 0, "")
    kind, _, budget = arm.rpartition("_b")
    return (1, int(budget), kind)


def _figure(by, path: Path) -> None:
    """Token accuracy (top row) and exact match (bottom row) against the union density of the later (sparse)
    steps, one column per prompt length; one line per arm family through its budgets."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(2, len(by), figsize=(5.5 * len(by), 8), squeeze=False)
    for col, ((length,), arms) in enumerate(sorted(by.items())):
        families = sorted({arm.rsplit("_b", 1)[0] for arm in arms}, key=lambda f: (f != "dense", f))
        for row, (key, label) in enumerate((("token_acc", "token accuracy"), ("exact", "exact match"))):
            ax = axes[row][col]
            for family in families:
                members = [rs for arm, rs in arms.items() if arm.rsplit("_b", 1)[0] == family]
                pts = sorted((mean_of([r["density_later"] for r in rs.values()]),
                              mean_of([r[key] for r in rs.values()])) for rs in members)
                style = "*" if family == "dense" else ("o-" if family == "quest" else
                                                       "s--" if family == "fixed" else "^-")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=family, markersize=7)
            ax.set_xlabel("union-of-pages density (later denoising steps)")
            ax.set_ylabel(label)
            ax.set_title(f"{length}-token prompts: {label}")
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", required=True, help="a Hugging Face folder of a trained bdlm run (<run dir>/hf)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--actives", type=int, nargs="+", default=[1, 3, 5, 8])
    ap.add_argument("--thresholds", type=float, nargs="*", default=[0.5],
                    help="LoSA's threshold variant: active = change >= threshold x the block's largest change")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8, help="denoising steps per block")
    ap.add_argument("--seed", type=int, default=0, help="the data seed (test split)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)

    out = results_path(args.model)
    if not args.report_only:
        import torch

        from lightning_modules.losa.config import prefix_grid

        torch.set_num_threads(args.threads)
        model, tok, setting = load(args.model)
        arms = prefix_grid(args.budgets, args.actives, page_size=args.page_size, thresholds=args.thresholds)
        done = {(r["id"], r["arm"]) for r in read_jsonl(out)}
        for length in args.lengths:
            for i, batch in enumerate(samples(tok, setting, length, args.samples, args.seed)):
                run_sample(model, batch, arms, args.steps, done, out)
                print(f"[losa] {length} tokens: sample {i + 1}/{args.samples}", flush=True)
    records = list(read_jsonl(out))
    if not records:
        print(f"no records in {out}")
        return 1
    body = report(records, args.model, FIGURE_DIR / f"{out.stem}.png")
    print(body)
    write_section("losa", body, "LoSA: locality-aware sparse attention on a block-diffusion LM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
