"""Speculative decoding and Dustin's sparse verification with SmolLM2-135M-Instruct on the long-context suite
(pointer chasing included): every verifier side by side with plain decoding and dense verification.

    python -m bench.speculative                         # run (or continue) and write docs/results.md
    python -m bench.speculative --report-only           # rewrite the section from the records so far
    python -m bench.speculative --lengths 4096 --samples 4 --batch 1 --budgets 256

Arms (``--arms``): ``plain`` (greedy decoding, one target call per token), ``dense`` (speculative decoding,
dense verification: exact) with each of ``--drafts``, and with ``--sparse-draft``: ``dustin``, ``history_only``,
``draft_only``, ``quest`` (pages of 16) and ``snapkv`` (static: the context compressed once at prefill to the
budget, then dense verification of what is left), each at every ``--budgets`` value. Drafts: ``eeK`` (the
target's first K layers, self-speculative early exit), ``distilled`` (``--draft-path``, a ``draft_distill``
run's ``draft/`` folder) and ``lookup`` (prompt lookup: n-gram matches in the row's own tokens, no model; its
lookahead signal for Dustin is the source span of the proposal). Greedy acceptance; ``--gamma`` drafts per step;
query-aware prompts (context and question in one prefill). ``--make-distill-corpus PATH`` writes the suite
prompts (seed 1000) that the distilled draft was trained on.

Records: ``results/speculative_smollm2.jsonl``, one per (sample, batch size, arm, budget), so a rerun
resumes. Reported per length x batch x arm x budget: accuracy, the acceptance rate and mean accepted length,
KV bytes read per verification (target K/V plus the scorer's reads) relative to dense verification, the
attention recovery rate (ARR) and the CPU seconds per verification step and decode tokens/s, with 95% paired
bootstrap intervals of accuracy against dense verification.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Dict, List, Optional

from bench._report import REPO, pyplot, save_figure, write_section

from litctx_common.io import append_jsonl, read_jsonl
from litctx_common.stats import mean_of

RESULTS = REPO / "results" / "speculative_smollm2.jsonl"
FIGURE = REPO / "docs" / "figures" / "speculative_smollm2.png"
TASKS = ["pointer_chasing", "niah_single", "niah_multikey", "variable_tracking"]
ARMS = ["plain", "dense", "dustin", "history_only", "draft_only", "quest", "snapkv"]
SPARSE = ("dustin", "history_only", "draft_only", "quest", "snapkv")


def _key(r: Dict[str, Any]):
    return (r["id"], r["batch"], r["arm"], r["budget"], r.get("draft", "-"))


def draft_config(name: str, path: Optional[str]):
    """``eeK`` (early exit, K layers), ``lookup`` (prompt lookup; ``lookupN``: matches of at least N tokens) or
    ``distilled`` (``--draft-path``)."""
    from lightning_modules.llm.decoding.drafts import DraftConfig

    if name == "lookup":
        return DraftConfig(kind="prompt_lookup")
    if name.startswith("lookup") and name[6:].isdigit():
        n = int(name[6:])
        return DraftConfig(kind="prompt_lookup", ngram_min=n, ngram_max=max(3, n))
    if name == "distilled":
        if not path:
            raise SystemExit("--drafts distilled needs --draft-path (a draft_distill run's draft/ folder)")
        return DraftConfig(kind="checkpoint", path=path)
    if name.startswith("ee") and name[2:].isdigit():
        return DraftConfig(kind="early_exit", num_layers=int(name[2:]))
    raise SystemExit(f"draft {name!r}: use eeK (early exit with K layers), lookup or distilled")


def _verifier(arm: str, budget: int, args):
    from lightning_modules.speculative.verifiers import build_verifier

    common = {"sink": args.sink, "window": args.window, "measure_arr": not args.no_arr}
    if arm in ("dense", "snapkv"):
        return build_verifier("dense", {"measure_arr": not args.no_arr})
    if arm == "quest":
        return build_verifier("quest", {"budget": budget, "page_size": 16, **common})
    extra = {"calibration": args.calibration} if args.calibration else {}
    return build_verifier(arm, {"budget": budget, **common, **extra})


def run(args, model, tok, drafts: Dict[str, Any]) -> None:
    import contextlib

    import torch

    from datamodules.longctx_tasks import Haystack, build_sample, collate_suite
    from datamodules.text import pydoc_documents
    from lightning_modules.kv_eviction.config import SnapKVConfig
    from lightning_modules.llm.decoding.generate import greedy_generate, hold_prompt
    from lightning_modules.llm.decoding.stopping import stop_token_ids
    from lightning_modules.llm.kv_policy.runner import install_policy
    from lightning_modules.llm.decoding.speculative import speculative_generate
    from lightning_modules.llm.eval.suite_metrics import score_prediction

    done = {_key(r) for r in read_jsonl(args.results)}
    haystack = Haystack(pydoc_documents(), tok)
    stops = stop_token_ids(tok, model)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    for length in args.lengths:
        samples = [build_sample(args.tasks[i % len(args.tasks)], length, i // len(args.tasks), haystack, tok, 0)
                   for i in range(args.samples)]
        for bsz in args.batch:
            for start in range(0, len(samples), bsz):
                group = samples[start:start + bsz]
                batch = collate_suite(group, pad)
                ids = torch.cat([batch["context_ids"], batch["question_ids"]], 1)
                mask = torch.cat([batch["context_mask"], batch["question_mask"]], 1)
                limit = min(max(batch["max_new_tokens"]), args.max_new_tokens)
                held: Dict[str, Any] = {}  # the prompt prefilled once per model (lazily), shared by every arm
                jobs = []
                for arm in args.arms:
                    if arm == "plain":
                        jobs.append((arm, 0, "-"))
                    elif arm == "dense":
                        jobs += [(arm, 0, d) for d in args.drafts]
                    else:
                        baseline = arm in ("history_only", "draft_only", "quest") and args.baseline_budgets
                        jobs += [(arm, b, args.sparse_draft) for b in (args.baseline_budgets if baseline else args.budgets)]
                for arm, budget, dname in jobs:
                    draft = drafts.get(dname)
                    if all((s["id"], bsz, arm, budget, dname) in done for s in group):
                        continue
                    # prefilled before any policy is installed: a policy compresses the held prefill when it resumes
                    for name, module in (("target", model), (dname, draft)):
                        if isinstance(module, torch.nn.Module) and name not in held:
                            held[name] = hold_prompt(module, ids, mask)
                    target_held, draft_held = held["target"], held.get(dname)
                    ctx = contextlib.ExitStack()
                    with ctx:
                        if arm == "snapkv":
                            ctx.enter_context(install_policy(model, SnapKVConfig(keep=budget, window=32).build()))
                        if arm == "plain":
                            res = greedy_generate(model, ids, mask, limit, stops, held=target_held)
                        else:
                            res = speculative_generate(model, draft, ids, mask, limit, stops, gamma=args.gamma,
                                                       verifier=_verifier(arm, budget, args), pad_id=pad,
                                                       held=target_held, draft_held=draft_held)
                    st = res.stats or {}
                    read = st.get("read") or {}
                    recs = []
                    for i, s in enumerate(group):
                        text = tok.decode(res.tokens[i], skip_special_tokens=True)
                        acc_row = st.get("accepted_per_row", [None] * len(group))[i]
                        prop_row = st.get("proposed_per_row", [None] * len(group))[i]
                        recs.append({
                            "id": s["id"], "task": s["task"], "length": length, "batch": bsz, "arm": arm,
                            "budget": budget, "draft": dname, "score": score_prediction(text, s["answers"], s["metric"]),
                            "tokens": res.tokens[i], "n_tokens": s["n_tokens"],
                            "acceptance": (acc_row / prop_row) if prop_row else None,
                            "mean_accepted_length": st.get("mean_accepted_length"),
                            "verify_steps": st.get("verify_steps"),
                            "bytes_read": read.get("bytes_read"), "kv_bytes_read": read.get("kv_bytes_read"),
                            "dense_bytes": read.get("dense_bytes"), "arr": read.get("arr"),
                            "verify_s_per_step": (st["verify_seconds"] / st["target_calls"]) if st.get("target_calls") else None,
                            "decode_tok_s": (sum(len(t) for t in res.tokens) / res.decode_seconds) if res.decode_seconds else None,
                            "decode_s": res.decode_seconds, "prefill_s": res.prefill_seconds,
                            "prediction": text})
                    append_jsonl(args.results, recs)
                    done.update(_key(r) for r in recs)
                    r0 = recs[0]
                    print(f"[bench.speculative] {length} b{bsz} {arm}@{budget} [{dname}] {group[0]['id']}: score "
                          f"{sum(r['score'] for r in recs) / len(recs):.2f} acc {r0['acceptance']} "
                          f"bytes {r0['bytes_read']} dense {r0['dense_bytes']} arr {r0['arr']} "
                          f"tok/s {r0['decode_tok_s']}", flush=True)


SALIENCY = REPO / "results" / "speculative_saliency.json"


def saliency_shift(args, model, tok, draft) -> Dict[str, Any]:
    """Does the region that matters move during generation? Dense speculative decoding of ``--saliency`` pointer
    chasing samples at the first ``--lengths`` value, recording at every verification the true attention mass of
    the verification queries per position (all layers and heads) and the target's history signal (middle layer,
    all heads). Per step: the attention recovery of (a) the history set chosen at the first verification and
    kept (static, plus the current sink and window) and (b) the set chosen again from the current history signal
    (dynamic), both of ``--budgets[0]`` positions. A static set that loses recovery over the steps is the saliency
    shift Dustin's per-step sets address."""
    from types import SimpleNamespace

    import torch

    from datamodules.longctx_tasks import Haystack, build_sample
    from datamodules.text import pydoc_documents
    from lightning_modules.dustin.calibration import DustinCalibrationCallback, DustinCalibrationConfig
    from lightning_modules.dustin.selection import dustin_select
    from lightning_modules.llm.decoding.stopping import stop_token_ids

    budget, length = args.budgets[0], args.lengths[0]
    layer = model.config.num_hidden_layers // 2
    haystack = Haystack(pydoc_documents(), tok)
    stops = stop_token_ids(tok, model)
    cb = DustinCalibrationCallback(DustinCalibrationConfig(budget=budget, sink=args.sink, window=args.window,
                                                           gamma=args.gamma, max_steps_per_batch=64))
    module = SimpleNamespace(model=model, tokenizer=tok, generation=None)
    trainer = SimpleNamespace(default_root_dir=str(REPO / "runs"), is_global_zero=True)
    curves: Dict[str, List[List[float]]] = {"static": [], "dynamic": []}
    with cb.installed(trainer, module, "predict", report=False):  # records the steps; writes no calibration
        for i in range(args.saliency):
            s = build_sample("pointer_chasing", length, i, haystack, tok, 0)
            ids = torch.cat([s["context_ids"], s["question_ids"]]).unsqueeze(0)
            before = len(cb.steps)
            module.generation.generate(model, ids, torch.ones_like(ids), min(s["max_new_tokens"], args.max_new_tokens),
                                       stops)
            steps = cb.steps[before:]
            if not steps:
                continue
            first = steps[0]
            h0 = first.hist[layer].float().sum(0)
            static = dustin_select(h0[None], torch.zeros_like(h0)[None], first.live[None], budget, args.sink,
                                   args.window, 0)[0]
            st_curve, dy_curve = [], []
            for st in steps:
                width = st.mass.shape[0]
                keep = torch.zeros(width, dtype=torch.bool)
                keep[:static.shape[0]] = static[:width]
                protect = dustin_select(torch.zeros(1, width), torch.zeros(1, width), st.live[None],
                                        args.sink + args.window, args.sink, args.window, 0)[0]
                st_curve.append(float(st.mass[keep | protect].sum()) + st.mass_new)
                h = st.hist[layer].float().sum(0)
                dyn = dustin_select(h[None], torch.zeros_like(h)[None], st.live[None], budget, args.sink, args.window,
                                    0)[0]
                dy_curve.append(float(st.mass[dyn].sum()) + st.mass_new)
            curves["static"].append(st_curve)
            curves["dynamic"].append(dy_curve)
            print(f"[bench.speculative] saliency {s['id']}: {len(steps)} steps, static ARR {st_curve[0]:.3f} -> "
                  f"{st_curve[-1]:.3f}, dynamic {dy_curve[0]:.3f} -> {dy_curve[-1]:.3f}", flush=True)
    out = {"length": length, "budget": budget, "layer": layer, "samples": len(curves["static"]), "curves": curves}
    from bench._report import save_json

    save_json(SALIENCY, out)
    return out


