"""Render the GPU check's JSON (``bench/gpu_check.sh`` -> ``bench/results/gpu/``) into ``docs/results.md``.

    bash bench/gpu_check.sh                      # on the GPU machine, OUT=bench/results/gpu
    python -m bench.gpu_report                   # here: writes the 'attention_gpu' section
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench._report import REPO, write_section


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=REPO / "bench" / "results" / "gpu")
    p.add_argument("--results", type=Path, default=REPO / "docs" / "results.md")
    args = p.parse_args()
    bench = json.loads((args.dir / "triton_attention_gpu.json").read_text())
    env = json.loads((args.dir / "env.json").read_text())
    log = (args.dir / "gpu_tests.log").read_text().strip().splitlines()
    tests_line = next((ln for ln in reversed(log) if "passed" in ln or "failed" in ln), "no test summary")
    lines = [f"Command: `bash bench/gpu_check.sh` on one {env['device']} (torch {env['torch']}, triton {env['triton']}, "
             f"CUDA {env['cuda']}); {bench['dtype']}, B = {bench['B']}, H = {bench['H']}, d = {bench['d']}; "
             f"timing: {bench['timing']}. Raw JSON: `bench/results/gpu/`.",
             "",
             f"Compiled parity tests (`pytest -m gpu tests/kernels`, fp16/bf16/fp32 at N = 4K-16K): **{tests_line}**",
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
    print(f"wrote the attention_gpu section of {args.results}")


if __name__ == "__main__":
    main()
