"""GPU tests: skipped without a CUDA device; when they do run on one, the run is recorded.

* Every test under ``tests/gpu`` (and any test marked ``@pytest.mark.gpu``) is skipped unless
  ``cupy.cuda.runtime.getDeviceCount() > 0``; the skip reason says why (no CuPy, no driver, no device).
* The ``gpu`` fixture returns a dict describing device 0 (``name``, ``compute_capability``, ``sm_count``,
  ``driver_version``, ``cuda_driver_api``, ``cuda_runtime``) and skips without a device.
* When at least one test here ran on a device (not all skipped), the session writes
  ``tests/gpu/RECORD.json`` (only if the run was complete: nothing deselected, every test file collected,
  every test reported) and a copy to ``$QMK_RECORD_OUT`` when set (always); format and the CPU-side check:
  ``tests/gpu_record.py``, ``docs/verification.md``.
"""
from __future__ import annotations

import functools
import platform
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:  # `pytest` without `python3 -m` does not put the repo root on sys.path
    sys.path.insert(0, str(_ROOT))
from tests.gpu_record import RECORD_PATH, RecordCollector, write_record  # noqa: E402

_GPU_DIR = Path(__file__).resolve().parent
_collector: RecordCollector | None = None
_written: list[Path] = []


@functools.lru_cache(maxsize=1)
def gpu_status() -> tuple[bool, str]:
    """(a CUDA device is usable, reason when not)."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA install raising at import
        return False, f"CuPy unavailable: {type(e).__name__}: {e}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # cudaErrorInsufficientDriver / NoDevice on a GPU-less machine
        return False, f"no CUDA device: {type(e).__name__}: {e}"
    return (n > 0), f"cupy.cuda.runtime.getDeviceCount() = {n}"


def _nvidia_smi_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=1)
def device_info() -> dict:
    """Device 0 as recorded: name, compute capability, SM count, driver (nvidia-smi) and CUDA versions."""
    import cupy
    rt = cupy.cuda.runtime
    p = rt.getDeviceProperties(0)
    name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
    return {"name": name, "compute_capability": f"{p['major']}.{p['minor']}",
            "sm_count": int(p["multiProcessorCount"]), "driver_version": _nvidia_smi_driver(),
            "cuda_driver_api": int(rt.driverGetVersion()), "cuda_runtime": int(rt.runtimeGetVersion()),
            "cupy": cupy.__version__, "device_count": int(rt.getDeviceCount())}


def _in_gpu_dir(nodeid_or_path) -> bool:
    p = Path(str(nodeid_or_path).split("::")[0])
    p = p if p.is_absolute() else _ROOT / p
    return p.resolve().is_relative_to(_GPU_DIR)


@pytest.fixture
def gpu() -> dict:
    """Device 0's description (see :func:`device_info`); skips the test without a CUDA device."""
    ok, why = gpu_status()
    if not ok:
        pytest.skip(why)
    return device_info()


def pytest_collection_modifyitems(config, items):
    ok, why = gpu_status()
    for item in items:
        if _in_gpu_dir(item.path) or item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.gpu)
            if not ok:
                item.add_marker(pytest.mark.skip(reason=why))


def _get_collector() -> RecordCollector:
    global _collector
    if _collector is None:
        _collector = RecordCollector(_ROOT)
    return _collector


def pytest_deselected(items):
    _get_collector().deselect([i.nodeid for i in items if _in_gpu_dir(i.path)])


def pytest_collection_finish(session):
    _get_collector().expect([i.nodeid for i in session.items if _in_gpu_dir(i.path)])


def pytest_collectreport(report):
    if report.failed and _in_gpu_dir(report.nodeid or "."):
        _get_collector().add_report(report)


def pytest_runtest_logreport(report):
    if _in_gpu_dir(report.nodeid):
        _get_collector().add_report(report)


def pytest_sessionfinish(session, exitstatus):
    col = _get_collector()
    if not gpu_status()[0] or not col.ran_any():
        return  # nothing ran on a device: leave the last record alone
    extra = {"python": platform.python_version(), "host": platform.node(),
             "args": [str(a) for a in session.config.invocation_params.args], "exit_status": int(exitstatus),
             "commit": _git_head()}
    rec = col.record(device_info(), extra)
    # a partial run (-k, -m, one file, -x) never replaces the repository's record; $QMK_RECORD_OUT still gets it
    _written[:] = write_record(rec, RECORD_PATH if rec["complete"] else None)
    if not rec["complete"]:
        _written.append(f"(not {RECORD_PATH.name}: incomplete run: {'; '.join(rec['incomplete_reasons'])})")


def pytest_terminal_summary(terminalreporter):
    for p in _written:
        terminalreporter.write_line(f"GPU test record: {p}")


def _git_head() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
