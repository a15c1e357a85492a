#!/usr/bin/env bash
# The prepared GPU check for the shared attention kernels (one H200, well under 10 minutes):
#   1. the Triton parity tests compiled on CUDA (fp16 and bf16, N = 4K-16K): tests/kernels/test_triton_gpu.py
#   2. dense K1 against SDPA/FlashAttention and block-sparse K1 at densities {5,10,25,50,100}% at N = 16K-64K:
#      python -m bench.triton_attention_gpu
# Everything it measures lands as JSON/logs in $OUT (default bench/results/gpu). Usage:
#   bash bench/gpu_check.sh            # on a machine with a CUDA GPU, torch and triton
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
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
start=$(date +%s)
timeout 270 "$PY" -m pytest -q -m gpu tests/kernels -p no:cacheprovider -o addopts="" --timeout 250 \
  --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
# K6 (LSSAR forward) compiled: its interpreter parity tests run on CUDA when TRITON_INTERPRET is unset
timeout 120 "$PY" -m pytest -q tests/kernels/test_triton_lssar.py -p no:cacheprovider -o addopts="" 2>&1 \
  | tee "$OUT/gpu_lssar.log"
tests_rc=${PIPESTATUS[0]}
echo "gpu parity tests: exit $tests_rc after $(( $(date +%s) - start )) s"
timeout 200 "$PY" -m bench.triton_attention_gpu --budget-s 170 --out "$OUT/triton_attention_gpu.json" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu bench: exit $bench_rc after $(( $(date +%s) - start )) s"
echo "{\"tests_rc\": $tests_rc, \"bench_rc\": $bench_rc, \"seconds\": $(( $(date +%s) - start ))}" > "$OUT/summary.json"
exit $(( tests_rc != 0 || bench_rc != 0 ))
