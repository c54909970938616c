#!/usr/bin/env bash
# Megakernel check on the device (run by the device tool in the repository root with $OUT set), < 4 minutes (45 + 85 + 100 s timeouts):
# NVRTC warm-up of the megakernel modules, tests/gpu/test_megakernel.py (bit identity vs the graph path, knobs,
# persistent loop, removed dependency), then bench/bench_megakernel.py on the 27B synthetic preset at a 1k context
# (megakernel.json + megakernel_timings.json.xz with per-instruction stamps). Everything lands in $OUT.
# Usage: bash scripts/mk_check.sh [--no-bench]
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?run this on the device machine (OUT unset)}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/nvidia-smi.csv" 2>&1
# compile every module both presets need in parallel (fills CuPy's cache; a compile error shows here first)
timeout 45 python3 -m megakernel.warm tiny qwen3.5-27b 2>&1 | tee "$OUT/warm.log" | tail -20
timeout 85 python3 -m pytest -q -rA --timeout 45 --timeout-method thread tests/gpu/test_megakernel.py 2>&1 \
    | tee "$OUT/test_megakernel.log" | tail -40
status=${PIPESTATUS[0]}
if [[ "${1:-}" != "--no-bench" ]]; then
    timeout 100 python3 bench/bench_megakernel.py --preset qwen3.5-27b --context 1024 --steps 20 --out "$OUT" 2>&1 \
        | tee "$OUT/bench_megakernel.log" | tail -40
    b=${PIPESTATUS[0]}
    [[ $status -eq 0 ]] && status=$b
fi
echo "mk_check.sh: exit $status ($SECONDS s)"
exit "$status"
