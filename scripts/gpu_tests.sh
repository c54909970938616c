#!/usr/bin/env bash
# Runs every GPU test (tests/gpu) on the device and leaves the verification record tests/gpu/RECORD.json,
# plus a copy at $QMK_RECORD_OUT (default: $OUT/RECORD.json when $OUT is set, as on the lent device machine).
# Extra arguments go to pytest; any that deselect tests (-k, -m, a single file) make the run incomplete: then
# only the $QMK_RECORD_OUT copy is written (marked incomplete) and this script exits 3. Partial runs over the
# same sources that together cover everything merge into one record:
#   python3 -m tests.gpu_record merge tests/gpu/RECORD.json part1.json part2.json
# See docs/verification.md.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${QMK_RECORD_OUT:-}" && -n "${OUT:-}" ]]; then
    export QMK_RECORD_OUT="$OUT/RECORD.json"
fi
python3 - <<'EOF' || exit 2
import sys
try:
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
except Exception as e:
    sys.exit(f"gpu_tests.sh: no usable CUDA device ({type(e).__name__}: {e}); GPU tests would only skip")
if n < 1:
    sys.exit("gpu_tests.sh: cupy sees 0 CUDA devices; GPU tests would only skip")
p = cupy.cuda.runtime.getDeviceProperties(0)
print(f"gpu_tests.sh: device 0 = {p['name'].decode() if isinstance(p['name'], bytes) else p['name']}, "
      f"cupy {cupy.__version__}, python {sys.version.split()[0]}")
EOF
stamp=$(mktemp)
sleep 1  # mtime granularity: a record written by this run is strictly newer than the stamp
python3 -m pytest -q -rs tests/gpu "$@"
status=$?
if [[ ! tests/gpu/RECORD.json -nt "$stamp" ]]; then
    echo "gpu_tests.sh: tests/gpu/RECORD.json was not updated (no GPU test ran, or the run was partial:" \
         "see the 'GPU test record' line above)" >&2
    [[ $status -eq 0 ]] && status=3
fi
rm -f "$stamp"
# What CI will say about this record against the sources as they are now:
python3 -m tests.gpu_record check
exit "$status"
