#!/usr/bin/env bash
# The test command: CPU tests, CUDA compile checks for sm_90, and the GPU-record check.
# GPU tests (tests/gpu) skip without a device; run them on the H200 with scripts/gpu_tests.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pytest -q -m "not slow" tests "$@"
