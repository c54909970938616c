#!/usr/bin/env bash
# ncu profile of the token mixers and the M = 1 GEMV kernels (device machine, $OUT set): per-kernel details
# (speed of light, warp states, scheduler, memory) and per-SASS-instruction stall samples as CSV under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD CUDA_MODULE_LOADING=EAGER PYTHONUNBUFFERED=1
S="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis --section SourceCounters"
ncu --clock-control none -k regex:'qmk_gdn|qmk_attn' $S -f -o "$OUT/mixers" \
    python3 -m bench.probes.mixer_probe --calls 1 > "$OUT/ncu_mixers.log" 2>&1
echo "mixers: exit $?"
ncu --clock-control none -k regex:gemv_fp8 --launch-count 2 $S -f -o "$OUT/gemv" \
    python3 -m bench.probes.gemv_probe --ncu-target > "$OUT/ncu_gemv.log" 2>&1
echo "gemv: exit $?"
for r in mixers gemv; do
    ncu --import "$OUT/$r.ncu-rep" --page details --csv > "$OUT/${r}_details.csv" 2>&1
    ncu --import "$OUT/$r.ncu-rep" --page source --csv --print-source sass > "$OUT/${r}_source.csv" 2>&1
    echo "$r export: $(wc -c < "$OUT/${r}_details.csv") / $(wc -c < "$OUT/${r}_source.csv") bytes"
done
gzip -f "$OUT"/*_source.csv
tail -5 "$OUT/ncu_mixers.log" "$OUT/ncu_gemv.log"
