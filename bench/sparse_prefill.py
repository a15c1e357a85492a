"""Sparse prefill: SALE and Prism against block-selection baselines (mean pooling, XAttention, FlexPrefill) and
dense attention.

    python -m bench.sparse_prefill                         # every part, then docs/results.md
    python -m bench.sparse_prefill --parts synthetic       # (a) only
    python -m bench.sparse_prefill --report-only

(a) **synthetic**: structured heads with RoPE (slash, local, sink, needle, diffuse; SmolLM2's head size 64 and
    RoPE base 1e5) at N = 4K and 8K; each method's knob swept; density against relative output error and
    attention recall, and the error interpolated at equal density.
(a') **spectral**: Prism's blind spot on ``attenuated_slash`` heads (a slash carried by the pairs pooling
    attenuates, a pedestal on the slow pairs) under three RoPE configurations: how often each estimate's top
    block is the slash's, and Prism against mean pooling at exactly Prism's per-row block budget.
(b) **suite**: SmolLM2-135M-Instruct on the long-context suite at 4K and 8K (query-aware: the whole prompt is one
    prefill), accuracy against density per method and setting; records resumable in
    ``results/sparse_prefill_suite.jsonl``.
(c) **timing**: one 8K prompt's per-layer q, k, v; CPU time of dense SDPA against each method's estimate +
    sparse attention, and the estimate as a fraction of dense attention time; with a SALE method, also the floor
    of SALE's estimate on this machine (its integer GEMM alone, exact int8) and the best speed-up it leaves.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Tuple

from bench._report import REPO, pyplot, save_figure, save_json, write_section

from litctx_common.io import read_jsonl
from litctx_common.timing import time_call

RESULTS = REPO / "results"
SYNTH = RESULTS / "sparse_prefill_synthetic.json"
SUITE = RESULTS / "sparse_prefill_suite.jsonl"
TIMING = RESULTS / "sparse_prefill_timing.json"
SPECTRAL = RESULTS / "sparse_prefill_spectral.json"
FIGURE = REPO / "docs" / "figures" / "sparse_prefill_synthetic.png"
TASKS = ["niah_single", "niah_multikey", "niah_multivalue", "qa_facts"]
DEFAULT_SAMPLES = 13
KNOBS = [0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999]
SALE_TAUS = [0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.004, 0.001, 0.0002]


def estimators(block: int = 64) -> Dict[str, List[Tuple[float, Any]]]:
    """Method -> [(knob, estimator)] sweeps for the synthetic part (every other field at its config default;
    FlexPrefill's exact slice is one block)."""
    from lightning_modules.sparse_prefill.config import (
        FlexPrefillConfig,
        MeanPoolConfig,
        PrismConfig,
        SALEConfig,
        XAttentionConfig,
    )

    return {
        "mean_pool": [(p, MeanPoolConfig(block=block, top_p=p).estimator()) for p in KNOBS],
        "prism": [(p, PrismConfig(block=block, top_p=p).estimator()) for p in KNOBS],
        "xattention": [(p, XAttentionConfig(block=block, threshold=p).estimator()) for p in KNOBS],
        "flexprefill": [(p, FlexPrefillConfig(block=block, gamma=p, last_q=block).estimator()) for p in KNOBS],
        "sale": [(t, SALEConfig(tau=t).estimator()) for t in SALE_TAUS],
    }


def run_synthetic(args) -> Dict[str, Any]:
    import litctx_kernels
    from litctx_kernels.flops import layout_pairs, mask_pairs
    from lightning_modules.sparse_prefill.attention import sparse_prefill_attention
    from lightning_modules.sparse_prefill.metrics import attention_recall, block_attention_mass, relative_output_error
    from lightning_modules.sparse_prefill.synthetic import HEAD_KINDS, structured_heads

    rows = []
    d = 64
    scale = d ** -0.5
    for n in args.lengths:
        for seed in range(args.seeds):
            q, k, v, info = structured_heads(HEAD_KINDS, n=n, d=d, base=1e5, seed=seed)
            ref, _ = litctx_kernels.attention(q, k, v, scale=scale, causal=True)
            masses = {}
            for method, sweep in estimators().items():
                for knob, est in sweep:
                    o, _, stats = sparse_prefill_attention(q, k, v, est, scale)
                    layout = est.select(q, k, v, scale).layout
                    dens = (layout_pairs(layout) / mask_pairs(n, n))[0].tolist()
                    key = (layout.block_q, layout.block_k)
                    if key not in masses:
                        masses[key] = block_attention_mass(q, k, scale, *key)
                    rec = attention_recall(masses[key], layout)[0].tolist()
                    err = relative_output_error(o, ref)[0].tolist()
                    for h, kind in enumerate(HEAD_KINDS):
                        rows.append({"n": n, "seed": seed, "kind": kind, "method": method, "knob": knob,
                                     "density": dens[h], "error": err[h], "recall": rec[h],
                                     "estimate_s": stats.estimate_seconds})
            print(f"synthetic n={n} seed={seed}: done", flush=True)
    return {"rows": rows, "lengths": args.lengths, "seeds": args.seeds}


def _best_within(points: List[Tuple[float, float]], budget: float) -> float:
    """The lowest error among (density, error) points with density <= ``budget`` (nan when none)."""
    errors = [e for dens, e in points if dens <= budget + 1e-12]
    return min(errors) if errors else float("nan")


def cell_value(rows: List[Dict[str, Any]], data: Dict[str, Any], kind: str, method: str, budget: float) -> float:
    """Mean over lengths and seeds of the lowest error ``method`` reaches within ``budget`` on ``kind`` heads
    (nan when it never gets that sparse in any run)."""
    vals = []
    for n in data["lengths"]:
        for seed in range(data["seeds"]):
            pts = [(r["density"], r["error"]) for r in rows if r["kind"] == kind and r["method"] == method
                   and r["n"] == n and r["seed"] == seed]
            vals.append(_best_within(pts, budget))
    vals = [v for v in vals if v == v]
    return sum(vals) / len(vals) if vals else float("nan")


def synthetic_report(data: Dict[str, Any]) -> str:
    from lightning_modules.sparse_prefill.synthetic import HEAD_KINDS

    rows = data["rows"]
    kinds = sorted({r["kind"] for r in rows}, key=HEAD_KINDS.index)
    missing = [k for k in HEAD_KINDS if k not in kinds]
    methods = ["mean_pool", "xattention", "flexprefill", "prism", "sale"]
    targets = [0.1, 0.2, 0.3, 0.5]
    out = ([f"(Head kinds not in this saved run, added later: {', '.join(missing)}; rerun `--parts synthetic`.)", ""]
           if missing else [])
    out += ["| head | method | " + " | ".join(f"density <= {int(100 * t)}%" for t in targets) + " |",
           "|---|---|" + "---|" * len(targets)]
    for kind in kinds:
        for m in methods:
            cells = []
            for t in targets:
                v = cell_value(rows, data, kind, m, t)
                cells.append(f"{v:.3f}" if v == v else "-")
            out.append(f"| {kind} | {m} | " + " | ".join(cells) + " |")
    out += ["", "Prism's and SALE's error in the same cells against plain mean pooling / against the best of the "
            "block-selection baselines (mean pooling, XAttention, FlexPrefill): `below`, `equal` (within 0.005), "
            "`above`, or `-` where a side never gets that sparse:", "",
            "| head | method | " + " | ".join(f"density <= {int(100 * t)}%" for t in targets) + " |",
            "|---|---|" + "---|" * len(targets)]

    def verdict(mine: float, base: float) -> str:
        if mine != mine or base != base:
            return "-"
        return "equal" if abs(mine - base) <= 0.005 else ("below" if mine < base else "above")

    for kind in kinds:
        for m in ("prism", "sale"):
            cells = []
            for t in targets:
                mine = cell_value(rows, data, kind, m, t)
                base = [cell_value(rows, data, kind, b, t) for b in ("mean_pool", "xattention", "flexprefill")]
                best = min((v for v in base if v == v), default=float("nan"))
                cells.append(f"{verdict(mine, base[0])} / {verdict(mine, best)}")
            out.append(f"| {kind} | {m} | " + " | ".join(cells) + " |")
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, len(kinds), figsize=(3.6 * len(kinds), 3.2), squeeze=False)
        n0 = max(data["lengths"])
        for ax, kind in zip(axes[0], kinds):
            for m in methods:
                pts = sorted((r["density"], r["error"]) for r in rows if r["kind"] == kind and r["method"] == m
                             and r["n"] == n0 and r["seed"] == 0)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=m)
            ax.set_title(f"{kind} (N={n0})")
            ax.set_xlabel("density")
            ax.set_ylabel("relative output error")
            ax.set_xlim(0, 1)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        save_figure(fig, FIGURE)
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- spectral
SPECTRAL_CONFIGS = [(64, 1e5, 64, "SmolLM2 (d 64, base 1e5, B 64)"), (128, 1e4, 128, "d 128, base 1e4, B 128"),
                    (128, 1e6, 128, "d 128, base 1e6, B 128")]
