"""Is a lost Prism answer the estimate's error or the sparsity's cost? On the Prism claim's held-out samples of one
cell where dense attention answers and Prism does not, rerun the exact-mass oracle (``oracle_blocks``: the true
block attention mass, top-p per row, Prism's top-p and block) and print its answer and density beside Prism's.

    python -m bench.prism_oracle_check --task niah_single --length 4096 --samples 8

Reads ``results/claims/prism/heldout.jsonl`` (run ``litctx claim prism`` first); writes nothing. The prefill
leaderboard (``litctx leaderboard``) runs the same oracle on every sample of its cells.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="niah_single")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=8, help="failed samples to check (held-out order)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    from datamodules.claims import SuiteSamples
    from lightning_modules.llm.model.loading import load_causal_lm
    from lightning_modules.sparse_prefill.claims import SuitePrefill
    from litctx_common.claims import ArmSpec
    from litctx_common.records import Arm
    from recipes.claim import RESULTS, load_claim, load_claim_records

    torch.set_num_threads(args.threads)
    spec = load_claim("prism")
    prism = spec.arm("prism")
    oracle = ArmSpec("oracle", "oracle_blocks", {"top_p": prism.args["top_p"], "block": prism.args["block"]})
    spec.arms.append(oracle)
    recs = [r for r in load_claim_records(spec, RESULTS, "heldout")
            if r["task"] == args.task and r["length"] == args.length]
    by = {}
    for r in recs:
        by.setdefault(r["id"], {})[r["arm"]] = r
    failed = [i for i, arms in by.items() if arms.get("dense", {}).get("score") == 1 and arms.get("prism", {}).get(
        "score") == 0][:args.samples]
    print(f"{len(failed)} held-out samples of {args.task}@{args.length} where dense answers and Prism does not",
          flush=True)
    model, tok = load_causal_lm(spec.model)
    model.requires_grad_(False)
    kind = SuitePrefill(spec, model, tok)
    built = SuiteSamples(spec, tok).built
    right = 0
    for sid in failed:
        hay, rest = sid.split(":")
        s = built({"id": sid, "task": args.task, "length": args.length, "haystack": hay,
                   "index": int(rest.rsplit("-", 1)[1])})
        with torch.no_grad():
            got = kind.evaluate(s, [Arm("oracle")])["oracle"]
        right += got["score"] == 1
        p = by[sid]["prism"]
        print(f"{sid}: oracle {got['score']:.0f} (density {got['density']:.3f}: {got['prediction'][:40]!r}) | "
              f"prism 0 (density {p['density']:.3f}: {p['prediction'][:40]!r})", flush=True)
    print(f"oracle answers {right} of {len(failed)} samples Prism lost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
