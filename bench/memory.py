"""LLM memory on SmolLM2-135M-Instruct: HGMem against single-step RAG and a flat memory on the generated multi-hop
questions, and PersistBench failure rates with and without memories and under a restrictive system prompt, judged by
the rule-based judge and by an LLM judge, with their agreement.

    python -m bench.memory                               # both parts (resumable: records are kept per question)
    python -m bench.memory --parts multihop --questions 20
    python -m bench.memory --parts persistbench --per-type 12
    python -m bench.memory --report-only                 # rewrite the docs/results.md section from the records

Parts:

* ``multihop`` - the diagnostic first (the answer prompt with exactly the gold supporting sentences: can the model
  chain the facts when retrieval is perfect?), then the ``hgmem_smollm2`` recipe's settings (one source of truth), ``loop.strategy`` single_step, flat
  and hgmem over the same ``--questions`` questions: accuracy (the gold entity in the answer) with 95% paired
  bootstrap intervals of the differences, LLM calls and tokens per question, the share of the gold supporting
  documents the retrieval found and the answer read, memory points, merges and rejected steps.
* ``persistbench`` - the first ``--per-type`` samples of each failure type, the ``persistbench_smollm2`` recipe's
  decoding, system prompts ``no_memories``, ``default`` and ``restrictive``; every answer judged by an LLM judge
  (``--judge-backend``, SmolLM2 itself by default, through the same backend protocol) and by the rule-based judge;
  FR@3 (FR@1 for beneficial) by both, the LLM judge's share of unreadable verdicts, and the agreement of the two on
  pass / fail per answer (raw and Cohen's kappa).

Records: ``results/memory_multihop_<strategy>.jsonl`` and ``results/memory_persistbench_<prompt>.jsonl``
(the modules' own resumable records); LLM calls are recorded under ``runs/bench_memory/`` so a killed run repeats none.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, Dict, List, Optional, Sequence

from bench._report import REPO, write_section
from litctx_common.io import read_jsonl
from litctx_common.stats import mean_of

RESULTS = REPO / "results"
WORK = REPO / "runs" / "bench_memory"
STRATEGIES = ("single_step", "flat", "hgmem")
PROMPTS = ("no_memories", "default", "restrictive")
TYPES = ("cross_domain", "sycophancy", "beneficial_memory_usage")


def multihop_path(strategy: str):
    return RESULTS / f"memory_multihop_{strategy}.jsonl"


def persist_path(prompt: str):
    return RESULTS / f"memory_persistbench_{prompt}.jsonl"


def run_multihop(args) -> None:
    from datamodules.multihop import MultiHopDataModule
    from lightning_modules.hgmem.module import HGMemEvalModule
    from recipes.config import load_config

    base = load_config("hgmem_smollm2").run.method.args
    samples = MultiHopDataModule(samples=args.questions, seed=args.seed).samples
    shared = None
    for strategy in STRATEGIES:
        cfg = dict(base, loop=dict(base["loop"], strategy=strategy), results_file=str(multihop_path(strategy)),
                   calls_file=str(WORK / f"calls_multihop_{strategy}.jsonl"),
                   memory_dir=str(WORK / f"memories_{strategy}"), draw=3)
        module = HGMemEvalModule(cfg, chat_backend=shared)  # one SmolLM2 for every strategy
        _ = module.backend
        shared = module.chat_backend
        module.start_records()
        for i, s in enumerate(samples):
            rec = module.run_sample(s)[0]
            print(f"[multihop] {strategy} {i + 1}/{len(samples)} {s['id']} score={rec['score']} calls={rec['calls']} "
                  f"pred={rec['prediction'][:60]!r}", flush=True)


def run_gold_context(args) -> None:
    """The diagnostic: the same answer prompt with exactly the gold supporting sentences as its sources (can the
    model chain the facts when retrieval is perfect?)."""
    from datamodules.multihop import MultiHopDataModule
    from lightning_modules.hgmem import prompts as P
    from lightning_modules.llm.serving.chat import build_backend
    from lightning_modules.llm.serving.chat_records import RecordedBackend
    from lightning_modules.llm.eval.suite_metrics import score_prediction
    from litctx_common.io import append_jsonl

    path = multihop_path("gold_context")
    done = {r["id"] for r in read_jsonl(path)}
    samples = [s for s in MultiHopDataModule(samples=args.questions, seed=args.seed).samples if s["id"] not in done]
    if not samples:
        return
    backend = RecordedBackend(build_backend({"name": "local", "model": "smollm2-135m"}),
                              WORK / "calls_multihop_gold_context.jsonl")
    for s in samples:
        sources = "\n".join(f"[{g['doc']}] {g['sentence']}" for g in s["gold"])
        messages = [{"role": "system", "content": P.fmt(P.ANSWER_SYSTEM, context=f"Sources:\n{sources}")},
                    {"role": "user", "content": P.fmt(P.ANSWER_USER, question=s["question"])}]
        raw = backend.complete(messages, max_tokens=48, temperature=0.0)
        pred = P.read_answer(raw)
        append_jsonl(path, [{"id": s["id"], "hops": s["hops"], "prediction": pred, "answers": s["answers"],
                             "score": score_prediction(pred, s["answers"], "any")}])
        print(f"[gold_context] {s['id']} pred={pred[:60]!r} gold={s['answers']}", flush=True)


def run_persistbench(args) -> None:
    from datamodules.persistbench import PersistBenchDataModule
    from lightning_modules.persistbench.module import PersistBenchModule
    from recipes.config import load_config

    base = load_config("persistbench_smollm2").run.method.args
    all_samples = PersistBenchDataModule().samples
    samples = [s for t in TYPES for s in [x for x in all_samples if x["failure_type"] == t][:args.per_type]]
    backend = None
    for prompt in PROMPTS:
        judge = {"name": "llm", "backend": json.loads(args.judge_backend) if args.judge_backend else None,
                 "max_tokens": args.judge_max_tokens}
        cfg = dict(base, system_prompt=prompt, judge={k: v for k, v in judge.items() if v is not None},
                   max_tokens=args.max_tokens, results_file=str(persist_path(prompt)),
                   calls_file=str(WORK / f"calls_persistbench_{prompt}.jsonl"))
        module = PersistBenchModule(cfg, chat_backend=backend)
        _ = module.backend
        backend = module.chat_backend
        module.start_records()
        for i, s in enumerate(samples):
            recs = module.run_sample(s)
            print(f"[persistbench] {prompt} {i + 1}/{len(samples)} {s['id']} scores={[r['score'] for r in recs]}",
                  flush=True)


# ---------------------------------------------------------------- report
def _fmt_interval(res: Dict[str, float]) -> str:
    return f"{100 * res['diff']:+.1f} [{100 * res['lo']:+.1f}, {100 * res['hi']:+.1f}]"


def multihop_report() -> List[str]:
    from lightning_modules.llm.eval.suite_metrics import paired_bootstrap

    recs = {s: {r["id"]: r for r in read_jsonl(multihop_path(s), key=lambda r: r["id"])} for s in STRATEGIES}
    common = sorted(set.intersection(*(set(v) for v in recs.values()))) if all(recs.values()) else []
    if not common:
        return ["(no multi-hop records yet: `python -m bench.memory --parts multihop`)"]
    lines = [f"**Multi-hop QA** ({len(common)} questions, "
             f"{sum(recs['hgmem'][i]['hops'] == 3 for i in common)} of them 3-hop; one seed):", "",
             "| strategy | accuracy | minus single-step (points) | LLM calls / q | tokens / q | gold docs retrieved | "
             "gold docs in the answer's context | memory points | merges | rejected steps |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    single = [recs["single_step"][i]["score"] for i in common]
    for s in STRATEGIES:
        rs = [recs[s][i] for i in common]
        acc = [r["score"] for r in rs]
        diff = "-" if s == "single_step" else _fmt_interval(paired_bootstrap(acc, single))
        lines.append(f"| {s} | {100 * mean_of(acc):.1f}% | {diff} | {mean_of([r['calls'] for r in rs]):.1f} | "
                     f"{mean_of([r['prompt_tokens'] + r['completion_tokens'] for r in rs]):.0f} | "
                     f"{100 * mean_of([r['retrieved_recall'] for r in rs]):.0f}% | "
                     f"{100 * mean_of([r['context_recall'] for r in rs]):.0f}% | "
                     f"{mean_of([r['memory_points'] for r in rs]):.1f} | {mean_of([r['merges'] for r in rs]):.2f} | "
                     f"{mean_of([r['rejected'] for r in rs]):.1f} |")
    gold = {r["id"]: r for r in read_jsonl(multihop_path("gold_context"), key=lambda r: r["id"])}
    if all(i in gold for i in common):
        acc = [gold[i]["score"] for i in common]
        lines.append(f"| (diagnostic) gold sentences as the only sources | {100 * mean_of(acc):.1f}% | "
                     f"{_fmt_interval(paired_bootstrap(acc, single))} | 1.0 | - | 100% | 100% | - | - | - |")
    hg = [recs["hgmem"][i] for i in common]
    lines += ["", f"HGMem minus flat memory: {_fmt_interval(paired_bootstrap([r['score'] for r in hg], [recs['flat'][i]['score'] for i in common]))} points."]
    return lines


def _rule_scores(records: List[Dict[str, Any]], samples: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    from lightning_modules.persistbench.judges import RuleJudge

    judge = RuleJudge()
    return [dict(r, score=judge.judge(samples[r["id"]], r.get("response", "")).score) for r in records]


def persistbench_report() -> List[str]:
    from datamodules.persistbench import PersistBenchDataModule
    from lightning_modules.persistbench.metrics import cohen_kappa, fr_at_k, sample_fails

    samples = {s["id"]: s for s in PersistBenchDataModule().samples}
    rows, agree = [], []
    for prompt in PROMPTS:
        llm = read_jsonl(persist_path(prompt), key=lambda r: (r["id"], r["generation"]))
        if not llm:
            continue
        rule = _rule_scores(llm, samples)
        fr_l, fr_r = fr_at_k(llm, 3), fr_at_k(rule, 3)
        invalid = sum(r["score"] is None for r in llm) / len(llm)
        cells = []
        for t in TYPES:
            a, b = fr_r.get(t), fr_l.get(t)
            cells.append(f"{a['fr']:.0f}% ({a['samples']})" if a else "-")
            cells.append(f"{b['fr']:.0f}% ({b['samples']})" if b and not math.isnan(b["fr"]) else "-")
        rows.append(f"| {prompt} | {len(llm)} | " + " | ".join(cells) + f" | {100 * invalid:.0f}% |")
        for r_l, r_r in zip(llm, rule):
            if r_l["score"] is not None and r_r["score"] is not None:
                agree.append((sample_fails(r_l["failure_type"], [r_l["score"]]),
                              sample_fails(r_r["failure_type"], [r_r["score"]])))
    if not rows:
        return ["(no PersistBench records yet: `python -m bench.memory --parts persistbench`)"]
    lines = ["**PersistBench** (failure rate FR@3 per failure type, beneficial FR@1; samples with a valid score in "
             "brackets; rule = the rule-based judge, LLM = SmolLM2 as the rubric judge):", "",
             "| system prompt | answers | cross-domain rule | cross-domain LLM | sycophancy rule | sycophancy LLM | "
             "beneficial rule | beneficial LLM | LLM verdicts unreadable |", "|---|---|---|---|---|---|---|---|---|"]
    lines += rows
    if agree:
        a, b = [x for x, _ in agree], [y for _, y in agree]
        raw = sum(x == y for x, y in agree) / len(agree)
        lines += ["", f"Agreement of the two judges on pass / fail per answer ({len(agree)} answers both scored): "
                      f"{100 * raw:.0f}%, Cohen's kappa {cohen_kappa(a, b):.2f}."]
    return lines


def report(args) -> str:
    body = [f"`python -m bench.memory --questions {args.questions} --per-type {args.per_type}`: SmolLM2-135M-Instruct "
            "(fp32, 2 CPU cores) as the model under test, through the local chat backend; records in "
            "`results/memory_*.jsonl`.", ""] + multihop_report() + [""] + persistbench_report()
    return write_section("memory", "\n".join(body), "LLM memory: HGMem and PersistBench (SmolLM2-135M)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--parts", nargs="+", choices=["multihop", "persistbench"], default=["multihop", "persistbench"])
    p.add_argument("--questions", type=int, default=16, help="multi-hop questions (default: %(default)s)")
    p.add_argument("--per-type", type=int, default=6, help="PersistBench samples per failure type (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="PersistBench answer length (default: %(default)s)")
    p.add_argument("--judge-max-tokens", type=int, default=60, help="the LLM judge's reply cap (default: %(default)s)")
    p.add_argument("--judge-backend", default=None,
                   help="the LLM judge's backend as JSON, e.g. '{\"name\": \"openai\", \"base_url\": ...}' "
                        "(default: the local SmolLM2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    if not args.report_only:
        if "multihop" in args.parts:
            run_multihop(args)
            run_gold_context(args)
        if "persistbench" in args.parts:
            run_persistbench(args)
    print(report(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
