"""RAG on SmolLM2-135M-Instruct: does reusing independently computed chunk KV hurt (the diagnostic), ProphetKV
against every reuse baseline at 10 / 20 / 40% recomputation and against the number of distractor chains, the time
to first token with a warm store against full prefill, and Guidance against plain prompting on the citation task.

    python -m bench.rag                         # every stage (resumable: records are kept per question)
    python -m bench.rag --stages diagnostic     # one stage
    python -m bench.rag --report-only           # rewrite the docs/results.md section from the records

Stages:

* ``diagnostic`` - full prefill vs naive reuse (r = 0) on each task setting (``bindings`` styles coref / alias /
  variables, chain depths, distractors). The comparison of selectors is only meaningful where reuse costs at
  least 15 points; the first such setting (in ``SETTINGS`` order) becomes the ``main`` setting (or
  ``--main``).
* ``selectors`` - on the main setting: full, naive, random, EPIC, CacheBlend, ProphetKV and the oracle at each
  ``--ratios``: accuracy, accuracy as a share of full prefill with a 95% paired bootstrap interval, the
  ProphetKV-minus-baseline difference with its interval, and the KL of the first answer token's distribution from
  full prefill's.
* ``distractors`` - the main setting's style at each ``--distractor-sweep`` count: ProphetKV, CacheBlend and
  full at 20% (the crowding-out claim: the gap to CacheBlend grows with the distractors).
* ``ttft`` - contexts of about ``--ttft-lengths`` tokens: time to the first token with a warm store
  (ProphetKV at 20%, CacheBlend, naive) against full prefill, interleaved repeats in one process (medians).
* ``guidance`` - the citation task: plain prompting in LongBench-Cite's format against Guidance: citation
  recall, precision, F1 (lexical judge) and answer accuracy.

Records: ``results/rag_smollm2.jsonl`` (one line per stage, setting, method and question) and
``results/rag_smollm2_ttft.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence

from bench._report import REPO, pyplot, save_figure, save_json, write_section
from litctx_common.io import read_jsonl
from litctx_common.records import Arm, RecordStore, evaluate_arms

KEYS = ("stage", "setting", "method", "id")
"""What names one record: the stage, the setting, the method (the arm) and the sample."""
RESULTS = REPO / "results" / "rag_smollm2.jsonl"
TTFT = REPO / "results" / "rag_smollm2_ttft.json"
FIGURE = REPO / "docs" / "figures" / "rag_smollm2.png"
STORE = REPO / "runs" / "bench_rag" / "kv_store"
SETTINGS = {
    "variables_h1_d3": {"style": "variables", "hops": 1, "distractors": 3},
    "variables_h2_d3": {"style": "variables", "hops": 2, "distractors": 3},
    "alias_h1_d3": {"style": "alias", "hops": 1, "distractors": 3},
    "coref_d3": {"style": "coref", "hops": 1, "distractors": 3},
}
BASELINES = ("random", "epic", "cacheblend", "oracle")
GAP_MIN = 0.15


class Bench:
    def __init__(self, args) -> None:
        from lightning_modules.llm.decoding.stopping import line_stop_ids, stop_token_ids
        from lightning_modules.llm.model.loading import load_causal_lm

        self.args = args
        self.model, self.tok = load_causal_lm("smollm2-135m", dtype="float32")
        self.model.requires_grad_(False)
        self.stop = stop_token_ids(self.tok, self.model)
        self.stop_answer = line_stop_ids(self.tok, self.model)
        self.recorded = RecordStore(RESULTS, keys=KEYS, mismatch="skip").load()
        self._reusers: Dict[str, Any] = {}

    @staticmethod
    def key(r: Dict[str, Any]):
        return tuple(r[k] for k in KEYS)

    @property
    def records(self) -> List[Dict[str, Any]]:
        return self.recorded.records

    def reuser(self, selector: str, ratio: float = 0.0):
        from lightning_modules.llm.runtime.kv_store import KVSegmentStore
        from lightning_modules.prophetkv.reuse import ReuseConfig

        name = f"{selector}@{ratio}"
        if name not in self._reusers:
            if not hasattr(self, "store"):
                self.store = KVSegmentStore(str(STORE), max_bytes=int(self.args.store_gib * 2 ** 30))
            # the bench's records were made with Stage I over the whole tail; it keeps that setting so they stay
            # comparable (the claim harness, `litctx claim prophetkv`, runs the paper's question rows)
            args = {"query_span": "tail"} if selector == "prophetkv" else {}
            self._reusers[name] = ReuseConfig(selector=selector, ratio=ratio, selector_args=args).build(self.model,
                                                                                                        self.store)
        return self._reusers[name]

    def samples(self, setting: Dict[str, Any], n: int, source: str = "bindings", **extra) -> List[Dict[str, Any]]:
        from datamodules.rag_tasks import RAGDataConfig, RAGDataset

        cfg = RAGDataConfig(source=source, samples=n, seed=self.args.seed, chunk_words=self.args.chunk_words,
                            **{**setting, **extra})
        data = RAGDataset(cfg)
        return [data[i] for i in range(len(data))]

    def run_methods(self, stage: str, setting: str, samples, methods: Sequence[tuple]) -> None:
        """Each ``(method name, selector, ratio)`` on each sample (full prefill first: the KL reference)."""
        from lightning_modules.llm.eval.suite_metrics import score_prediction
        from lightning_modules.rag.pipeline import answer, answer_distribution_kl
        from lightning_modules.rag.prompts import build_prompt

        n_samples = len(samples)

        def together(sample, todo):
            s = sample["sample"]
            prompt = build_prompt(self.tok, s["documents"], s["question"], "qa")
            ref, out_recs = None, {}
            # full prefill first, always: the KL reference of every other arm
            for arm in [a for a in arms if a.name == "full"] + [a for a in todo if a.name != "full"]:
                selector, ratio = arm.settings["selector"], arm.settings["ratio"]
                out = answer(prompt, self.reuser(selector, ratio), self.tok, self.args.max_new_tokens, self.stop_answer)
                if arm.name == "full":
                    ref = out.first_logits
                    if arm not in todo:
                        continue
                out_recs[arm.name] = {"score": score_prediction(out.text, s["answers"], "any"),
                                      "kl": answer_distribution_kl(ref, out.first_logits), "ttft_s": out.ttft_s,
                                      "recomputed": out.stats.get("recomputed", [0])[0],
                                      "chunk_tokens": out.stats["chunk_tokens"][0], "prompt_tokens": len(prompt.ids),
                                      "prediction": out.text, "answers": s["answers"]}
            line = " ".join(f"{m}={r['score']:.0f}" for m, r in out_recs.items())
            print(f"[bench.rag] {stage} {setting} {sample['n'] + 1}/{n_samples} ({len(prompt.ids)} tok): {line}",
                  flush=True)
            return out_recs

        arms = [Arm(name, settings={"selector": selector, "ratio": ratio}, keys={"method": name})
                for name, selector, ratio in ([("full", "full", 0.0)] + [m for m in methods if m[0] != "full"])]
        rows = [{"stage": stage, "setting": setting, "id": s["id"], "n": i, "sample": s} for i, s in enumerate(samples)]
        wanted = {m[0] for m in methods}
        evaluate_arms([a for a in arms if a.name in wanted], rows, self.recorded, sample_key=("stage", "setting", "id"),
                      together=together)

    # ------------------------------------------------------------------ stages
    def diagnostic(self) -> None:
        """Settings in order until one shows the gap (``--diagnostic-all``: every setting)."""
        for name, setting in SETTINGS.items():
            self.run_methods("diagnostic", name, self.samples(setting, self.args.questions),
                             [("full", "full", 0.0), ("naive", "naive", 0.0)])
            gap = self.gap(name)
            if gap is not None and gap >= GAP_MIN and not self.args.diagnostic_all:
                print(f"[bench.rag] {name}: reuse costs {100 * gap:.1f} points; the selectors run here", flush=True)
                return

    def main_setting(self) -> Optional[str]:
        if self.args.main:
            return self.args.main
        for name in SETTINGS:
            gap = self.gap(name)
            if gap is not None and gap >= GAP_MIN:
                return name
        return None

    def gap(self, setting: str) -> Optional[float]:
        full = self.scores("diagnostic", setting, "full")
        naive = self.scores("diagnostic", setting, "naive")
        ids = sorted(set(full) & set(naive))
        return (sum(full[i] for i in ids) - sum(naive[i] for i in ids)) / len(ids) if ids else None

    def scores(self, stage: str, setting: str, method: str, field: str = "score") -> Dict[str, float]:
        return {r["id"]: float(r[field]) for r in self.records
                if r["stage"] == stage and r["setting"] == setting and r["method"] == method}

    def selectors(self) -> None:
        main = self.main_setting()
        if main is None:
            print("[bench.rag] no setting where reuse costs >= 15 points: the selector comparison is void", flush=True)
            return
        methods = [("full", "full", 0.0), ("naive", "naive", 0.0)]
        for ratio in self.args.ratios:
            methods += [(f"{sel}@{ratio:g}", sel, ratio) for sel in ("prophetkv",) + BASELINES]
        self.run_methods("selectors", main, self.samples(SETTINGS[main], self.args.questions), methods)

    def distractors(self) -> None:
        main = self.main_setting()
        if main is None:
            return
        base = dict(SETTINGS[main])
        for d in self.args.distractor_sweep:
            if d == base["distractors"]:
                continue  # the main setting itself: its selector-stage records serve this row
            setting = dict(base, distractors=d)
            name = f"{base['style']}_h{base['hops']}_d{d}"
            self.run_methods("distractors", name, self.samples(setting, self.args.questions),
                             [("full", "full", 0.0), ("prophetkv@0.2", "prophetkv", 0.2),
                              ("cacheblend@0.2", "cacheblend", 0.2), ("naive", "naive", 0.0)])

    def ttft(self) -> None:
        from lightning_modules.rag.prompts import build_prompt
        from litctx_common.timing import clock

        out = json.loads(TTFT.read_text()) if TTFT.is_file() else {}
        main = self.main_setting() or next(iter(SETTINGS))
        for length in self.args.ttft_lengths:
            if str(length) in out:
                continue
            setting = dict(SETTINGS[main])
            # enough distractor chains of ~chunk_words-word documents to reach the length
            per_doc = self.args.chunk_words * 1.8 + 13  # SmolLM2 tokens per generated document (measured: 85 at 40)
            docs_per_chain = 2 if setting["style"] == "coref" else setting["hops"] + 1
            setting["distractors"] = max(1, int(length / per_doc / docs_per_chain) - 1)
            s = self.samples(setting, 1)[0]
            prompt = build_prompt(self.tok, s["documents"], s["question"], "qa")
            methods = {"full": self.reuser("full"), "prophetkv@0.2": self.reuser("prophetkv", 0.2),
                       "cacheblend@0.2": self.reuser("cacheblend", 0.2), "naive": self.reuser("naive")}
            methods["prophetkv@0.2"].warm(prompt.prefix_ids, [prompt.chunk_ids])  # the warm store
            times: Dict[str, List[float]] = {k: [] for k in methods}
            for rep in range(self.args.repeats + 1):
                for name, run in methods.items():
                    t0 = clock("cpu")
                    run.prefill(prompt.prefix_ids, [prompt.chunk_ids], [prompt.question_ids])
                    if rep:  # the first round warms up
                        times[name].append(clock("cpu") - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            out[str(length)] = {"tokens": len(prompt.ids), "chunks": len(prompt.chunk_ids), "median_s": med,
                                "all_s": times, "over_full": {k: med[k] / med["full"] for k in med}}
            save_json(TTFT, out)
            print(f"[bench.rag] ttft {len(prompt.ids)} tokens: " + ", ".join(f"{k} {v:.2f}s" for k, v in med.items()),
                  flush=True)

    def guidance(self) -> None:
        try:
            from lightning_modules.guidance.config import GuidanceConfig
        except ImportError:
            print("[bench.rag] guidance is not available; stage skipped", flush=True)
            return
        from lightning_modules.guidance.longbench_cite import score_response
        from lightning_modules.llm.eval.judges import LexicalJudge
        from lightning_modules.rag.pipeline import answer
        from lightning_modules.rag.prompts import build_prompt
        from lightning_modules.llm.eval.suite_metrics import score_prediction

        judge = LexicalJudge()
        samples = self.samples({"distractors": self.args.cite_distractors}, self.args.questions, source="cite",
                               facts=1)
        guided = GuidanceConfig().build(self.tok)
        def together(sample, todo):
            s = sample["sample"]
            prompt = build_prompt(self.tok, s["documents"], s["question"], "cite")
            out_recs = {}
            for arm in todo:
                decoder = guided if arm.name == "guidance" else None
                out = answer(prompt, self.reuser("full"), self.tok, self.args.cite_tokens, self.stop, decoder)
                sc = score_response(out.text, [t for _, _, t in prompt.sentences], judge,
                                    gold=[next(g for g, (d, j, _) in enumerate(prompt.sentences)
                                               if d == x["doc"] and j == x["sentence"]) for x in s["gold"]])
                out_recs[arm.name] = {"score": score_prediction(out.text, s["answers"], "all"), **sc,
                                      "prediction": out.text, "answers": s["answers"]}
            print(f"[bench.rag] guidance {sample['n'] + 1}/{len(samples)}: " + " ".join(
                f"{m} f1={r['f1']:.2f} acc={r['score']:.2f}" for m, r in out_recs.items()), flush=True)
            return out_recs

        rows = [{"stage": "guidance", "setting": "cite", "id": s["id"], "n": i, "sample": s}
                for i, s in enumerate(samples)]
        arms = [Arm(name, keys={"method": name}) for name in ("plain", "guidance")]
        evaluate_arms(arms, rows, self.recorded, sample_key=("stage", "setting", "id"), together=together)


# ---------------------------------------------------------------------------------------------- report
def _paired(a: Dict[str, float], b: Dict[str, float]):
    from lightning_modules.llm.eval.suite_metrics import paired_bootstrap

    ids = sorted(set(a) & set(b))
    if not ids:
        return None
    return paired_bootstrap([a[i] for i in ids], [b[i] for i in ids]), len(ids)


def report(records: List[Dict[str, Any]], args) -> str:
    def scores(stage, setting, method, field="score"):
        return {r["id"]: float(r[field]) for r in records if r["stage"] == stage and r["setting"] == setting
                and r["method"] == method and r.get(field) is not None}

    def mean(d):
        return sum(d.values()) / len(d) if d else float("nan")

    lines = [f"`python -m bench.rag --questions {args.questions} --seed {args.seed}`: SmolLM2-135M-Instruct (fp32, "
             f"2 CPU cores), generated multi-document QA (`datamodules/rag_tasks.py`: {args.chunk_words}-word "
             "documents of documentation prose, the answer bound across documents), greedy answers of at most "
             f"{args.max_new_tokens} tokens, accuracy = the code appears in the answer. One seed; intervals are 95% "
             "paired bootstrap over questions.", "", "**Does reuse hurt?** (full prefill vs naive reuse)", "",
             "| setting | n | full prefill | naive reuse | gap (points) |", "|---|---|---|---|---|"]
    settings = [s for s in SETTINGS if scores("diagnostic", s, "full")]
    for s in settings:
        full, naive = scores("diagnostic", s, "full"), scores("diagnostic", s, "naive")
        res = _paired(naive, full)
        gap = f"{-100 * res[0]['diff']:+.1f} [{-100 * res[0]['hi']:+.1f}, {-100 * res[0]['lo']:+.1f}]" if res else "-"
        lines.append(f"| {s} | {len(full)} | {100 * mean(full):.1f}% | {100 * mean(naive):.1f}% | {gap} |")
    sel = [r for r in records if r["stage"] == "selectors"]
    if sel:
        main = sel[0]["setting"]
        full = scores("selectors", main, "full")
        lines += ["", f"**Selectors** on `{main}` ({len(full)} questions; full prefill {100 * mean(full):.1f}%):", "",
                  "| method | accuracy | % of full prefill | ProphetKV minus this method (points) | KL from full "
                  "(nats) | tokens recomputed |", "|---|---|---|---|---|---|"]
        methods = sorted({r["method"] for r in sel}, key=lambda m: (m.split("@")[-1] if "@" in m else "", m))
        for m in methods:
            sc = scores("selectors", main, m)
            kl = scores("selectors", main, m, "kl")
            rec = scores("selectors", main, m, "recomputed")
            ratio = m.split("@")[1] if "@" in m else None
            vs = "-"
            if ratio and not m.startswith("prophetkv"):
                res = _paired(scores("selectors", main, f"prophetkv@{ratio}"), sc)
                if res:
                    vs = f"{100 * res[0]['diff']:+.1f} [{100 * res[0]['lo']:+.1f}, {100 * res[0]['hi']:+.1f}]"
            pct = 100 * mean(sc) / mean(full) if mean(full) > 0 else float("nan")
            lines.append(f"| {m} | {100 * mean(sc):.1f}% | {pct:.0f}% | {vs} | {mean(kl):.3f} | {mean(rec):.0f} |")
    dis = [r for r in records if r["stage"] == "distractors"]
    if dis:
        lines += ["", "**Distractor chains** (20% recomputation):", "",
                  "| setting | n | full | ProphetKV | CacheBlend | naive | ProphetKV - CacheBlend (points) |",
                  "|---|---|---|---|---|---|---|"]
        rows = {r["setting"]: "distractors" for r in dis}
        if sel:
            rows[sel[0]["setting"]] = "selectors"
        for s in sorted(rows, key=lambda x: int(x.rsplit("_d", 1)[1])):
            f, p, c, n = (scores(rows[s], s, m) for m in ("full", "prophetkv@0.2", "cacheblend@0.2", "naive"))
            res = _paired(p, c)
            d = f"{100 * res[0]['diff']:+.1f} [{100 * res[0]['lo']:+.1f}, {100 * res[0]['hi']:+.1f}]" if res else "-"
            lines.append(f"| {s} | {len(f)} | {100 * mean(f):.1f}% | {100 * mean(p):.1f}% | {100 * mean(c):.1f}% | "
                         f"{100 * mean(n):.1f}% | {d} |")
    if TTFT.is_file():
        t = json.loads(TTFT.read_text())
        lines += ["", "**Time to first token** with a warm store (medians of interleaved repeats, after one warm-up "
                      "round):", "",
                  "| prompt tokens | repeats | full prefill (s) | ProphetKV@0.2 (s) | CacheBlend@0.2 (s) | naive reuse (s) |",
                  "|---|---|---|---|---|---|"]
        for length in sorted(t, key=lambda key: (t[key]["tokens"], len(t[key]["all_s"]["full"]))):
            m, o = t[length]["median_s"], t[length]["over_full"]
            lines.append(f"| {t[length]['tokens']} | {len(t[length]['all_s']['full'])} | {m['full']:.2f} | "
                         f"{m['prophetkv@0.2']:.2f} "
                         f"({o['prophetkv@0.2']:.2f}x) | {m['cacheblend@0.2']:.2f} ({o['cacheblend@0.2']:.2f}x) | "
                         f"{m['naive']:.2f} ({o['naive']:.2f}x) |")
    g = [r for r in records if r["stage"] == "guidance"]
    if g:
        lines += ["", "**Guidance** on the citation task (lexical judge; answer accuracy = the asked facts appear):", "",
                  "| decoding | n | citation recall | precision | F1 | answer accuracy |", "|---|---|---|---|---|---|"]
        for m in ("plain", "guidance"):
            vals = {k: scores("guidance", "cite", m, k) for k in ("recall", "precision", "f1", "score")}
            lines.append(f"| {m} | {len(vals['f1'])} | {mean(vals['recall']):.3f} | {mean(vals['precision']):.3f} | "
                         f"{mean(vals['f1']):.3f} | {100 * mean(vals['score']):.1f}% |")
        res = _paired(scores("guidance", "cite", "guidance", "f1"), scores("guidance", "cite", "plain", "f1"))
        if res:
            lines.append(f"\nGuidance - plain citation F1: {res[0]['diff']:+.3f} [{res[0]['lo']:+.3f}, "
                         f"{res[0]['hi']:+.3f}] (n={res[1]}).")
    return "\n".join(lines)


def figure(records: List[Dict[str, Any]]) -> None:
    plt = pyplot()
    sel = [r for r in records if r["stage"] == "selectors"]
    if plt is None or not sel:
        return
    main = sel[0]["setting"]
    full = [r["score"] for r in sel if r["method"] == "full"]
    base = sum(full) / len(full) if full else 1.0
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for sel_name in ("prophetkv",) + BASELINES:
        pts = []
        for m in sorted({r["method"] for r in sel if r["method"].startswith(sel_name + "@")}):
            ratio = float(m.split("@")[1])
            sc = [r["score"] for r in sel if r["method"] == m]
            pts.append((ratio, 100 * (sum(sc) / len(sc)) / base if base else 0))
        if pts:
            ax.plot(*zip(*sorted(pts)), marker="o", label=sel_name)
    naive = [r["score"] for r in sel if r["method"] == "naive"]
    if naive:
        ax.axhline(100 * (sum(naive) / len(naive)) / base if base else 0, ls="--", color="gray", label="naive reuse")
    ax.axhline(100, color="black", lw=0.8)
    ax.set_xlabel("share of chunk tokens recomputed")
    ax.set_ylabel("accuracy (% of full prefill)")
    ax.set_title(main)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, FIGURE)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rag", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", nargs="+", default=["diagnostic", "selectors", "ttft", "guidance", "distractors"])
    parser.add_argument("--questions", type=int, default=50, help="questions per setting")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk-words", type=int, default=40, help="filler words per document")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    parser.add_argument("--distractor-sweep", type=int, nargs="+", default=[1, 3, 7])
    parser.add_argument("--diagnostic-all", action="store_true", help="run the diagnostic on every setting")
    parser.add_argument("--main", default=None, help="the setting of the selector stages (default: the diagnostic's)")
    parser.add_argument("--ttft-lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cite-distractors", type=int, default=3)
    parser.add_argument("--cite-tokens", type=int, default=96)
    parser.add_argument("--store-gib", type=float, default=4.0)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    if not args.report_only:
        bench = Bench(args)
        for stage in args.stages:
            getattr(bench, stage)()
    records = read_jsonl(RESULTS, key=Bench.key)
    body = report(records, args)
    figure(records)
    write_section("rag", body + (f"\n\n![RAG selectors](figures/{FIGURE.name})" if FIGURE.is_file() else ""),
                  "RAG: KV reuse (ProphetKV vs baselines) and Guidance (SmolLM2-135M)")
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
