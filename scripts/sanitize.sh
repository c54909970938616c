#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over the tiny-preset megakernel and discrete-step GPU tests, on the
# lent H200 (the device tool sets $OUT). Each tool's summary goes to $OUT/sanitize_<tool>_<what>.txt.
# Usage: bash scripts/sanitize.sh     (about 3-5 minutes; each run is time-boxed)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?run this on the device machine (OUT unset)}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
san() {  # tool, label, seconds, pytest args...
    local tool=$1 label=$2 secs=$3; shift 3
    timeout "$secs" compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
        python3 -m pytest -q -x -p no:cacheprovider "$@" > "$OUT/sanitize_${tool}_${label}.txt" 2>&1
    echo "$tool $label: exit $? — $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$OUT/sanitize_${tool}_${label}.txt" | tail -2 | tr '\n' ' ')"
}
san memcheck megakernel 130 tests/gpu/test_megakernel.py -k "test_m1_greedy_64_steps_bit_identical or test_m_rows_teacher_forced_bit_identical"
san memcheck step 70 tests/gpu/test_step.py -k "test_rows_bit_identical_to_single"
san racecheck megakernel 130 tests/gpu/test_megakernel.py -k "test_m1_greedy_64_steps_bit_identical"
