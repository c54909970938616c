#!/usr/bin/env bash
# The prefill GEMM on the device (the device tool runs it in the repository root with $OUT set): its GPU tests
# (tests/gpu/test_gemm.py), then, only if they pass, its benchmark (bench/bench_gemm.py, 27B shapes at M = 512
# and 4096 beside cuBLAS bf16). Logs and JSON land under $OUT: test_gemm.log, RECORD_gemm.json (the partial
# verification record, docs/verification.md), bench_gemm.log, gemm.json. About 3-4 minutes of GPU time.
# Exit status: 0 all passed, 1 the tests failed (benchmark skipped), 2 the benchmark failed a check or ran out of
# time, 4 no usable device.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?run this on the device machine (OUT unset)}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 QMK_RECORD_OUT="$OUT/RECORD_gemm.json"
python3 -c "import cupy, sys; sys.exit(0 if cupy.cuda.runtime.getDeviceCount() > 0 else 1)" || {
    echo "gemm_device.sh: no usable CUDA device" >&2; exit 4; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/nvidia-smi.csv" 2>&1
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_gemm.py 2>&1 | tee "$OUT/test_gemm.log"
if [[ ${PIPESTATUS[0]} -ne 0 ]]; then
    echo "gemm_device.sh: tests/gpu/test_gemm.py failed; benchmark skipped" >&2
    exit 1
fi
timeout 200 python3 bench/bench_gemm.py --out "$OUT" 2>&1 | tee "$OUT/bench_gemm.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || exit 2
