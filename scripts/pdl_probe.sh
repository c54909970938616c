#!/usr/bin/env bash
# Programmatic Dependent Launch probe on the lent H200 (issue 5; bench/probes/pdl_probe.py): bit identity of the
# 27B decode step with PDL off/on (8 teacher-forced + 8 greedy graph replays, one eager step), step ms/token at
# context 1024 (pdl off / all / gemv-only), and a 64-layer gate|up + down GEMV graph with and without PDL
# (+ L2-prefetch depth sweep). Writes $OUT/pdl_probe.json and $OUT/pdl_probe.log; ~1-2 min, time-boxed at 230 s.
# Usage (device, repository root): bash scripts/pdl_probe.sh [probe] [tests] [quick]   (default: probe)
#   tests: also the GPU tests of tests/gpu/test_pdl.py (tiny preset; record copy at $OUT/RECORD.json, marked
#          incomplete since it is one file), time-boxed at 150 s.   quick: GEMV micro without the prefetch sweep.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?run this on the device machine (OUT unset)}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER QMK_COMMIT="${QMK_COMMIT:-unknown}"
parts=("$@"); [[ ${#parts[@]} -eq 0 ]] && parts=(probe)
quick=(); [[ " ${parts[*]} " == *" quick "* ]] && quick=(--quick)
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/nvidia-smi.csv" 2>&1
for p in "${parts[@]}"; do
    case "$p" in
    probe)
        timeout 230 python3 -m bench.probes.pdl_probe --out "$OUT" "${quick[@]}" 2>&1 | tee "$OUT/pdl_probe.log" | tail -25
        s=${PIPESTATUS[0]}; echo "pdl_probe: exit $s"; (( s )) && status=$s ;;
    tests)
        QMK_RECORD_OUT="$OUT/RECORD.json" timeout 150 python3 -m pytest -q -rs tests/gpu/test_pdl.py 2>&1 \
            | tee "$OUT/test_pdl.log" | tail -15
        s=${PIPESTATUS[0]}; echo "test_pdl: exit $s"; (( s )) && status=$s ;;
    quick) ;;
    *) echo "unknown part $p (probe | tests | quick)"; status=2 ;;
    esac
done
exit "$status"