SPECTRAL_TOP_P = [0.8, 0.9, 0.95]


def run_spectral(args) -> Dict[str, Any]:
    import torch

    import litctx_kernels
    from litctx_kernels import BlockLayout
    from lightning_modules.sparse_prefill.estimators import finish_block_mask, pool_blocks
    from lightning_modules.sparse_prefill.metrics import (
        attention_recall,
        block_attention_mass,
        matched_budget_mask,
        relative_output_error,
        top_block_hit_rate,
    )
    from lightning_modules.sparse_prefill.config import PrismConfig
    from lightning_modules.sparse_prefill.synthetic import offset_blocks, structured_heads

    n = 4096
    rows = []
    for d, base, block, label in SPECTRAL_CONFIGS:
        scale, m = d ** -0.5, n // block
        allowed = torch.ones(m, m, dtype=torch.bool).tril(-2)
        allowed[:, 0] = False
        causal = torch.ones(m, m, dtype=torch.bool).tril()
        for seed in range(args.spectral_heads):
            q, k, v, info = structured_heads(["attenuated_slash"], n=n, d=d, base=base, seed=seed, block=block)
            target = offset_blocks(n, info[0]["offsets"][0], block)
            pooled = pool_blocks(q, block) @ pool_blocks(k, block).transpose(-1, -2)
            bands = PrismConfig(block=block).estimator().band_logits(q, k)
            row = {"config": label, "seed": seed, "offset": info[0]["offsets"][0],
                   "hit": {name: top_block_hit_rate(x[0, 0], target, allowed)
                           for name, x in (("mean_pool", pooled), ("prism_high", bands["high"]),
                                           ("prism_low", bands["low"]))}, "matched": []}
            mass = block_attention_mass(q, k, scale, block, block)
            ref, _ = litctx_kernels.attention(q, k, v, scale=scale, causal=True)
            forced = finish_block_mask(torch.zeros(1, 1, m, m, dtype=torch.bool), n, block)
            for p in SPECTRAL_TOP_P:
                prism = PrismConfig(block=block, top_p=p).estimator().selected_block_mask(q, k, scale)[0]
                mean_pool = matched_budget_mask(pooled.masked_fill(forced, float("inf")), prism.sum(-1), causal)
                cell = {"top_p": p}
                for name, mask in (("prism", prism), ("mean_pool", mean_pool)):
                    layout = BlockLayout.from_block_mask(mask, block, block, (n, n))
                    o, _ = litctx_kernels.attention(q, k, v, scale=scale, causal=True, layout=layout)
                    cell[name] = {"density": layout.density(causal=True),
                                  "recall": float(attention_recall(mass, layout)[0, 0]),
                                  "error": float(relative_output_error(o, ref)[0, 0])}
                row["matched"].append(cell)
            rows.append(row)
        print(f"spectral {label}: done", flush=True)
    return {"rows": rows, "n": n, "heads": args.spectral_heads}


