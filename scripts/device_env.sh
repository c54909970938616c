# Sourced by the scripts run on the lent H200 (device_run.sh, replay_device.sh) from the repository root: checks
# that $OUT is set, installs the carried wheels of `.whl/` into /tmp/site (exit 2 if that fails) and exports
# PYTHONPATH, PYTHONUNBUFFERED, CUDA_MODULE_LOADING=EAGER and QMK_COMMIT (default "unknown").
: "${OUT:?run this on the device machine (OUT unset)}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 2
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER QMK_COMMIT="${QMK_COMMIT:-unknown}"
