"""KV-cache eviction on the long-context suite with SmolLM2-135M-Instruct: every baseline and its OBCache
variant side by side with the full cache, at several compression ratios, lengths and both protocols.

    python -m bench.kv_eviction                        # run (or continue) and write docs/results.md
    python -m bench.kv_eviction --report-only          # rewrite the section from the records so far
    python -m bench.kv_eviction --samples 2 --lengths 2048 --ratios 0.75 --protocols compress_then_ask

Each sample's context is prefilled once; every (method, ratio) then compresses that same prefill
(:func:`~lightning_modules.llm.decoding.generate.generate_under_policies`, identical to running the method alone),
asks the question and decodes greedily, all (method, ratio) pairs as rows of one batch (``--unbatched``: one by
one). Records go to ``results/kv_eviction_smollm2.jsonl`` one per
(sample, protocol, method, ratio), so a rerun resumes. Reported:

* accuracy per method x ratio, per length and protocol (mean over samples and tasks);
* OBCache minus its attention-score base, paired by sample, with a 95% paired bootstrap interval;
* KV bytes after compression relative to the full cache; decode tokens/s against the full cache on a fixed
  32-token decode at the longest length (``--throughput-samples`` samples; ``--throughput-only`` runs just this
  part), H2O, TOVA and StreamingLLM with both compactions of their per-step eviction (in place, the default, and
  gathering the cache: :class:`~lightning_modules.llm.kv_policy.protocol.Schedule`);
* Spearman correlation of each score with the measured output change of removing a token, on attention
  captured from SmolLM2 (all layers, the last 32 prompt queries).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

from bench._report import REPO, pyplot, save_figure, save_json, write_section

from litctx_common.io import read_jsonl
from litctx_common.timing import clock
from litctx_common.stats import mean_of

RESULTS = REPO / "results" / "kv_eviction_smollm2.jsonl"
FIGURE = REPO / "docs" / "figures" / "kv_eviction_smollm2.png"
TASKS = ["niah_single", "niah_multikey", "niah_multivalue", "qa_facts"]
OBC = "obcache_kv"
# label -> (method name, config fields without the budget; policy_grid sets each ratio); "+obc" variants swap the score
METHODS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "random": ("random_eviction", {}),
    "recent": ("recent_eviction", {}),
    "streaming_llm": ("streaming_llm", {"sink": 4}),
    "h2o": ("h2o", {}),
    "h2o+obc": ("h2o", {"score": OBC}),
    "snapkv": ("snapkv", {"window": 32}),
    "snapkv+obc": ("snapkv", {"window": 32, "score": OBC}),
    "tova": ("tova", {}),
    "tova+obc": ("tova", {"score": OBC}),
    "adakv": ("adakv", {"base": "snapkv", "base_args": {"window": 32}}),
    "adakv+obc": ("adakv", {"base": "snapkv", "base_args": {"window": 32, "score": OBC}}),
}
# the decode-throughput part: the methods that evict at every decode step run with both compactions
THROUGHPUT: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "snapkv": METHODS["snapkv"],
    "streaming_llm": METHODS["streaming_llm"],
    "streaming_llm (gather)": ("streaming_llm", {"sink": 4, "compaction": "gather"}),
    "h2o": METHODS["h2o"],
    "h2o (gather)": ("h2o", {"compaction": "gather"}),
    "tova": METHODS["tova"],
    "tova (gather)": ("tova", {"compaction": "gather"}),
    "adakv": METHODS["adakv"],
}
PAIRS = [("h2o", "h2o+obc"), ("snapkv", "snapkv+obc"), ("tova", "tova+obc"), ("adakv", "adakv+obc")]
COLORS = {"random": "0.6", "recent": "tab:brown", "streaming_llm": "tab:green", "h2o": "tab:red", "snapkv": "tab:blue",
          "tova": "tab:orange", "adakv": "tab:purple"}  # a base and its OBCache variant share a colour


def read_records(path: Path) -> List[Dict[str, Any]]:
    """One record per (sample, protocol, method, ratio, kind); a line cut by a kill is skipped (that run repeats)."""
    return read_jsonl(path, key=lambda r: (r["id"], r["protocol"], r["method"], r["ratio"], r.get("kind", "suite")))


def suite_arms(args) -> Tuple[List[Any], Dict[str, Any]]:
    """The arms of the suite part (one per (method, ratio), the full cache first) and their policies by name."""
    from lightning_modules.kv_eviction.config import policy_grid
    from litctx_common.records import Arm

    policies = policy_grid(METHODS, args.ratios)
    arms = [Arm(f"{m}@{r}", settings={"method": list(METHODS.get(m, ("full", {}))), "ratio": r},
                keys={"method": m, "ratio": r}) for m, r in policies]
    return arms, {f"{m}@{r}": pol for (m, r), pol in policies.items()}


def run_suite(args, model, tok) -> None:
    """Every (method, ratio) on every sample, into the records store (:func:`litctx_common.records.evaluate_arms`):
    each sample's context is prefilled once and the arms still missing on it are decoded together."""
    from datamodules.longctx_tasks import Haystack, build_sample
    from datamodules.text import pydoc_documents
    from lightning_modules.llm.decoding.generate import record_prefill
    from lightning_modules.llm.decoding.stopping import stop_token_ids
    from lightning_modules.llm.eval.suite_metrics import score_prediction
    from litctx_common.records import RecordStore, evaluate_arms

    arms, policies = suite_arms(args)
    haystack = Haystack(pydoc_documents(), tok)
    stops = stop_token_ids(tok, model)
    samples = [{"id": f"{t}-{n}-{i}", "protocol": p, "kind": "suite", "task": t, "length": n, "index": i}
               for p in args.protocols for n in args.lengths for i in range(args.samples) for t in args.tasks]
    t_start = clock(model.device)

    def together(sample, todo):
        s = build_sample(sample["task"], sample["length"], sample["index"], haystack, tok, 0)
        ctx, q = s["context_ids"].unsqueeze(0), s["question_ids"].unsqueeze(0)
        if sample["protocol"] == "query_aware":
            ctx, q = torch_cat(ctx, q), None
        rec = record_prefill(model, ctx)
        results = {}
        # rows of one batch are padded to the longest: one batch per ratio, the full cache on its own
        for ratio in sorted({a.keys["ratio"] for a in todo}):
            group = {a.name: policies[a.name] for a in todo if a.keys["ratio"] == ratio}
            results.update(rec.generate(group, s["max_new_tokens"], stops, q, None,
                                        batched=not args.unbatched and ratio > 0 and len(group) > 1))
        out = {}
        for a in todo:
            res = results[a.name]
            text = tok.decode(res.tokens[0], skip_special_tokens=True)
            out[a.name] = {"task": sample["task"], "length": sample["length"], "depth": s["depth"],
                           "score": score_prediction(text, s["answers"], s["metric"]), "prediction": text,
                           "compressed_bytes": res.compressed_bytes, "cache_bytes": res.cache_bytes,
                           "compress_s": res.compress_seconds, "decode_s": res.decode_seconds,
                           "decode_steps": res.decode_steps, "prefill_s": res.prefill_seconds}
        full = out.get("full@0.0", {}).get("score", float("nan"))
        print(f"[{samples.index(sample) + 1}/{len(samples)}] {sample['protocol']} {sample['id']}: {len(todo)} runs, "
              f"full={full:.2f} ({(clock(model.device) - t_start) / 60:.1f} min so far)", flush=True)
        return out

    store = RecordStore(args.results, keys=("id", "protocol", "kind", "method", "ratio"), mismatch="skip").load()
    evaluate_arms(arms, samples, store, sample_key=("id", "protocol", "kind"), together=together)