def spectral_report(data: Dict[str, Any]) -> str:
    rows = data["rows"]
    out = [f"`attenuated_slash` heads, N = {data['n']}, {data['heads']} heads per configuration. **Slash on top**: "
           "share of query rows (off the sink and the two diagonal blocks) whose top-scoring block is one the "
           "slash crosses, mean over heads; *better / worse*: heads where Prism's high band beats / trails mean "
           "pooling.", "",
           "| configuration | mean pooling | Prism high band | Prism low band | high band better / worse (heads) |",
           "|---|---|---|---|---|"]
    labels = [c[3] for c in SPECTRAL_CONFIGS if any(r["config"] == c[3] for r in rows)]
    for label in labels:
        rs = [r for r in rows if r["config"] == label]
        mean = {k: sum(r["hit"][k] for r in rs) / len(rs) for k in ("mean_pool", "prism_high", "prism_low")}
        better = sum(r["hit"]["prism_high"] > r["hit"]["mean_pool"] for r in rs)
        worse = sum(r["hit"]["prism_high"] < r["hit"]["mean_pool"] for r in rs)
        out.append(f"| {label} | {mean['mean_pool']:.2f} | {mean['prism_high']:.2f} | {mean['prism_low']:.2f} | "
                   f"{better} / {worse} |")
    out += ["", "**Equal density**: Prism's selection (top-p per band, union, sink and diagonal) against mean pooling "
            "keeping exactly as many blocks in every query row (its highest pooled logits after the sink and the "
            "diagonal); mean over heads (min - max of the per-head difference).", "",
            "| configuration | top-p | density | recall Prism | recall mean pool | error Prism | error mean pool | "
            "error Prism - mean pool (min, max) |", "|---|---|---|---|---|---|---|---|"]
    for label in labels:
        rs = [r for r in rows if r["config"] == label]
        for i, p in enumerate(SPECTRAL_TOP_P):
            cells = [r["matched"][i] for r in rs]
            avg = lambda m, key: sum(c[m][key] for c in cells) / len(cells)  # noqa: E731
            diff = [c["prism"]["error"] - c["mean_pool"]["error"] for c in cells]
            out.append(f"| {label} | {p} | {100 * avg('prism', 'density'):.1f}% | {avg('prism', 'recall'):.3f} | "
                       f"{avg('mean_pool', 'recall'):.3f} | {avg('prism', 'error'):.3f} | "
                       f"{avg('mean_pool', 'error'):.3f} | {sum(diff) / len(diff):+.3f} ({min(diff):+.3f}, "
                       f"{max(diff):+.3f}) |")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- suite
