#!/usr/bin/env bash
# RMSNorm fused into the GEMV launch (issue 5; bench/probes/norm_probe.py) on the lent H200: bit identity of the
# 27B decode step with fuse_norm off/on (8 teacher-forced graph replays, PDL on: whole activation arena + argmax
# per step, split-K scratch, GDN state, conv rings, KV at the end) and step ms/token at context 1024 for both.
# Writes $OUT/norm_probe.json and $OUT/norm_probe.log; ~1 min, time-boxed at 150 s.
# Usage (device, repository root): bash scripts/norm_probe.sh [probe] [tests]   (default: probe)
#   tests: also tests/gpu/test_fuse_norm.py and tests/gpu/test_pdl.py (tiny preset; record copy at
#          $OUT/RECORD.json, marked incomplete since it is two files), time-boxed at 200 s.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?run this on the device machine (OUT unset)}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER QMK_COMMIT="${QMK_COMMIT:-unknown}"
parts=("$@"); [[ ${#parts[@]} -eq 0 ]] && parts=(probe)
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/nvidia-smi.csv" 2>&1
for p in "${parts[@]}"; do
    case "$p" in
    probe)
        timeout 150 python3 -m bench.probes.norm_probe --out "$OUT" 2>&1 | tee "$OUT/norm_probe.log" | tail -20
        s=${PIPESTATUS[0]}; echo "norm_probe: exit $s"; (( s )) && status=$s ;;
    tests)
        QMK_RECORD_OUT="$OUT/RECORD.json" timeout 200 python3 -m pytest -q -rs tests/gpu/test_fuse_norm.py \
            tests/gpu/test_pdl.py 2>&1 | tee "$OUT/test_fuse_norm.log" | tail -15
        s=${PIPESTATUS[0]}; echo "test_fuse_norm: exit $s"; (( s )) && status=$s ;;
    *) echo "unknown part $p (probe | tests)"; status=2 ;;
    esac
done
exit "$status"