def saliency_table(data: Dict[str, Any]) -> str:
    if not data or not data.get("samples"):
        return ""
    lines = [f"Saliency shift ({data['samples']} pointer-chasing samples at {data['length']} tokens, dense speculative "
             f"decoding, history set of layer {data['layer']} at budget {data['budget']}): attention recovery of the "
             f"verification queries by verification step, mean over samples.", "",
             "| step | static set (chosen at step 1) | dynamic set (chosen each step) |", "|---|---|---|"]
    n = max(len(c) for c in data["curves"]["static"])
    for t in [0, 1, 2, 4, 8, 16, 32, 63]:
        if t >= n:
            continue
        st = [c[t] for c in data["curves"]["static"] if len(c) > t]
        dy = [c[t] for c in data["curves"]["dynamic"] if len(c) > t]
        lines.append(f"| {t + 1} | {sum(st) / len(st):.3f} (n={len(st)}) | {sum(dy) / len(dy):.3f} |")
    return "\n".join(lines)


def make_distill_corpus(path: Path, n: int = 400, length: int = 768, seed: int = 1000) -> None:
    """A draft-distillation corpus of suite prompts with their reference answers (a seed the benchmark does not
    use), one ``{"text": ...}`` per line: the draft learns the target's behaviour on long prompts that copy from
    the context, which plain prose (pydoc) barely shows."""
    import json

    from datamodules.longctx_tasks import DEFAULT_TASKS, Haystack, build_sample
    from datamodules.text import pydoc_documents
    from lightning_modules.llm.model.loading import load_tokenizer
    from litctx_common.io import atomic_open

    tok = load_tokenizer("smollm2-135m")
    haystack = Haystack(pydoc_documents(), tok)
    tasks = [t for t in DEFAULT_TASKS if t != "common_words"] + ["pointer_chasing"]
    with atomic_open(path, "w") as f:
        for i in range(n):
            s = build_sample(tasks[i % len(tasks)], length, i // len(tasks), haystack, tok, seed)
            ids = s["context_ids"].tolist() + s["question_ids"].tolist()
            answer = " " + ("\n".join(s["answers"]) if s["metric"] == "ordered" else ", ".join(s["answers"]))
            f.write(json.dumps({"text": tok.decode(ids) + answer + "<|im_end|>"}) + "\n")
    print(f"[bench.speculative] wrote {n} distillation prompts to {path}")


def _fraction(r: Dict[str, Any], dense: Dict[str, Dict[str, Any]]) -> Optional[float]:
    """Bytes read per verification relative to dense verification of the full cache (the dense arm's record of
    the same sample; a static eviction's own dense bytes are over the compressed cache)."""
    if not r.get("bytes_read"):
        return None
    ref = dense.get(r["id"], {}).get("dense_bytes") or r.get("dense_bytes")
    return r["bytes_read"] / ref if ref else None


def _mean_or_none(xs):
    return mean_of(xs, empty=None)


def report(args) -> str:
    from lightning_modules.llm.eval.suite_metrics import paired_bootstrap

    recs = read_jsonl(args.results)
    if not recs:
        return "No records yet."
    cells: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in recs:
        cells.setdefault((r["length"], r["batch"], r["arm"], r["budget"], r.get("draft", "-")), []).append(r)
    lines = [f"Records: `{args.results.relative_to(REPO) if args.results.is_relative_to(REPO) else args.results}` "
             f"(every run appends; the table covers all of them). SmolLM2-135M-Instruct fp32, 2 CPU threads, greedy, "
             f"gamma {args.gamma}, query-aware prompts, sink {args.sink} + window {args.window} inside each budget.",
             "",
             "| length | batch | arm | draft | budget | n | accuracy | diff vs dense [95% CI] | same tokens as dense (dense: as plain) "
             "| acceptance | accepted length | KV read vs dense | ARR | s / verify step | decode tok/s | tok/s vs plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (length, bsz, arm, budget, dname), rows in sorted(
            cells.items(), key=lambda kv: (kv[0][0], kv[0][1], ARMS.index(kv[0][2]) if kv[0][2] in ARMS else 99,
                                           kv[0][4], kv[0][3])):
        ref_draft = dname if arm == "dense" else (dname if (length, bsz, "dense", 0, dname) in cells else None)
        dense = {r["id"]: r for r in cells.get((length, bsz, "dense", 0, ref_draft), [])}
        plain = {r["id"]: r for r in cells.get((length, bsz, "plain", 0, "-"), [])}
        paired = [(r["score"], dense[r["id"]]["score"]) for r in rows if r["id"] in dense]
        ci = "-"
        if arm != "dense" and len(paired) >= 2:
            b = paired_bootstrap([a for a, _ in paired], [d for _, d in paired])
            ci = f"{100 * b['diff']:+.1f} [{100 * b['lo']:+.1f}, {100 * b['hi']:+.1f}]"
        frac = _mean_or_none([_fraction(r, dense) for r in rows])
        speed = _mean_or_none([(r["decode_tok_s"] / plain[r["id"]]["decode_tok_s"]) if r["id"] in plain and r.get("decode_tok_s")
                       and plain[r["id"]].get("decode_tok_s") else None for r in rows])

        def f(x, fmt):
            return "-" if x is None else format(x, fmt)

        ref = plain if arm == "dense" else dense  # dense verification itself must reproduce plain decoding
        same = _mean_or_none([float(r["tokens"] == ref[r["id"]]["tokens"]) for r in rows if r["id"] in ref and r["batch"] == bsz])
        lines.append(f"| {length} | {bsz} | {arm} | {dname} | {budget or '-'} | {len(rows)} | {100 * _mean_or_none([r['score'] for r in rows]):.1f} "
                     f"| {ci} | {f(same, '.2f')} | {f(_mean_or_none([r['acceptance'] for r in rows]), '.3f')} "
                     f"| {f(_mean_or_none([r['mean_accepted_length'] for r in rows]), '.2f')} | {f(frac, '.3f')} "
                     f"| {f(_mean_or_none([r['arr'] for r in rows]), '.3f')} | {f(_mean_or_none([r['verify_s_per_step'] for r in rows]), '.3f')} "
                     f"| {f(_mean_or_none([r['decode_tok_s'] for r in rows]), '.2f')} | {f(speed, '.2f')}x |")
    _figure(cells)
    return ("\n".join(lines) + f"\n\n![accuracy and bytes read against budget](figures/{FIGURE.name})\n\n"
            + speed_table(cells) + "\n\n" + criteria_table(cells) + "\n")


def _paired(rows, ref, value) -> List[tuple]:
    """``(value(r), value(ref[r.id]))`` for each record with a partner in ``ref`` (both values defined)."""
    out = []
    for r in rows:
        o = ref.get(r["id"])
        if o is not None and value(r) is not None and value(o) is not None:
            out.append((value(r), value(o)))
    return out


def _ci(pairs, scale=1.0, fmt="+.1f") -> str:
    from lightning_modules.llm.eval.suite_metrics import paired_bootstrap

    if len(pairs) < 2:
        return "-"
    b = paired_bootstrap([a for a, _ in pairs], [c for _, c in pairs])
    return (f"{format(scale * b['diff'], fmt)} [{format(scale * b['lo'], fmt)}, {format(scale * b['hi'], fmt)}] "
            f"(n={b['n']})")


def speed_table(cells) -> str:
    """Decode tokens/s of each speculative arm over plain decoding of the same samples: mean, bootstrap
    interval of the mean, sd, range and the share of samples that decode faster."""
    import statistics

    from lightning_modules.llm.eval.suite_metrics import paired_bootstrap

    lines = ["Decode speed against plain decoding, per sample (ratio of decode tokens/s, same run and samples; "
             "95% bootstrap interval of the mean ratio):", "",
             "| length | batch | arm | draft | budget | n | mean ratio [95% CI] | sd | min | max | faster |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (length, bsz, arm, budget, dname), rows in sorted(cells.items()):
        if arm == "plain":
            continue
        plain = {r["id"]: r for r in cells.get((length, bsz, "plain", 0, "-"), [])}
        ratios = [r["decode_tok_s"] / plain[r["id"]]["decode_tok_s"] for r in rows
                  if r["id"] in plain and r.get("decode_tok_s") and plain[r["id"]].get("decode_tok_s")]
        if len(ratios) < 2:
            continue
        b = paired_bootstrap(ratios, [0.0] * len(ratios))
        lines.append(f"| {length} | {bsz} | {arm} | {dname} | {budget or '-'} | {len(ratios)} | {b['diff']:.2f}x "
                     f"[{b['lo']:.2f}, {b['hi']:.2f}] | {statistics.stdev(ratios):.2f} | {min(ratios):.2f} "
                     f"| {max(ratios):.2f} | {sum(x > 1 for x in ratios)}/{len(ratios)} |")
    return "\n".join(lines)


def _prefix_agreement(r: Dict[str, Any], dense: Dict[str, Dict[str, Any]]) -> Optional[float]:
    """Common prefix of ``r``'s tokens and the dense record's, over the dense output's length."""
    ref = dense.get(r["id"])
    if ref is None or not ref["tokens"]:
        return None
    n = 0
    for a, b in zip(r["tokens"], ref["tokens"]):
        if a != b:
            break
        n += 1
    return n / len(ref["tokens"])


def criteria_table(cells) -> str:
    """The issue's 8K criteria per budget, paired by sample: Dustin against dense verification (acceptance and
    accuracy within 2 points, at least 4x fewer bytes), Dustin against static SnapKV on pointer chasing, and
    Dustin's ARR against history-only and draft-only (the research note's pass criterion)."""
    lines = ["Criteria, paired by sample (points; 95% bootstrap intervals). \"Dense prefix kept\": the share of dense "
             "verification's output that an arm reproduces before its first different token (greedy dense "
             "verification is exact, so any difference is the sparse read's or the eviction's).", "",
             "| length | budget | draft | Dustin - dense: acceptance | accuracy | dense bytes / Dustin bytes "
             "| Dustin - SnapKV: accuracy, all tasks | pointer chasing: accuracy | dense prefix kept "
             "| ARR: Dustin - history-only | Dustin - draft-only |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (length, bsz, arm, budget, dname), rows in sorted(cells.items()):
        if arm != "dustin" or bsz != 1:
            continue
        ids = lambda key: {r["id"]: r for r in cells.get(key, [])}  # noqa: E731
        dense = ids((length, bsz, "dense", 0, dname))
        snap = ids((length, bsz, "snapkv", budget, dname))
        hist = ids((length, bsz, "history_only", budget, dname))
        drft = ids((length, bsz, "draft_only", budget, dname))
        frac = _mean_or_none([_fraction(r, dense) for r in rows])
        pc = [r for r in rows if r["task"] == "pointer_chasing"]
        same = lambda r: _prefix_agreement(r, dense)  # noqa: E731
        lines.append(
            f"| {length} | {budget} | {dname} | {_ci(_paired(rows, dense, lambda r: r['acceptance']), 100)} "
            f"| {_ci(_paired(rows, dense, lambda r: r['score']), 100)} | {f'{1 / frac:.1f}x' if frac else '-'} "
            f"| {_ci(_paired(rows, snap, lambda r: r['score']), 100)} "
            f"| {_ci(_paired(pc, snap, lambda r: r['score']), 100)} | {_ci(_paired(pc, snap, same), 100)} "
            f"| {_ci(_paired(rows, hist, lambda r: r['arr']), 1, '+.3f')} "
            f"| {_ci(_paired(rows, drft, lambda r: r['arr']), 1, '+.3f')} |")
    return "\n".join(lines)


def _figure(cells) -> None:
    """Accuracy and bytes read (against dense verification) by budget, one row of panels per context length."""
    plt = pyplot()
    if plt is None:
        return
    lengths = sorted({k[0] for k in cells if k[2] in SPARSE})
    if not lengths:
        return
    fig, axes = plt.subplots(len(lengths), 2, figsize=(10, 3.6 * len(lengths)), squeeze=False)
    for row, length in enumerate(lengths):
        ax_acc, ax_bytes = axes[row]
        for arm in SPARSE:
            pts = []
            for (n, bsz, a, b, d), rows in cells.items():
                if n != length or a != arm or bsz != 1:
                    continue
                dense = {r["id"]: r for r in cells.get((n, bsz, "dense", 0, d), [])}
                pts.append((b, _mean_or_none([r["score"] for r in rows]), _mean_or_none([_fraction(r, dense) for r in rows])))
            if pts:
                pts.sort()
                ax_acc.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=arm)
                ax_bytes.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=arm)
        for (n, bsz, a, b, d), rows in cells.items():
            if n == length and a == "dense" and bsz == 1:
                ax_acc.axhline(_mean_or_none([r["score"] for r in rows]), color="k", ls="--", lw=0.8)
        ax_acc.set(xlabel="budget (positions)", ylabel="accuracy", xscale="log", title=f"{length} tokens")
        ax_bytes.set(xlabel="budget (positions)", ylabel="bytes read / dense", xscale="log", title=f"{length} tokens")
        ax_acc.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, FIGURE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--samples", type=int, default=40, help="samples per length (tasks cycled)")
    parser.add_argument("--tasks", nargs="+", default=TASKS)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS)
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--baseline-budgets", type=int, nargs="+", default=None,
                        help="budgets of history_only, draft_only and quest (default: --budgets)")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--drafts", nargs="+", default=["lookup", "ee8"],
                        help="drafts of the dense arm: eeK (early exit, K layers), lookup (prompt lookup; lookupN: n-gram "
                             "matches of at least N tokens, else a plain step), distilled")
    parser.add_argument("--sparse-draft", default="lookup", help="the draft of the sparse-verification arms")
    parser.add_argument("--draft-path", default=None, help="the distilled draft (a draft_distill run's draft/ folder)")
    parser.add_argument("--calibration", default=None, help="a dustin_calibration JSON")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--no-arr", action="store_true", help="skip the ARR pass (a dense attention per layer)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--saliency", type=int, default=0,
                        help="run the saliency-shift diagnostic on this many pointer-chasing samples (then report)")
    parser.add_argument("--make-distill-corpus", type=Path, default=None,
                        help="write suite prompts + answers (seed 1000) as JSONL for draft_distill, then exit")
    args = parser.parse_args()
    if args.make_distill_corpus is not None:
        make_distill_corpus(args.make_distill_corpus)
        return 0
    if not args.report_only:
        import torch

        from lightning_modules.llm.model.loading import load_causal_lm

        torch.set_num_threads(2)
        model, tok = load_causal_lm("smollm2-135m")
        model.requires_grad_(False)
        drafts = {}
        for name in sorted(set(args.drafts) | {args.sparse_draft}):
            draft, info = draft_config(name, args.draft_path).build(model, tok)
            if isinstance(draft, torch.nn.Module):
                draft.requires_grad_(False).eval()
            drafts[name] = draft
            print(f"[bench.speculative] draft {name}: {info}", flush=True)
        if args.saliency:
            saliency_shift(args, model, tok, drafts[args.sparse_draft])
        else:
            run(args, model, tok, drafts)
    section = report(args)
    if SALIENCY.is_file():
        import json

        section += "\n" + saliency_table(json.loads(SALIENCY.read_text())) + "\n"
    write_section("speculative", section, "Speculative decoding and Dustin (sparse verification)")
    print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