SUITE_METHODS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "dense": ("dense_prefill", {}),
    "mean_pool@0.9": ("mean_pool_prefill", {"top_p": 0.9}),
    "xattention@0.9": ("xattention", {"threshold": 0.9}),
    "flexprefill@0.9": ("flexprefill", {"gamma": 0.9}),
    "flexprefill@0.8": ("flexprefill", {"gamma": 0.8}),
    "prism@0.9": ("prism", {"top_p": 0.9}),
    "prism@0.95": ("prism", {"top_p": 0.95}),
    "sale@0.004": ("sale", {"tau": 0.004}),
    "sale@0.03": ("sale", {"tau": 0.03}),
    "sale@0.2": ("sale", {"tau": 0.2}),
    "sale@2": ("sale", {"tau": 2.0}),
    "sale@10": ("sale", {"tau": 10.0}),
}


def suite_records() -> List[Dict[str, Any]]:
    """The suite's records, one per (sample, method)."""
    return read_jsonl(SUITE, key=lambda r: (r["id"], r["method"]))


def _index(rec: Dict[str, Any]) -> int:
    """A suite record's sample index (ids are ``task-length-index``)."""
    return int(rec["id"].rsplit("-", 1)[1])


def run_suite(args, model, tok) -> None:
    import torch

    from datamodules.longctx_tasks import Haystack, build_sample
    from datamodules.text import pydoc_documents
    from lightning_modules.llm.decoding.generate import greedy_generate
    from lightning_modules.llm.decoding.stopping import stop_token_ids
    from lightning_modules.llm.eval.suite_metrics import score_prediction
    from lightning_modules.sparse_prefill.config import prefill_config
    from lightning_modules.sparse_prefill.session import install_sparse_prefill

    from litctx_common.records import Arm, RecordStore, evaluate_arms

    haystack = Haystack(pydoc_documents(), tok)
    stops = stop_token_ids(tok, model)
    arms = [Arm(m, settings={"method": list(SUITE_METHODS[m])}, keys={"method": m}) for m in args.methods]
    samples = [{"id": f"{task}-{n}-{index}", "task": task, "length": n, "index": index}
               for n in args.lengths for index in range(args.samples or DEFAULT_SAMPLES) for task in TASKS]

    def together(sample, todo):
        """The sample is built once; each method prefills it under its own sparse prefill."""
        s = build_sample(sample["task"], sample["length"], sample["index"], haystack, tok, 0)
        prompt = torch.cat([s["context_ids"], s["question_ids"]]).unsqueeze(0)
        out = {}
        for arm in todo:
            cfg = prefill_config(*SUITE_METHODS[arm.name])
            with install_sparse_prefill(model, cfg.build(), min_length=cfg.min_length, layers=cfg.layers) as sess:
                res = greedy_generate(model, prompt, None, s["max_new_tokens"], stops)
            text = tok.decode(res.tokens[0], skip_special_tokens=True)
            summ = sess.summary()
            out[arm.name] = {"task": sample["task"], "length": sample["length"],
                             "score": score_prediction(text, s["answers"], s["metric"]), "prediction": text,
                             "density": summ.get("density", 1.0), "estimate_s": summ.get("estimate_seconds", 0.0),
                             "attention_s": summ.get("attention_seconds", 0.0), "prefill_s": res.prefill_seconds}
        print(f"suite {sample['id']}: " + ", ".join(f"{m}={r['score']:.2f}/{r['density']:.2f}" for m, r in out.items()),
              flush=True)
        return out

    store = RecordStore(SUITE, keys=("id", "method"), mismatch="skip").load()
    evaluate_arms(arms, samples, store, sample_key="id", together=together)