def torch_cat(a, b):
    import torch

    return torch.cat([a, b], dim=1)


def run_throughput(args, model, tok) -> None:
    """Decode tokens/s on a fixed 32-token greedy decode (no stop token) at the longest length."""
    from datamodules.longctx_tasks import Haystack, build_sample
    from datamodules.text import pydoc_documents
    from lightning_modules.kv_eviction.config import policy_grid
    from lightning_modules.llm.decoding.generate import generate_under_policies
    from litctx_common.records import Arm, RecordStore, evaluate_arms

    length = max(args.lengths)
    haystack = Haystack(pydoc_documents(), tok)
    policies = {f"{m}@{r}": p for (m, r), p in policy_grid(THROUGHPUT, args.ratios).items()}
    arms = [Arm(name, settings={"method": list(THROUGHPUT.get(name.rsplit("@", 1)[0], ("full", {})))},
                keys={"method": name.rsplit("@", 1)[0], "ratio": float(name.rsplit("@", 1)[1])}) for name in policies]
    samples = [{"id": f"niah_single-{length}-{i}", "index": i, "kind": "throughput", "protocol": "compress_then_ask"}
               for i in range(args.throughput_samples)]

    def together(sample, todo):
        s = build_sample("niah_single", length, sample["index"], haystack, tok, 0)
        res = generate_under_policies(model, s["context_ids"].unsqueeze(0), None,
                                      {a.name: policies[a.name] for a in todo}, 33, (),
                                      s["question_ids"].unsqueeze(0), None)
        print(f"throughput sample {sample['index'] + 1}/{args.throughput_samples} done", flush=True)
        return {a.name: {"length": length, "decode_s": res[a.name].decode_seconds,
                         "decode_steps": res[a.name].decode_steps, "compressed_bytes": res[a.name].compressed_bytes,
                         "cache_bytes": res[a.name].cache_bytes} for a in todo}

    store = RecordStore(args.results, keys=("id", "protocol", "kind", "method", "ratio"), mismatch="skip").load()
    evaluate_arms(arms, samples, store, sample_key=("id", "protocol", "kind"), together=together)


