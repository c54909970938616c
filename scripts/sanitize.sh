#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over the tiny-preset megakernel and discrete-step GPU tests, on the
# lent H200 (the device tool sets $OUT). Each tool's summary goes to $OUT/sanitize_<tool>_<what>.txt.
# Usage: bash scripts/sanitize.sh [memcheck-mk|memcheck-step|racecheck-mk|synccheck-mk|memcheck-gemv|racecheck-gemv|
#        memcheck-mixers|racecheck-mixers ...]
# (default: the four megakernel / step runs, each time-boxed: 150 + 70 + 420 + 100 s, more than one 600 s device
# call, so give racecheck-mk a call of its own). The *-gemv runs cover the M = 1 GEMV
# kernels (cp.async ring, register tile, TMA ring: mbarriers, async-proxy shared-memory writes) on the tiny shapes;
# the *-mixers runs the GDN step and the four attention kernels on the tiny shapes.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?run this on the device machine (OUT unset)}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
san() {  # tool, label, seconds, pytest args...
    local tool=$1 label=$2 secs=$3; shift 3
    # --report-api-errors no: cuda-bindings probes driver entry points at import (cuGetProcAddress_v2 answers
    # CUDA_ERROR_INVALID_VALUE for symbols this driver lacks); those host API answers are not kernel errors
    timeout "$secs" compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 --print-limit 20 \
        python3 -m pytest -q -x -p no:cacheprovider "$@" > "$OUT/sanitize_${tool}_${label}.txt" 2>&1
    echo "$tool $label: exit $? — $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$OUT/sanitize_${tool}_${label}.txt" | tail -2 | tr '\n' ' ')"
}
# the megakernel tests with 4 steps instead of 64 (QMK_MK_TEST_STEPS): same code paths, a time box that finishes
export QMK_MK_TEST_STEPS=${QMK_MK_TEST_STEPS:-4}
runs=("$@"); [[ ${#runs[@]} -eq 0 ]] && runs=(memcheck-mk memcheck-step racecheck-mk synccheck-mk)
for r in "${runs[@]}"; do
    case "$r" in
    memcheck-mk) san memcheck megakernel 150 tests/gpu/test_megakernel.py \
        -k "test_m1_greedy_64_steps_bit_identical or test_m_rows_teacher_forced_bit_identical[3]" ;;
    memcheck-step) san memcheck step 70 tests/gpu/test_step.py -k "test_rows_bit_identical_to_single" ;;
    # the default (reduce_instr) program's 6 variants, ≈ 35 s each under racecheck (all 12 outrun a 150 s box)
    racecheck-mk) san racecheck megakernel 420 tests/gpu/test_megakernel.py \
        -k "test_m1_greedy_64_steps_bit_identical and reduce_instr" ;;
    synccheck-mk) san synccheck megakernel 100 tests/gpu/test_megakernel.py \
        -k "test_m1_greedy_64_steps_bit_identical and program" ;;
    memcheck-gemv) san memcheck gemv 120 tests/gpu/test_gemv.py -k "test_m1_kernels_bit_identical and tiny" ;;
    racecheck-gemv) san racecheck gemv 120 tests/gpu/test_gemv.py -k "test_m1_kernels_bit_identical and tiny" ;;
    memcheck-mixers) san memcheck mixers 100 tests/gpu/test_gdn.py tests/gpu/test_attention.py -k "tiny" ;;
    racecheck-mixers) san racecheck mixers 100 tests/gpu/test_gdn.py tests/gpu/test_attention.py -k "tiny and multirow" ;;
    *) echo "sanitize.sh: unknown run $r (memcheck-mk memcheck-step racecheck-mk synccheck-mk memcheck-gemv" \
            "racecheck-gemv memcheck-mixers racecheck-mixers)"; exit 2 ;;
    esac
done