def suite_report(args) -> Tuple[str, int]:
    """The suite table and the samples per task it covers (``--samples``, or all on record)."""
    from lightning_modules.llm.eval.suite_metrics import paired_bootstrap

    recs = [r for r in suite_records() if r["length"] in args.lengths and r["task"] in TASKS
            and (args.samples is None or _index(r) < args.samples)]
    if not recs:
        return "(no suite records yet)", 0
    samples = max(_index(r) for r in recs) + 1
    out = ["| length | method | accuracy % | dense on the same samples % | vs dense (paired 95% CI) | density | "
           "estimate s | attention s | n |", "|---|---|---|---|---|---|---|---|---|"]
    for n in args.lengths:
        by = {m: {r["id"]: r for r in recs if r["length"] == n and r["method"] == m} for m in SUITE_METHODS}
        dense = by["dense"]
        for m, cell in by.items():
            if not cell:
                continue
            ids = sorted(set(cell) & set(dense))
            acc = 100 * sum(r["score"] for r in cell.values()) / len(cell)
            ci = "-"
            same = f"{100 * sum(dense[i]['score'] for i in ids) / len(ids):.1f}" if ids else "-"
            if m != "dense" and ids:
                bs = paired_bootstrap([cell[i]["score"] for i in ids], [dense[i]["score"] for i in ids], seed=1)
                ci = f"{100 * bs['diff']:+.1f} [{100 * bs['lo']:+.1f}, {100 * bs['hi']:+.1f}]"
            mean = lambda key: sum(r[key] for r in cell.values()) / len(cell)  # noqa: E731
            out.append(f"| {n // 1024}K | {m} | {acc:.1f} | {same} | {ci} | {100 * mean('density'):.1f}% | "
                       f"{mean('estimate_s'):.2f} | {mean('attention_s'):.2f} | {len(cell)} |")
    return "\n".join(out), samples