def run_rank_quality(model, tok) -> Dict[str, Any]:
    """Spearman of each score with the measured removal change, on SmolLM2's prefill attention."""
    import torch

    from datamodules.text import pydoc_documents
    from litctx_kernels.reference import attention_colstats_reference
    from lightning_modules.kv_eviction.scores import SCORE_KINDS, token_scores
    from lightning_modules.llm.runtime.cached_lm import CachedLM
    from lightning_modules.llm.kv_policy.protocol import KVPolicy
    from lightning_modules.llm.kv_policy.runner import install_policy

    ids = tok(" ".join(pydoc_documents()[-40:]), return_tensors="pt").input_ids[:, :512]
    lm = CachedLM(model)
    with install_policy(model, KVPolicy(), record_prefill=True) as rec:
        lm.feed(ids)
    w = 32

    def ranks(x):
        return x.double().argsort(-1).argsort(-1).double()

    per_layer = {k: [] for k in SCORE_KINDS}
    for layer, obs in sorted(rec.prefill_observations.items()):
        q, k, v = obs.q.double(), obs.k.double(), obs.v.double()
        g = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        n = k.shape[2]
        z = q[:, :, -w:] @ kk.transpose(-1, -2) * obs.scale
        live = torch.arange(n).view(1, -1) <= torch.arange(n - w, n).view(-1, 1)
        o = torch.softmax(z.masked_fill(~live, -math.inf), -1) @ vv
        measured = torch.zeros(q.shape[1], n, dtype=torch.float64)
        for start in range(0, n, 64):  # removal of token p for p in a chunk, exact recomputation
            ps = torch.arange(start, min(n, start + 64))
            keep = live.unsqueeze(1) & (torch.arange(n).view(1, 1, -1) != ps.view(1, -1, 1))  # [w, P, N]
            zz = z[0].unsqueeze(2).masked_fill(~keep.unsqueeze(0), -math.inf)  # [H, w, P, N]
            om = torch.nan_to_num(torch.softmax(zz, -1)) @ vv[0].unsqueeze(1)  # [H, w, P, d]
            measured[:, ps] = (om - o[0].unsqueeze(2)).pow(2).sum(-1).sum(1)
        stats = attention_colstats_reference(q, k, v, scale=obs.scale, q_window=w, moments="logit")
        rm = ranks(measured)
        for kind in SCORE_KINDS:
            rs = ranks(token_scores(stats, v, kind)[0])
            a, b = rs - rs.mean(-1, keepdim=True), rm - rm.mean(-1, keepdim=True)
            rho = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
            per_layer[kind].append(float(rho.mean()))
    return {k: {"mean": sum(v) / len(v), "min": min(v), "max": max(v), "layers": len(v)} for k, v in per_layer.items()}


