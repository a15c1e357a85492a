"""What does each selector recompute on the ProphetKV claim's samples? On the first held-out samples of the claim's
setting, prefill from the claim's chunk store with each selector at the judged budget and count which chunk tokens
it picks: the gold chain's two fact sentences (the name closing one document and the pronoun sentence opening the
next), the other chains' fact sentences, and each document's first tokens (EPIC's rule), beside the arm's held-out
score on the same samples.

    python -m bench.prophetkv_selection --samples 10

Reads ``results/claims/prophetkv/heldout.jsonl`` (run ``litctx claim prophetkv`` first); writes nothing.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Dict, Optional, Sequence

FACT = re.compile(r"is kept by|files the ledger under code")
"""The coref setting's fact sentences (datamodules.rag_tasks: "These days <post> is kept by <name>." and
"<Pronoun> files the ledger under code <code>.")."""


def classify(tok, chunks: Sequence[Sequence[int]], documents, gold, initial: int) -> Dict[str, set]:
    """Positions over the concatenated chunk tokens: ``gold`` (the asked chain's fact sentences), ``other`` (the
    other chains' fact sentences) and ``initial`` (each document's first ``initial`` tokens)."""
    from lightning_modules.rag.prompts import encode_with_span

    gold_text = {documents[g["doc"]]["sentences"][g["sentence"]]["text"] for g in gold}
    out: Dict[str, set] = {"gold": set(), "other": set(), "initial": set()}
    base = 0
    for j, ids in enumerate(chunks):
        text = tok.decode(ids)
        out["initial"].update(base + i for i in range(min(initial, len(ids))))
        for sent in documents[j]["sentences"]:
            if not FACT.search(sent["text"]):
                continue
            at = text.find(sent["text"])
            if at < 0:
                raise ValueError(f"document {j}: fact sentence {sent['text']!r} not found in its chunk's text")
            again, (lo, hi) = encode_with_span(tok, text, at, at + len(sent["text"]))
            if again != list(ids):
                raise ValueError(f"document {j}: its chunk's text does not re-encode to the prompt's tokens")
            out["gold" if sent["text"] in gold_text else "other"].update(range(base + lo, base + hi))
        base += len(ids)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=10, help="held-out samples, in order")
    parser.add_argument("--initial", type=int, default=16, help="a document's first tokens counted as initial")
    parser.add_argument("--arms", nargs="+", default=["prophetkv@0.2", "prophetkv_tail@0.2", "cacheblend@0.2",
                                                      "epic@0.2", "oracle@0.2", "random@0.2"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    from datamodules.claims import RagSamples, claim_samples
    from lightning_modules.llm.model.loading import load_causal_lm
    from lightning_modules.llm.runtime.kv_store import KVSegmentStore
    from lightning_modules.prophetkv.claims import reuse_config
    from lightning_modules.rag.prompts import build_prompt
    from litctx_common.paths import default_cache_dir
    from recipes.claim import RESULTS, load_claim, load_claim_records

    torch.set_num_threads(args.threads)
    spec = load_claim("prophetkv")
    scores = {(r["id"], r["arm"]): r["score"] for r in load_claim_records(spec, RESULTS, "heldout")}
    if not scores:
        print("no held-out records: run `litctx claim prophetkv` first", file=sys.stderr)
        return 1
    model, tok = load_causal_lm(spec.model)
    store = KVSegmentStore(str(default_cache_dir() / "claims" / spec.name), 2 ** 31)
    reusers = {a: reuse_config(spec.arm(a)).build(model, store) for a in args.arms}
    data = RagSamples(spec, tok)
    rows = {a: {"gold": [], "other": [], "initial": [], "score": []} for a in args.arms}
    for cs in claim_samples(spec, "heldout", limit=args.samples):
        s = data.built(cs)
        prompt = build_prompt(tok, s["documents"], s["question"], "qa", answer_prefix=s.get("answer_prefix"))
        kinds = classify(tok, prompt.chunk_ids, s["documents"], s["gold"], args.initial)
        for a, reuser in reusers.items():
            res = reuser.prefill(prompt.prefix_ids, [prompt.chunk_ids], [prompt.question_ids], [prompt.question_span])
            picked = set(res.stats["selected"][0])
            rows[a]["gold"].append(len(picked & kinds["gold"]) / max(1, len(kinds["gold"])))
            rows[a]["other"].append(len(picked & kinds["other"]) / max(1, len(kinds["other"])))
            rows[a]["initial"].append(len(picked & kinds["initial"]) / max(1, len(picked)))
            rows[a]["score"].append(scores.get((cs["id"], a), float("nan")))
        print(f"{cs['id']}: " + " ".join(f"{a}={rows[a]['gold'][-1]:.2f}" for a in args.arms), file=sys.stderr)
    n = len(rows[args.arms[0]]["gold"])
    mean = lambda v: 100 * sum(v) / len(v)  # noqa: E731
    print(f"\n{n} held-out samples of {spec.cells.dims['setting']} (claim order), each arm at its budget; "
          f"'initial' = a document's first {args.initial} tokens\n")
    print("| arm | gold chain's fact tokens recomputed % | other chains' fact tokens % | budget on initial tokens % "
          "| held-out score on these samples % |")
    print("|---|---|---|---|---|")
    for a in args.arms:
        r = rows[a]
        print(f"| {a} | {mean(r['gold']):.1f} | {mean(r['other']):.1f} | {mean(r['initial']):.1f} | "
              f"{mean(r['score']):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
