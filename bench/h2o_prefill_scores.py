"""H2O's prefill scores: a second pass over every prefill query against the column sums of the prefill's own
attention call (``litctx_kernels.fused_attention_colstats``), on SmolLM2-135M-Instruct.

H2O scores each prompt entry by the attention every prefill query paid it. Computed after the prefill, that is a
second pass over all queries (``litctx_kernels.attention_colstats``); the fused path takes the sums from the prefill's
attention call itself (on CPU the native forward sweeps each query block's keys once more after its LSE is
known). Per sample (``niah_single`` prompts of the suite, interleaved arms, one process):

* *plain*: the prefill of the prompt with no policy installed, seconds (what H2O's scoring adds to);
* *live*: the prefill of the prompt with H2O installed (50% eviction), seconds;
* *recorded*: a prefill recorded once for many policies (``record_prefill``), seconds, then H2O's compression
  of it (``compress_seconds``: scoring + eviction), seconds;
* whether both arms keep the same entries in every layer (the fused sums are the same numbers up to float32
  rounding, so the selections should match).

    python -m bench.h2o_prefill_scores                 # 3 samples at 4K (about 3 minutes on 2 cores)
    python -m bench.h2o_prefill_scores --report-only
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List

from bench._report import REPO, write_section
from litctx_common.io import append_jsonl, read_jsonl
from litctx_common.timing import clock

RESULTS = REPO / "results" / "h2o_prefill_scores.jsonl"
ARMS = ("separate pass", "fused")


def run(args, model, tok) -> None:
    import os

    import torch

    from datamodules.longctx_tasks import Haystack, build_sample
    from datamodules.text import pydoc_documents
    from litctx_kernels.cpu_sparse import NATIVE_ENV
    from lightning_modules.kv_eviction.config import method_config
    from lightning_modules.llm.runtime.cached_lm import CachedLM
    from lightning_modules.llm.decoding.generate import record_prefill
    from lightning_modules.llm.kv_policy.runner import install_policy

    done = {(r["id"], r["arm"]) for r in read_jsonl(args.results)}
    haystack = Haystack(pydoc_documents(), tok)
    policy = method_config("h2o", {"compression_ratio": 0.5}).build()
    for index in range(args.samples):
        sid = f"niah_single-{args.length}-{index}"
        if all((sid, arm) in done for arm in ARMS):
            continue
        s = build_sample("niah_single", args.length, index, haystack, tok, 0)
        ctx = s["context_ids"].unsqueeze(0)
        kept: Dict[str, List[Any]] = {}
        rows = []
        lm = CachedLM(model)  # the same prefill with no policy installed: what H2O's scoring adds to
        t0 = clock(lm.device)
        lm.feed(ctx)
        plain_s = clock(lm.device) - t0
        for arm in ARMS:
            # the separate arm: the native forward switched off (its kill switch), so there is no fused path and
            # the scores come from litctx_kernels.attention_colstats afterwards; the prefill attention itself is SDPA in
            # both arms
            before = os.environ.get(NATIVE_ENV)
            os.environ[NATIVE_ENV] = "1" if arm == "fused" else "0"
            try:
                lm = CachedLM(model)
                t0 = clock(lm.device)
                with install_policy(model, policy) as session:
                    lm.feed(ctx)
                    live_s = clock(lm.device) - t0
                    kept[arm] = [(r.state.slots.clone(), r.state.valid.clone()) for r in session.runners.values()]
                rec = record_prefill(model, ctx, None)
                res = rec.generate({"h2o": policy}, 1)["h2o"]
            finally:
                if before is None:
                    os.environ.pop(NATIVE_ENV)
                else:
                    os.environ[NATIVE_ENV] = before
            rows.append({"id": sid, "length": int(ctx.shape[1]), "arm": arm, "plain_prefill_s": plain_s,
                         "live_prefill_s": live_s,
                         "recorded_prefill_s": rec.seconds, "h2o_compress_s": res.compress_seconds})
        same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                   for a, b in zip(kept[ARMS[0]], kept[ARMS[1]]))
        for row in rows:
            row["same_selection"] = bool(same)
        append_jsonl(args.results, rows)
        print(f"sample {index + 1}/{args.samples}: " + "; ".join(
            f"{r['arm']} live {r['live_prefill_s']:.2f} s, recorded {r['recorded_prefill_s']:.2f} s + compress "
            f"{r['h2o_compress_s']:.2f} s" for r in rows) + f"; same selection: {same}", flush=True)


def report(args) -> str:
    records = read_jsonl(args.results)
    if not records:
        return "No records yet."
    ids = sorted({r["id"] for r in records})

    def med(arm: str, key: str) -> str:
        xs = [r[key] for r in records if r["arm"] == arm]
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    lines = [f"Command: `python -m bench.h2o_prefill_scores --samples {len(ids)}` (SmolLM2-135M-Instruct, fp32, "
             f"`niah_single` prompts of {records[0]['length']} tokens, H2O at 50% eviction, both arms interleaved "
             "per sample in one process; median (min-max) over samples, seconds).", "",
             "| arm | live H2O prefill s | recorded prefill s | H2O compression of the record s | "
             "recorded + compression s |", "|---|---|---|---|---|"]
    for arm in ARMS:
        xs = [r for r in records if r["arm"] == arm]
        total = statistics.median(r["recorded_prefill_s"] + r["h2o_compress_s"] for r in xs)
        lines.append(f"| {arm} | {med(arm, 'live_prefill_s')} | {med(arm, 'recorded_prefill_s')} | "
                     f"{med(arm, 'h2o_compress_s')} | {total:.2f} |")
    same = sum(1 for i in ids if all(r["same_selection"] for r in records if r["id"] == i))
    plain = [r["plain_prefill_s"] for r in records if r["arm"] == ARMS[0]]
    lines += ["", f"The same prefill with no policy installed: {statistics.median(plain):.2f} "
              f"({min(plain):.2f}-{max(plain):.2f}) s. Same kept entries in every layer under both arms: {same} of "
              f"{len(ids)} samples."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not args.report_only:
        import torch

        from lightning_modules.llm.model.loading import load_causal_lm

        model, tok = load_causal_lm("smollm2-135m")
        model.requires_grad_(False)
        with torch.no_grad():
            run(args, model, tok)
    body = report(args)
    write_section("h2o_prefill_scores", body, "H2O's prefill scores from the prefill's attention call")
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