# ---------------------------------------------------------------------------------------------- timing
def run_timing(args, model, tok) -> Dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from datamodules.longctx_tasks import Haystack, build_sample
    from datamodules.text import pydoc_documents
    from lightning_modules.llm.runtime.cached_lm import CachedLM
    from lightning_modules.llm.kv_policy.protocol import KVPolicy
    from lightning_modules.llm.kv_policy.runner import install_policy
    from lightning_modules.sparse_prefill.attention import sparse_prefill_attention
    from lightning_modules.sparse_prefill.config import prefill_config

    n = max(args.lengths)
    s = build_sample("niah_single", n, 0, Haystack(pydoc_documents(), tok), tok, 0)
    lm = CachedLM(model)
    with install_policy(model, KVPolicy(), record_prefill=True) as rec:
        lm.feed(torch.cat([s["context_ids"], s["question_ids"]]).unsqueeze(0))
    obs = rec.prefill_observations

    def timed(fn, reps=args.reps):  # median of synchronised runs (the device of the recorded prefill)
        return time_call(fn, reps, device=obs[0].q, reduce="median")

    result: Dict[str, Any] = {"n": int(obs[0].q.shape[2]), "layers": len(obs), "reps": args.reps, "methods": {}}
    sdpa = 0.0
    for layer, o in obs.items():
        sdpa += timed(lambda: F.scaled_dot_product_attention(o.q, o.k, o.v, is_causal=True, scale=o.scale,
                                                             enable_gqa=True))
    result["sdpa_s"] = sdpa
    old_data: Dict[str, Any] = {}
    if TIMING.is_file():  # keep the other methods of an earlier run on the same prompt (relative to its own SDPA)
        old = json.loads(TIMING.read_text())
        if (old.get("n"), old.get("layers")) == (result["n"], result["layers"]):
            old_data = old
            result["methods"].update({m: r for m, r in old.get("methods", {}).items() if m not in args.methods})
    if any(m.startswith("sale") for m in args.methods):
        result["sale_floor"] = dict(sale_estimate_floor(obs, timed), sdpa_s=sdpa)
        print(f"timing SALE estimate GEMM alone: int8 {result['sale_floor']['int8_gemm_s']:.2f} s, fp32 "
              f"{result['sale_floor']['fp32_gemm_s']:.2f} s", flush=True)
    elif "sale_floor" in old_data:
        result["sale_floor"] = old_data["sale_floor"]
    sale_taus = [SUITE_METHODS[m][1]["tau"] for m in args.methods if m.startswith("sale")]
    if sale_taus:
        result["sale_bound"] = sale_bound_saving(obs, sale_taus, timed)
    elif "sale_bound" in old_data:
        result["sale_bound"] = old_data["sale_bound"]
    for m in args.methods:
        name, kw = SUITE_METHODS[m]
        if m == "dense":
            continue
        factory = prefill_config(name, kw).build()
        est_s = total = dens = 0.0
        for layer, o in obs.items():
            est = factory(layer)
            stats = []
            total += timed(lambda: stats.append(sparse_prefill_attention(o.q, o.k, o.v, est, o.scale)[2]))
            est_s += sorted(st.estimate_seconds for st in stats)[len(stats) // 2]
            dens += stats[-1].density / len(obs)
        result["methods"][m] = {"total_s": total, "estimate_s": est_s, "density": dens,
                                "speedup_vs_sdpa": sdpa / total, "estimate_share_of_sdpa": est_s / sdpa,
                                "sdpa_s": sdpa}
        print(f"timing {m}: {total:.2f} s vs SDPA {sdpa:.2f} s (density {100 * dens:.1f}%)", flush=True)
    return result


def sale_estimate_floor(obs, timed, chunk_rows: int = 512) -> Dict[str, float]:
    """Seconds of SALE's estimate GEMM alone over all layers: the integer products ``Qq_i . Kq_j`` of every
    causal pair (query chunks of ``chunk_rows`` against their causal key prefix, the query heads of a KV group
    stacked), as exact int8 x int8 -> int32 (``torch._int_mm``, the fastest exact integer product torch has on a
    CPU) and as fp32. No threshold, no pooling: a floor under any CPU implementation of the estimate."""
    import torch

    from litctx_kernels.reference.lowbit import quantize_qk_lowbit

    int8_s = fp32_s = 0.0
    for o in obs.values():
        lb = quantize_qk_lowbit(o.q, o.k, 4, 1)
        b, hq, n, d = lb.q_int.shape
        hk = lb.k_int.shape[1]
        qg = lb.q_int.reshape(b, hk, hq // hk, n, d)
        chunks = [(r0, min(n, r0 + chunk_rows)) for r0 in range(0, n, chunk_rows)]
        operands = [(qg[bi, h, :, r0:r1].reshape(-1, d).contiguous(), lb.k_int[bi, h, :r1].t())
                    for bi in range(b) for h in range(hk) for r0, r1 in chunks]
        operands_f = [(a.float(), k.float()) for a, k in operands]
        int8_s += timed(lambda: [torch._int_mm(a, k) for a, k in operands])
        fp32_s += timed(lambda: [torch.mm(a, k) for a, k in operands_f])
    return {"int8_gemm_s": int8_s, "fp32_gemm_s": fp32_s, "chunk_rows": chunk_rows}


def sale_bound_saving(obs, taus, timed) -> Dict[str, Any]:
    """SALE's CPU estimate with and without the exact tile bound (``litctx_kernels.lowbit_block_estimate(prune=...)``)
    over every layer of the recorded prefill, per threshold: seconds of each, and whether the flags are
    identical (they must be: the bound only skips tiles it proves below every row's threshold)."""
    import torch

    import litctx_kernels
    from lightning_modules.sparse_prefill.config import SALEConfig
    from lightning_modules.sparse_prefill.sale import sink_local_layout

    cfg = SALEConfig()
    out: Dict[str, Any] = {}
    for tau in taus:
        row = {"pruned_s": 0.0, "full_s": 0.0, "identical": True, "flagged": 0, "tiles": 0}
        for o in obs.values():
            n = o.q.shape[2]
            exact_layout = sink_local_layout(n, cfg.block_q, cfg.block_k, cfg.sink, cfg.local, o.q.device)
            lse = litctx_kernels.attention(o.q, o.k, o.v, scale=o.scale, causal=True, layout=exact_layout)[1]
            kw = dict(scale=o.scale, block_q=cfg.block_q, block_k=cfg.block_k, bits=cfg.bits,
                      group_size=cfg.group_size, backend="torch")
            res = {}
            for prune in (True, False):
                key = "pruned_s" if prune else "full_s"
                row[key] += timed(lambda: res.__setitem__(prune, litctx_kernels.lowbit_block_estimate(
                    o.q, o.k, lse, tau, prune=prune, **kw).to_block_mask()))
            row["identical"] &= bool(torch.equal(res[True], res[False]))
            row["flagged"] += int(res[True].sum())
            row["tiles"] += int(res[True].numel())
        row["saving"] = 1 - row["pruned_s"] / row["full_s"]
        out[f"sale@{tau:g}"] = row
        print(f"timing SALE estimate tau={tau:g}: bound {row['pruned_s']:.2f} s vs without {row['full_s']:.2f} s, "
              f"identical flags: {row['identical']}", flush=True)
    return out


def timing_report(data: Dict[str, Any]) -> str:
    out = [f"One {data['n']}-token prompt, {data['layers']} layers, median of {data['reps']} per layer; dense SDPA "
           f"(`F.scaled_dot_product_attention`, causal, GQA) {data['sdpa_s']:.2f} s in all (methods timed in an "
           "earlier run on the same prompt are compared with that run's SDPA, in the last column).", "",
           "| method | density | estimate + sparse attention s | speed-up vs SDPA | estimate / SDPA time | SDPA s |",
           "|---|---|---|---|---|---|"]
    order = {m: i for i, m in enumerate(SUITE_METHODS)}
    for m, r in sorted(data["methods"].items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])):
        out.append(f"| {m} | {100 * r['density']:.1f}% | {r['total_s']:.2f} | {r['speedup_vs_sdpa']:.2f}x | "
                   f"{100 * r['estimate_share_of_sdpa']:.1f}% | {r.get('sdpa_s', data['sdpa_s']):.2f} |")
    floor = data.get("sale_floor")
    if floor:
        sdpa = floor.get("sdpa_s", data["sdpa_s"])  # the SDPA of the run that measured the floor
        out += ["", f"SALE on CPU, the estimate's integer GEMM alone (every causal pair, no threshold or pooling; "
                f"`sale_estimate_floor`): int8 -> int32 `torch._int_mm` {floor['int8_gemm_s']:.2f} s "
                f"({100 * floor['int8_gemm_s'] / sdpa:.0f}% of SDPA), fp32 {floor['fp32_gemm_s']:.2f} s. Best "
                "speed-up SALE could reach on this CPU with its measured exact + sparse passes:", "",
                "| method | exact + sparse passes s | with a free estimate | with only the int8 GEMM as estimate |",
                "|---|---|---|---|"]
        for m, r in data["methods"].items():
            if m.startswith("sale") and r.get("sdpa_s", sdpa) == sdpa:
                rest = r["total_s"] - r["estimate_s"]
                out.append(f"| {m} | {rest:.2f} | {sdpa / rest:.2f}x | {sdpa / (rest + floor['int8_gemm_s']):.2f}x |")
    bound = data.get("sale_bound")
    if bound:
        out += ["", "SALE's CPU estimate with the exact tile bound (`litctx_kernels.lowbit_block_estimate(prune=True)`: a tile "
                "whose box bound is below every row's threshold is never multiplied) against the same estimate "
                "without it, every layer of the prompt, median per layer:", "",
                "| threshold | with bound s | without s | saving | flags identical | flagged tiles |",
                "|---|---|---|---|---|---|"]
        for m, r in bound.items():
            out.append(f"| {m} | {r['pruned_s']:.2f} | {r['full_s']:.2f} | {100 * r['saving']:.0f}% | "
                       f"{'yes' if r['identical'] else 'NO'} | {100 * r['flagged'] / max(1, r['tiles']):.1f}% |")
        if all(r["saving"] <= 0 for r in bound.values()):
            out += ["", "The bound saves nothing here: on these prompts it rules out too few tiles to pay for its own "
                    "products and gathers; `prune=False` is the default and the SALE rows above run without it."]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["synthetic", "spectral", "timing", "suite"],
                        choices=["synthetic", "spectral", "timing", "suite"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--seeds", type=int, default=2, help="synthetic head seeds")
    parser.add_argument("--spectral-heads", type=int, default=16, help="attenuated-slash heads per configuration")
    parser.add_argument("--samples", type=int, default=None,
                        help=f"suite samples per task (4 tasks): runs indices below it (default {DEFAULT_SAMPLES}); "
                             "the report reads records below it (default: all)")
    parser.add_argument("--reps", type=int, default=3, help="timing repetitions per layer")
    parser.add_argument("--methods", nargs="+", default=list(SUITE_METHODS), choices=list(SUITE_METHODS),
                        metavar="METHOD", help="suite / timing methods (default: all of " + ", ".join(SUITE_METHODS) + ")")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model = tok = None
    if not args.report_only and {"timing", "suite"} & set(args.parts):
        from lightning_modules.llm.model.loading import load_causal_lm

        model, tok = load_causal_lm("smollm2-135m")
        model.requires_grad_(False)
    with torch.no_grad():
        if not args.report_only and "synthetic" in args.parts:
            save_json(SYNTH, run_synthetic(args))
        if not args.report_only and "spectral" in args.parts:
            save_json(SPECTRAL, run_spectral(args))
        if not args.report_only and "timing" in args.parts:
            save_json(TIMING, run_timing(args, model, tok))
        if not args.report_only and "suite" in args.parts:
            run_suite(args, model, tok)
    parts = []
    if SYNTH.is_file():
        parts.append("**(a) Synthetic heads** (`--parts synthetic`; d = 64, RoPE base 1e5, block 64, SALE 64 x 32; "
                     "each cell: the lowest relative output error a method reaches within the density budget over "
                     "its sweep, mean over lengths and seeds; `-`: the method never gets that sparse):\n\n"
                     + synthetic_report(json.loads(SYNTH.read_text()))
                     + "\n\n![density vs error](figures/sparse_prefill_synthetic.png)")
    if SPECTRAL.is_file():
        parts.append("**(a') Prism's blind spot** (`--parts spectral`):\n\n" + spectral_report(json.loads(SPECTRAL.read_text())))
    if TIMING.is_file():
        parts.append("**(c) CPU attention time** (`--parts timing`):\n\n" + timing_report(json.loads(TIMING.read_text())))
    table, samples = suite_report(args)
    parts.append("**(b) SmolLM2-135M-Instruct on the suite** (`--parts suite`; query-aware prompt as one prefill; "
                 f"{len(TASKS)} tasks x up to {samples} samples per length; sample i puts the needle at depth "
                 "(i mod 5) / 4; n: samples a row has; the exact `--methods` / `--samples` runs are listed in "
                 "docs/sparse_prefill.md):\n\n" + table)
    body = "Command: `python -m bench.sparse_prefill` (parts as listed).\n\n" + "\n\n".join(parts) + "\n"
    write_section("sparse_prefill", body, "Sparse prefill: SALE, Prism and block-selection baselines")
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
