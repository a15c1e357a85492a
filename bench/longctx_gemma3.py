"""Tables for the second real model (Gemma-3-270M base) from its resumable result files: the long-context suite
with the full cache, and one KV-eviction and one sparse-prefill callback against the full cache on the same
samples (paired by sample id).

    python -m bench.longctx_gemma3        # print the Markdown tables of the records so far

The records come from ``recipes.evaluate --recipe longctx_gemma3 ... method.args.results_file=<abs path>``
(the exact commands are in the docs/results.md section); this script only reads them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Dict, List, Mapping, Sequence

from bench._report import REPO
from lightning_modules.llm.eval.suite_metrics import markdown_table, mean_prefill_seconds, paired_bootstrap, summarise
from litctx_common.io import read_jsonl

RESULTS = REPO / "results"
FULL = RESULTS / "longctx_gemma3_compress_then_ask.jsonl"
METHODS = {"snapkv 50% evicted": RESULTS / "longctx_gemma3_snapkv50.jsonl",
           "prism top_p 0.95": RESULTS / "longctx_gemma3_prism95.jsonl"}


def latest(path: Path) -> Dict[str, Mapping]:
    """The last record per sample id of ``path`` (a rerun's record replaces an earlier one)."""
    return {r["id"]: r for r in read_jsonl(path, key=lambda r: r["id"])}


def paired_rows(label: str, method: Mapping[str, Mapping], full: Mapping[str, Mapping]) -> List[str]:
    """One row per length: accuracy of ``method``, of the full cache on the same samples, and the paired
    difference with its 95% bootstrap interval (accuracy points)."""
    rows = []
    lengths = sorted({int(r["length"]) for r in method.values()})
    for n in lengths:
        ids = sorted(i for i, r in method.items() if int(r["length"]) == n and i in full)
        if not ids:
            continue
        a = [float(method[i]["score"]) for i in ids]
        b = [float(full[i]["score"]) for i in ids]
        ci = paired_bootstrap(a, b)
        rows.append(f"| {n // 1024}K | {label} | {100 * sum(a) / len(a):.1f} | {100 * sum(b) / len(b):.1f} | "
                    f"{100 * ci['diff']:+.1f} [{100 * ci['lo']:+.1f}, {100 * ci['hi']:+.1f}] | {len(ids)} |")
    return rows


def report(full_path: Path = FULL, methods: Mapping[str, Path] = METHODS) -> str:
    """The Markdown of the full-cache table and the paired method table (methods without records are left out)."""
    full = latest(full_path)
    if not full:
        raise FileNotFoundError(f"no full-cache records in {full_path}")
    records: Sequence[Mapping] = list(full.values())
    out = [markdown_table(summarise(records)), "",
           f"Mean prefill time per sample as recorded: {mean_prefill_seconds(records)}.", "",
           "| length | method | accuracy % | full cache, same samples % | difference (paired 95% CI) | n |",
           "|---|---|---|---|---|---|"]
    for label, path in methods.items():
        out.extend(paired_rows(label, latest(path), full))
    return "\n".join(out)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    print(report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
