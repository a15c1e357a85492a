"""Masked attention on CPU: the fused path against the chunked reference, in one process.

    python -m bench.masked_attention              # ~15 minutes on 2 cores
    python -m bench.masked_attention --quick      # 512 tokens, 4 decode steps, one repeat (smoke run)

Two parts, each timing BEFORE (``LITCTX_KERNEL_BACKEND=reference``: every ``litctx_kernels.attention`` call with a key
mask runs the chunked reference, as all of them did before the fused path) and AFTER (``auto``: the CPU flash
kernel with a broadcast additive key mask, or the block-sparse path with gathered key-mask blocks), interleaved
repeat by repeat so both see the same machine load:

1. **Kernel**: ``litctx_kernels.attention`` on SmolLM2-135M's attention shapes (B = 4, 9 query heads, 3 KV heads,
   d = 64, fp32) with a left-padded key mask at N = 2048: the causal prefill, one decode step (Nq = 1), a
   per-KV-head mask as AdaKV leaves it (75% of each row's keys masked, head-dependent), and a sliding window.
   Outputs are compared with the reference (max |diff| of o and of lse over rows with a valid key).
2. **Model**: SmolLM2-135M-Instruct (``load_causal_lm("smollm2-135m")``, fp32), a left-padded batch of 4 rows of
   2048 / 1792 / 1536 / 1280 tokens of the standard library's pydoc text: prefill and 32 greedy decode steps,
   (a) without a policy (the padding mask reaches attention as a key mask) and (b) under AdaKV (SnapKV scores,
   75% eviction, head-adaptive budgets: padded heads become key masks). Reported: prefill and decode wall time,
   the time spent inside ``litctx_kernels.attention`` during the prefill, and whether the greedy tokens agree (and the
   largest difference of the prefill logits).

Writes ``results/masked_attention.json`` and the "Masked attention" section of ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
from typing import Any, Callable, Dict, List
from unittest import mock

import torch

from bench._report import REPO, save_json, write_section
from litctx_common.timing import Stopwatch

RESULTS = REPO / "results" / "masked_attention.json"
COMMAND = "python -m bench.masked_attention"
BACKENDS = {"reference": "before (reference)", "auto": "after (fused)"}


def kernel_backend(name: str):
    """Set ``LITCTX_KERNEL_BACKEND`` inside the block (the dispatcher reads it at every call)."""
    from litctx_kernels.dispatch import BACKEND_ENV

    return mock.patch.dict(os.environ, {BACKEND_ENV: name})


@contextlib.contextmanager
def attention_timer(sw: Stopwatch):
    """Time every ``litctx_kernels.attention`` call made inside the block as one lap of ``sw``."""
    import litctx_kernels

    inner = litctx_kernels.attention

    def timed(*args, **kwargs):
        with sw:
            return inner(*args, **kwargs)

    litctx_kernels.attention = timed
    try:
        yield
    finally:
        litctx_kernels.attention = inner


def spread(xs: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def fmt(s: Dict[str, float], unit: float = 1.0) -> str:
    return f"{s['median'] * unit:.3g} ({s['min'] * unit:.3g}-{s['max'] * unit:.3g})"


# ---------------------------------------------------------------------------------------------------- kernel
def kernel_cases(n: int, gen: torch.Generator) -> Dict[str, Dict[str, Any]]:
    """SmolLM2 attention shapes with the masks the policy runner passes (``[B, Hk, Nk]`` boolean)."""
    b, hq, hk, d = 4, 9, 3, 64
    lengths = [n, n - n // 8, n - n // 4, n - 3 * n // 8]
    pad = torch.zeros(b, 1, n, dtype=torch.bool)
    for i, length in enumerate(lengths):
        pad[i, :, n - length:] = True
    q = torch.randn(b, hq, n, d, generator=gen)
    k, v = torch.randn(b, hk, n, d, generator=gen), torch.randn(b, hk, n, d, generator=gen)
    evict = pad.expand(b, hk, n) & (torch.rand(b, hk, n, generator=gen) < torch.tensor([0.1, 0.25, 0.4]).view(1, 3, 1))
    evict[..., -1] = True
    return {
        "prefill, left-padded": dict(q=q, k=k, v=v, key_mask=pad.expand(b, hk, n).clone(), causal=True),
        "decode step, left-padded": dict(q=q[:, :, -1:], k=k, v=v, key_mask=pad.expand(b, hk, n).clone(),
                                         causal=True),
        "decode step, AdaKV-style per-head mask": dict(q=q[:, :, -1:], k=k, v=v, key_mask=evict, causal=True),
        "prefill, left-padded, window 512": dict(q=q, k=k, v=v, key_mask=pad.expand(b, hk, n).clone(), causal=True,
                                                 window=512),
    }


def run_kernels(n: int, repeats: int) -> Dict[str, Any]:
    import litctx_kernels

    out: Dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)
    for name, case in kernel_cases(n, gen).items():
        times = {k: [] for k in BACKENDS}
        res = {}
        for r in range(repeats + 1):  # the first round warms up (not timed)
            for backend in BACKENDS:
                sw = Stopwatch("cpu")
                with sw, torch.no_grad():
                    res[backend] = litctx_kernels.attention(**case, backend=backend)
                if r:
                    times[backend].append(sw.seconds)
        (o_ref, l_ref), (o, lse) = res["reference"], res["auto"]
        fin = torch.isfinite(l_ref)
        out[name] = {
            "times_s": times, **{f"{k}_s": spread(v) for k, v in times.items()},
            "speedup": statistics.median(times["reference"]) / statistics.median(times["auto"]),
            "speedup_min": min(times["reference"]) / min(times["auto"]),
            "max_abs_diff_o": float((o - o_ref).abs().max()),
            "max_abs_diff_lse": float((lse - l_ref)[fin].abs().max()) if bool(fin.any()) else 0.0,
            "empty_rows_agree": bool(torch.equal(fin, torch.isfinite(lse))),
        }
        print(f"kernel {name}: {out[name]['speedup']:.2f}x", flush=True)
    return out


# ---------------------------------------------------------------------------------------------------- model
def padded_batch(tok, n: int) -> Dict[str, torch.Tensor]:
    from datamodules.text import pydoc_documents

    ids = tok("\n\n".join(pydoc_documents()), return_tensors="pt")["input_ids"][0]
    lengths = [n, n - n // 8, n - n // 4, n - 3 * n // 8]
    input_ids = torch.full((4, n), tok.pad_token_id if tok.pad_token_id is not None else 0, dtype=torch.long)
    mask = torch.zeros(4, n, dtype=torch.long)
    for i, length in enumerate(lengths):
        start = 3000 * i  # different text per row
        input_ids[i, n - length:] = ids[start:start + length]
        mask[i, n - length:] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "lengths": lengths}


def adakv_policy(ratio: float):
    from lightning_modules.kv_eviction.config import method_config

    return method_config("adakv", {"base": "snapkv", "base_args": {"window": 32, "compression_ratio": ratio}}).build()


def generate_once(model, batch, steps: int, policy_factory: Callable[[], Any]) -> Dict[str, Any]:
    from lightning_modules.llm.runtime.cached_lm import CachedLM
    from lightning_modules.llm.kv_policy.runner import install_policy

    policy = policy_factory()
    ctx = install_policy(model, policy) if policy is not None else contextlib.nullcontext()
    prefill, prefill_attention, decode, decode_attention = (Stopwatch("cpu") for _ in range(4))
    with ctx:
        lm = CachedLM(model)
        with prefill, attention_timer(prefill_attention):
            logits = lm.feed(batch["input_ids"], batch["attention_mask"])
        with decode, attention_timer(decode_attention):
            tokens = lm.greedy(logits, steps + 1)  # the first token comes from the prefill logits
    return {"prefill_s": prefill.seconds, "prefill_attention_s": prefill_attention.seconds, "decode_s": decode.seconds,
            "decode_attention_s": decode_attention.seconds, "tokens": tokens, "logits": logits}


def run_model(n: int, steps: int, repeats: int, ratio: float) -> Dict[str, Any]:
    from lightning_modules.llm.model.loading import load_causal_lm

    model, tok = load_causal_lm("smollm2-135m")
    batch = padded_batch(tok, n)
    scenarios = {"left-padded batch, no policy": lambda: None,
                 f"left-padded batch, AdaKV {int(ratio * 100)}% eviction": lambda: adakv_policy(ratio)}
    out: Dict[str, Any] = {"lengths": batch["lengths"], "decode_steps": steps}
    warm = {"input_ids": batch["input_ids"][:, -128:], "attention_mask": batch["attention_mask"][:, -128:]}
    for backend in BACKENDS:  # warm-up (not timed): first-call costs of the model and of each path
        with kernel_backend(backend):
            generate_once(model, warm, 2, lambda: None)
    for name, factory in scenarios.items():
        rec = {k: {"prefill_s": [], "prefill_attention_s": [], "decode_s": [], "decode_attention_s": []}
               for k in BACKENDS}
        last = {}
        for _ in range(repeats):
            for backend in BACKENDS:
                with kernel_backend(backend):
                    r = generate_once(model, batch, steps, factory)
                for key in rec[backend]:
                    rec[backend][key].append(r[key])
                last[backend] = r
        ref, fused = last["reference"], last["auto"]
        entry = {b: {k: spread(v) for k, v in rec[b].items()} for b in BACKENDS}
        entry["raw"] = rec
        entry["tokens_equal"] = ref["tokens"] == fused["tokens"]
        entry["tokens_equal_rows"] = [a == b for a, b in zip(ref["tokens"], fused["tokens"])]
        entry["max_abs_diff_prefill_logits"] = float((ref["logits"] - fused["logits"]).abs().max())
        for key in rec["auto"]:
            entry[f"speedup_{key}"] = (statistics.median(rec["reference"][key])
                                       / statistics.median(rec["auto"][key]))
            entry[f"speedup_min_{key}"] = min(rec["reference"][key]) / min(rec["auto"][key])
        out[name] = entry
        print(f"model {name}: prefill {entry['speedup_prefill_s']:.2f}x, attention in prefill "
              f"{entry['speedup_prefill_attention_s']:.2f}x, decode {entry['speedup_decode_s']:.2f}x, "
              f"tokens equal {entry['tokens_equal']}", flush=True)
    return out


# ---------------------------------------------------------------------------------------------------- report
def report(data: Dict[str, Any]) -> str:
    a = data["args"]
    lines = [
        f"Command: `{COMMAND}{' --quick' if a['quick'] else ''}` ({data['host']}, torch {data['torch']}, "
        f"{data['threads']} threads). BEFORE = `LITCTX_KERNEL_BACKEND=reference` (the chunked reference every "
        "masked call ran before), AFTER = the default dispatch (fused CPU flash kernel with a key mask). Both in "
        f"one process, interleaved; times are the median (min-max) of {a['repeats']} repeats (kernel part: "
        f"{a['kernel_repeats']} repeats after one warm-up), one fixed input (seed 0). The 2 cores were shared with "
        "other jobs, which the spread shows; minima are less sensitive to that load.",
        "",
        f"Kernel (`litctx_kernels.attention`, B = 4, Hq = 9, Hk = 3, d = 64, fp32, N = {a['n']}, rows left-padded to "
        f"{', '.join(str(x) for x in data['model'].get('lengths', []))} tokens):",
        "",
        "| case | before (ms) | after (ms) | speed-up (medians / minima) | max abs diff o / lse | empty rows agree |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in data["kernel"].items():
        lines.append(f"| {name} | {fmt(r['reference_s'], 1e3)} | {fmt(r['auto_s'], 1e3)} | {r['speedup']:.2f}x / "
                     f"{r['speedup_min']:.2f}x | "
                     f"{r['max_abs_diff_o']:.1e} / {r['max_abs_diff_lse']:.1e} | {r['empty_rows_agree']} |")
    m = data["model"]
    lines += [
        "",
        f"SmolLM2-135M-Instruct, fp32, left-padded batch of 4 (rows of {', '.join(str(x) for x in m['lengths'])} "
        f"tokens), prefill then {m['decode_steps']} greedy decode steps:",
        "",
        "| scenario | phase | before (s) | after (s) | speed-up (medians / minima) |",
        "|---|---|---|---|---|",
    ]
    for name, r in m.items():
        if not isinstance(r, dict) or "reference" not in r:
            continue
        for key, label in (("prefill_s", "prefill (whole model)"),
                           ("prefill_attention_s", "attention inside the prefill"),
                           ("decode_s", f"{m['decode_steps']} decode steps (whole model)"),
                           ("decode_attention_s", "attention inside the decode steps")):
            lines.append(f"| {name} | {label} | {fmt(r['reference'][key])} | {fmt(r['auto'][key])} | "
                         f"{r['speedup_' + key]:.2f}x / {r['speedup_min_' + key]:.2f}x |")
        lines.append(f"| {name} | outputs | greedy tokens equal: {r['tokens_equal']} "
                     f"(rows {r['tokens_equal_rows']}) | max abs diff of the prefill logits: "
                     f"{r['max_abs_diff_prefill_logits']:.1e} | |")
    lines += ["", "Record: `results/masked_attention.json`."]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048, help="padded sequence length")
    ap.add_argument("--steps", type=int, default=32, help="greedy decode steps")
    ap.add_argument("--repeats", type=int, default=3, help="model-level repeats per backend")
    ap.add_argument("--kernel-repeats", type=int, default=5)
    ap.add_argument("--ratio", type=float, default=0.75, help="AdaKV compression ratio")
    ap.add_argument("--quick", action="store_true", help="512 tokens, 4 steps, one repeat")
    ap.add_argument("--no-write", action="store_true", help="print, do not write the record or docs")
    args = ap.parse_args()
    if args.quick:
        args.n, args.steps, args.repeats, args.kernel_repeats = 512, 4, 1, 1
    data = {"args": vars(args), "host": platform.processor() or platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}
    data["kernel"] = run_kernels(args.n, args.kernel_repeats)
    data["model"] = run_model(args.n, args.steps, args.repeats, args.ratio)
    body = report(data)
    print(body)
    if not args.no_write:
        for entry in data["model"].values():
            if isinstance(entry, dict):
                entry.pop("logits", None)
        save_json(RESULTS, data)
        write_section("masked_attention", body, "Masked attention: fused CPU path against the reference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
