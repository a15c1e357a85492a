"""Render the GPU check's JSON (``bench/gpu_check.sh`` -> ``results/gpu/``) into ``docs/results.md``.

    bash bench/gpu_check.sh                      # on the GPU machine, OUT=results/gpu
    python -m bench.gpu_report                   # here: writes the 'attention_gpu' section
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench._report import REPO, write_section


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=REPO / "results" / "gpu")
    p.add_argument("--results", type=Path, default=REPO / "docs" / "results.md")
    args = p.parse_args()
    bench = json.loads((args.dir / "triton_attention_gpu.json").read_text())
    env = json.loads((args.dir / "env.json").read_text())
    log_file = args.dir / "tests.log" if (args.dir / "tests.log").is_file() else args.dir / "gpu_tests.log"
    log = log_file.read_text().strip().splitlines()
    summaries = [ln.strip() for ln in log if "passed" in ln or "failed" in ln]
    tests_line = summaries[0] if summaries else "no test summary"
    compiled_line = summaries[1] if len(summaries) > 1 else None
    lines = [f"Command: `bash bench/gpu_check.sh` on one {env['device']} (torch {env['torch']}, triton {env['triton']}, "
             f"CUDA {env['cuda']}); {bench['dtype']}, B = {bench['B']}, H = {bench['H']}, d = {bench['d']}; "
             f"timing: {bench['timing']}. Raw JSON: `results/gpu/`.",
             "",
             f"Compiled parity tests (`pytest -m gpu tests/kernels`, fp16/bf16/fp32 at N = 4K-16K): **{tests_line}**"
             + (f"; the interpreter parity tests of K6 (LSSAR) and K4 (SALE's estimate) compiled on CUDA: "
                f"**{compiled_line}**" if compiled_line else ""),
             "",
             "Dense causal K1/K2 against SDPA with the FlashAttention backend forced:",
             "",
             "| N | K1 fwd ms | SDPA-flash fwd ms | K1 TFLOP/s | K1+K2 fwd+bwd ms | SDPA-flash fwd+bwd ms | max abs diff |",
             "|---|---|---|---|---|---|---|"]
    for r in bench["dense"]:
        lines.append(f"| {r['N']} | {r['triton_fwd_ms']:.3f} | {r.get('sdpa_flash_fwd_ms', float('nan')):.3f} | "
                     f"{r['triton_fwd_tflops']:.0f} | {r.get('triton_fwd_bwd_ms', float('nan')):.3f} | "
                     f"{r.get('sdpa_flash_fwd_bwd_ms', float('nan')):.3f} | {r.get('max_abs_diff_vs_sdpa', float('nan')):.4f} |")
    lines += ["", "Block-sparse K1 forward (random per-head causal layouts, 128 x 128 blocks, `BlockLayout.random_causal`), "
              "against dense K1 and SDPA with its default backend choice:", "",
              "| N | density | sparse ms | dense K1 ms | SDPA ms | vs SDPA | vs dense K1 | FLOP bound | sparse fwd+bwd ms | "
              "dense K1+K2 fwd+bwd ms | SDPA fwd+bwd ms | fwd+bwd vs SDPA |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in bench["sparse"]:
        lines.append(f"| {r['N']} | {r['pair_density']:.3f} | {r['sparse_fwd_ms']:.3f} | {r['dense_causal_fwd_ms']:.3f} | "
                     f"{r['sdpa_causal_fwd_ms']:.3f} | {r['speedup_vs_sdpa']:.2f}x | {r['speedup_vs_dense']:.2f}x | "
                     f"{r['ideal_speedup']:.1f}x | {r.get('sparse_fwd_bwd_ms', float('nan')):.3f} | "
                     f"{r.get('dense_fwd_bwd_ms', float('nan')):.3f} | {r.get('sdpa_fwd_bwd_ms', float('nan')):.3f} | "
                     f"{r.get('fwd_bwd_speedup_vs_sdpa', float('nan')):.2f}x |")
    write_section("attention_gpu", "\n".join(lines), "Attention kernels on a GPU (Triton, H200)", path=args.results)
    if (args.dir / "e2e.json").is_file():
        write_section("gpu_e2e", e2e_table(json.loads((args.dir / "e2e.json").read_text())),
                      "Sparse prefill end to end on a GPU (SmolLM2-135M-Instruct, H200)", path=args.results)


def e2e_table(data: dict) -> str:
    """The end-to-end part (``bench/gpu_e2e.py``): one row per (length, method)."""
    rope = ", ".join(f"{int(n) // 1024}K: {r}" for n, r in data.get("rope", {}).items())
    out = [f"Command: `bash bench/gpu_check.sh` (part 2, `python -m bench.gpu_e2e`) on one {data['device']} (torch "
           f"{data['torch']}), {data['dtype']}, the suite's `niah_single` prompt at each length, RoPE {rope}; median "
           f"of {data['reps']} prefills after one warm-up. Estimate and attention are summed over the 30 layers "
           "(each lap synchronised); wall is the whole forward. `sdpa` is the stock Hugging Face attention, "
           "`dense` the litctx runner with dense Triton K1.", "",
           "| N | method | density | estimate ms | attention ms | estimate + attention vs dense attention | wall ms | "
           "wall vs SDPA | next token = dense |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        if "error" in r:
            out.append(f"| {r['n'] // 1024}K | {r['method']} | error: {r['error'][:80]} | | | | | | |")
            continue
        att = "-" if r["method"] == "sdpa" else f"{1e3 * r['attention_s']:.1f}"
        est = "-" if r["method"] in ("sdpa", "dense") else f"{1e3 * r['estimate_s']:.1f}"
        ratio = r.get("attention_speedup_vs_dense")
        same = r.get("same_next_token_as_dense")
        out.append(f"| {r['n'] // 1024}K | {r['method']} | {100 * r['density']:.1f}% | {est} | {att} | "
                   f"{'-' if ratio is None or r['method'] in ('sdpa', 'dense') else f'{ratio:.2f}x'} | "
                   f"{1e3 * r['wall_s']:.1f} | {r.get('wall_speedup_vs_sdpa', float('nan')):.2f}x | "
                   f"{'-' if same is None else ('yes' if same else 'no')} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
