"""Shared timing helpers for kernel benchmarks (STYLE habit 11; article Part 9).

* Operand rotation: a benchmark passes one launch closure per distinct operand copy; :func:`copies_for` sizes
  the rotation so the copies together exceed 2 × L2 (126 MB on the H200), so every timed call reads DRAM.
* :func:`time_rotation` captures all closures, in order, into one CUDA graph (launch overhead as in the
  discrete path: ~0.7 µs per node), replays it after warm-up, times each replay with CUDA events and returns
  the median milliseconds per closure.
* :func:`result_file` writes JSON with device name, driver, git commit (env QMK_COMMIT, else git), date.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path

import numpy as np

H200_READ_GBPS = 4468.0      # measured read bandwidth, shared/spec/h200.md
ROTATE_BYTES = 126_000_000   # more than 2 × 60 MiB L2


def cpu_name() -> str:
    """The host CPU's model name (``/proc/cpuinfo``), for result files of benchmarks that run on the CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def copies_for(nbytes: int, min_total: int = ROTATE_BYTES) -> int:
    """Distinct operand copies needed so that copies · nbytes > min_total (at least 1)."""
    return max(1, -(-(min_total + 1) // max(1, nbytes)))


def time_rotation(launches, warmup: int = 3, reps: int = 25) -> dict:
    """Median / min / max milliseconds per closure of ``launches`` (each enqueues one call on the current
    stream), from ``reps`` event-timed replays of one CUDA graph holding all closures in order."""
    import cupy as cp
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for f in launches:
            f()
        graph = stream.end_capture()
    t = replay_times_ms(graph, stream, warmup, reps) / len(launches)
    return {"median_ms": float(np.median(t)), "min_ms": float(t.min()), "max_ms": float(t.max()),
            "reps": reps, "calls_per_replay": len(launches)}


def replay_times_ms(graph, stream, warmup: int = 3, reps: int = 25) -> np.ndarray:
    """Milliseconds of each of ``reps`` replays of ``graph`` on ``stream`` (CUDA events around each replay),
    after ``warmup`` untimed replays."""
    import cupy as cp
    for _ in range(warmup):
        graph.launch(stream)
    stream.synchronize()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        graph.launch(stream)
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return np.asarray(times)


def events_ms(stream, fn, divide_by: int = 1) -> float:
    """Milliseconds between two CUDA events recorded on ``stream`` around one call of ``fn`` (which enqueues
    work on it), divided by ``divide_by`` (the steps or replays ``fn`` runs)."""
    import cupy as cp
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record(stream)
    fn()
    b.record(stream)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / divide_by


def bandwidth(nbytes: int, ms: float) -> dict:
    gbps = nbytes / (ms * 1e-3) / 1e9
    return {"bytes": int(nbytes), "gbps": round(gbps, 1), "pct_of_4468": round(100.0 * gbps / H200_READ_GBPS, 2)}


def device_meta() -> dict:
    import cupy as cp
    p = cp.cuda.runtime.getDeviceProperties(0)
    name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        drv = None
    return {"device": name, "sm_count": int(p["multiProcessorCount"]), "l2_bytes": int(p["l2CacheSize"]),
            "driver": drv, "cuda_runtime": int(cp.cuda.runtime.runtimeGetVersion()), "cupy": cp.__version__}


def commit() -> str | None:
    if os.environ.get("QMK_COMMIT"):
        return os.environ["QMK_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def result_file(name: str, results: list[dict], extra: dict | None = None, out_dir: str | None = None) -> Path:
    """Write ``{out_dir or bench/results}/{name}.json`` with metadata and ``results``; returns the path."""
    d = Path(out_dir) if out_dir else Path(__file__).resolve().parent / "results"
    d.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, **device_meta(), "commit": commit(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "bandwidth_reference_gbps": H200_READ_GBPS, **(extra or {}), "results": results}
    p = d / f"{name}.json"
    p.write_text(json.dumps(doc, indent=1) + "\n")
    return p