# ---------------------------------------------------------------------------------------------- report
def _verdict(bs: Dict[str, float]) -> str:
    """Whether a bootstrap interval of (OBCache - base) excludes zero, and on which side."""
    return "**holds**" if bs["lo"] > 0 else ("reversed" if bs["hi"] < 0 else "not resolved")


def pooled_obcache_rows(by: Dict[Tuple, Dict[str, Dict[str, Any]]], args) -> List[str]:
    """Markdown rows: each OBCache variant minus its base (and all four together), one difference per
    (protocol, length, sample) averaged over the compression ratios (and pairs), bootstrapped over those units."""
    from lightning_modules.llm.eval.suite_metrics import paired_bootstrap

    def unit_diffs(pairs):
        units = {}
        for protocol in args.protocols:
            for length in args.lengths:
                for base, obc in pairs:
                    for r in args.ratios:
                        a, b = by.get((protocol, length, obc, r), {}), by.get((protocol, length, base, r), {})
                        for i in sorted(set(a) & set(b)):
                            units.setdefault((protocol, length, i), []).append(a[i]["score"] - b[i]["score"])
        return [mean_of(v) for v in units.values()]

    rows = []
    for label, pairs in [(f"{obc} - {base}", [(base, obc)]) for base, obc in PAIRS] + [("all four", list(PAIRS))]:
        d = unit_diffs(pairs)
        if not d:
            continue
        bs = paired_bootstrap(d, [0.0] * len(d), seed=1)
        rows.append(f"| {label} | {100 * bs['diff']:+.2f} [{100 * bs['lo']:+.2f}, {100 * bs['hi']:+.2f}] {_verdict(bs)} "
                    f"| {len(d)} |")
    return ["| OBCache vs base | accuracy points | units |", "|---|---|---|"] + rows if rows else []


def report(args, rank_quality) -> str:
    from lightning_modules.llm.eval.suite_metrics import paired_bootstrap

    records = read_records(args.results)
    recs = [r for r in records if r.get("kind", "suite") == "suite" and r["task"] in args.tasks
            and r["length"] in args.lengths and int(r["id"].rsplit("-", 1)[1]) < args.samples]
    by = {}
    for r in recs:
        by.setdefault((r["protocol"], r["length"], r["method"], r["ratio"]), {})[r["id"]] = r
    sections = []
    plt = pyplot()
    panels = [(p, n) for p in args.protocols for n in args.lengths]
    fig = None
    if plt is not None and recs:
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for pi, (protocol, length) in enumerate(panels):
        full = by.get((protocol, length, "full", 0.0), {})
        if not full:
            continue
        header = "| method | " + " | ".join(f"{int(100 * r)}% evicted" for r in args.ratios) + " |"
        rows = [header, "|---|" + "---|" * len(args.ratios),
                "| full cache | " + " | ".join(f"{100 * mean_of([x['score'] for x in full.values()]):.1f} (n={len(full)})"
                                                for _ in args.ratios) + " |"]
        for m in METHODS:
            cells = []
            for r in args.ratios:
                cell = by.get((protocol, length, m, r), {})
                cells.append(f"{100 * mean_of([x['score'] for x in cell.values()]):.1f}" if cell else "-")
            rows.append(f"| {m} | " + " | ".join(cells) + " |")
        pair_rows = ["| OBCache vs base | " + " | ".join(f"{int(100 * r)}% evicted" for r in args.ratios) + " |",
                     "|---|" + "---|" * len(args.ratios)]
        for base, obc in PAIRS:
            cells = []
            for r in args.ratios:
                a, b = by.get((protocol, length, obc, r), {}), by.get((protocol, length, base, r), {})
                ids = sorted(set(a) & set(b))
                if not ids:
                    cells.append("-")
                    continue
                bs = paired_bootstrap([a[i]["score"] for i in ids], [b[i]["score"] for i in ids], seed=1)
                cells.append(f"{100 * bs['diff']:+.1f} [{100 * bs['lo']:+.1f}, {100 * bs['hi']:+.1f}] {_verdict(bs)}")
            pair_rows.append(f"| {obc} - {base} | " + " | ".join(cells) + " |")
        mem_rows = ["| method | " + " | ".join(f"{int(100 * r)}% evicted" for r in args.ratios) + " |",
                    "|---|" + "---|" * len(args.ratios)]
        full_bytes = {i: x["compressed_bytes"] for i, x in full.items()}
        for m in ("streaming_llm", "h2o", "snapkv", "tova", "adakv"):
            cells = []
            for r in args.ratios:
                cell = by.get((protocol, length, m, r), {})
                fr = [x["compressed_bytes"] / full_bytes[i] for i, x in cell.items() if i in full_bytes]
                cells.append(f"{100 * mean_of(fr):.1f}%" if fr else "-")
            mem_rows.append(f"| {m} | " + " | ".join(cells) + " |")
        sections.append(f"**{protocol}, {length // 1024}K tokens** (accuracy %, mean over {len(args.tasks)} tasks)\n\n"
                        + "\n".join(rows) + "\n\nOBCache (`obcache_kv`) minus its base, accuracy points, paired by "
                        "sample, 95% bootstrap interval:\n\n" + "\n".join(pair_rows)
                        + "\n\nKV bytes right after compression, relative to the full cache:\n\n" + "\n".join(mem_rows))
        if fig is not None:
            ax = axes[0][pi]
            ax.axhline(100 * mean_of([x["score"] for x in full.values()]), color="k", lw=1, ls="--", label="full")
            for m in METHODS:
                ys = [100 * mean_of([x["score"] for x in by.get((protocol, length, m, r), {}).values()]) for r in args.ratios]
                ax.plot([100 * r for r in args.ratios], ys, marker="o" if "+obc" in m else "x", lw=1.2,
                        ls="-" if "+obc" in m else ":", color=COLORS[m.split("+")[0]], label=m)
            ax.set_title(f"{protocol}, {length // 1024}K")
            ax.set_xlabel("% of the KV cache evicted")
            ax.set_ylabel("accuracy %")
    if fig is not None:
        axes[0][-1].legend(fontsize=6, loc="lower left")
        fig.tight_layout()
        save_figure(fig, FIGURE if args.results == RESULTS else args.results.with_suffix(".png"))
    pooled = pooled_obcache_rows(by, args)
    if pooled:
        sections.append("**OBCache minus its base, pooled over protocols, lengths and compression ratios** (each "
                        "sample's difference averaged over the cells it appears in, then bootstrapped over samples, "
                        "so one sample counts once per protocol and length; 95% interval):\n\n" + "\n".join(pooled))
    thr = [r for r in records if r.get("kind") == "throughput"]
    thr_rows = []
    if thr:
        full_tps = {r["id"]: r["decode_steps"] / r["decode_s"] for r in thr if r["method"] == "full"}
        thr_rows = ["| method | evicted | decode tokens/s | x full cache | KV bytes vs full |", "|---|---|---|---|---|"]
        thr_rows.append(f"| full cache | 0% | {mean_of(list(full_tps.values())):.1f} | 1.00 | 100% |")
        full_b = {r["id"]: r["compressed_bytes"] for r in thr if r["method"] == "full"}
        for m in THROUGHPUT:
            for r in args.ratios:
                cell = [x for x in thr if x["method"] == m and x["ratio"] == r and x["id"] in full_tps]
                if not cell:
                    continue
                tps = [x["decode_steps"] / x["decode_s"] for x in cell]
                ratio = sorted(t / full_tps[x["id"]] for t, x in zip(tps, cell))
                mem = mean_of([x["compressed_bytes"] / full_b[x["id"]] for x in cell])
                thr_rows.append(f"| {m} | {int(100 * r)}% | {mean_of(tps):.1f} | {ratio[len(ratio) // 2]:.2f} "
                                f"(min {ratio[0]:.2f}) | {100 * mem:.1f}% |")
    rq = ""
    if rank_quality:
        rq = ("Spearman correlation of each score with the measured output change of removing one token (key and "
              "value), per query head over the last 32 prompt queries, SmolLM2 on a 512-token pydoc prompt, mean "
              "over heads then layers (min / max over layers):\n\n| score | Spearman | min | max |\n|---|---|---|---|\n"
              + "\n".join(f"| {k} | {v['mean']:.3f} | {v['min']:.3f} | {v['max']:.3f} |" for k, v in rank_quality.items()))
    n_per = args.samples * len(args.tasks)
    expected = n_per * len(args.lengths) * len(args.protocols) * (1 + len(METHODS) * len(args.ratios))
    status = ("complete" if len(recs) >= expected else
              f"**partial**: {len(recs)} of {expected} suite runs so far; resumable")
    body = f"""Command: `python -m bench.kv_eviction` ({status}; SmolLM2-135M-Instruct fp32, greedy, suite seed 0; tasks
{', '.join(args.tasks)} with {args.samples} samples each = {n_per} samples per cell; one prefill per sample
shared by every method, which then compresses it exactly as when installed alone). Budgets are per KV head and
include sinks / windows / recent tokens; H2O, TOVA and StreamingLLM also evict at every decode step (in place by
default; the `(gather)` rows rebuild the cache at every step, the previous behaviour). OBCache
variants use the joint score `obcache_kv` in place of the attention score, in the same machinery.

{chr(10).join(s + chr(10) for s in sections)}
{'Decode throughput at ' + str(max(args.lengths) // 1024) + 'K (compress-then-ask, 32 greedy tokens without a stop, ' + str(args.throughput_samples) + ' samples; median ratio per sample against the full cache in the same run):' if thr_rows else ''}

{chr(10).join(thr_rows)}

{rq}

{'![accuracy against compression](figures/kv_eviction_smollm2.png)' if recs else ''}
"""
    if args.results != RESULTS:  # a side run (smoke test): print only
        return body
    return write_section("kv_eviction", body,
                         "KV-cache eviction: SmolLM2-135M-Instruct (StreamingLLM, H2O, SnapKV, TOVA, AdaKV, OBCache)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=13, help="samples per task (4 tasks -> 52 per cell)")
    parser.add_argument("--tasks", nargs="+", default=TASKS)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75, 0.9])
    parser.add_argument("--protocols", nargs="+", default=["compress_then_ask", "query_aware"])
    parser.add_argument("--throughput-samples", type=int, default=5)
    parser.add_argument("--report-only", action="store_true", help="only rewrite the report from saved records")
    parser.add_argument("--throughput-only", action="store_true",
                        help="run only the decode-throughput part (then rewrite the report from every record)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--unbatched", action="store_true",
                        help="decode each (method, ratio) separately instead of as rows of one batch (slower; the "
                             "throughput part is always unbatched)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="records file (another path: a side run whose report is printed, not written)")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from lightning_modules.llm.model.loading import load_causal_lm

    model, tok = load_causal_lm("smollm2-135m")
    model.requires_grad_(False)
    rq_path = args.results.with_name(args.results.stem + "_rank_quality.json")
    if not args.report_only:
        with torch.no_grad():
            if not rq_path.is_file():
                save_json(rq_path, run_rank_quality(model, tok))
            run_throughput(args, model, tok)
            if not args.throughput_only:
                run_suite(args, model, tok)
    rank_quality = json.loads(rq_path.read_text()) if rq_path.is_file() else None
    print(report(args, rank_quality))
    return 0


if __name__ == "__main__":
    sys.exit(main())
