"""The CPU executors on the tiny preset: prefill tokens/s and decode ms/token of the fast float32 ``cpu`` executor
(``host/cpu_fast.py``), optionally beside the bit-exact ``cpu-vm`` executor, plus the machine's state.

``python3 -m bench.bench_cpu_executor [--model DIR] [--prefill 256] [--decode 32] [--reps 3] [--vm-steps 2]
[--out DIR]``

Checks before it times (a failed check aborts, exit 1): the fast path's logits against ``ReferenceModel`` on the
prose golden prompt (prefill of 80 rows + 2 decode steps) pass ``host.cpu_fast.agreement`` (the tolerance of
tests/cpu/test_cpu_fast.py). Prefill: ``executor.prefill`` of ``--prefill`` ids in one call from an empty slot
(256 = the session's longest piece, ``host.session.PREFILL_PIECE``), median of ``--reps``. Decode:
``executor.step`` after that prefill, median and mean over ``--decode`` steps (host-side sampling excluded).
The machine is shared: the JSON carries ``nproc``, the load averages before and after, and the BLAS thread
environment. Prints the JSON; writes it to ``--out``/cpu_executor.json when ``--out`` is given (the GPU
table of bench/README.md reads only bench/results/*.json, so CPU results belong in bench/results/e2e/).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from assembler.ref.envelope import GOLDEN_SUFFIX, load_golden
from assembler.ref.model import ReferenceModel
from assembler.ref.numerics import f32
from bench.harness import commit, cpu_name
from host.cpu_fast import FastModel, agreement
from host.executors import make_executor
from loader.checkpoint import Checkpoint
from loader.synthetic import ensure_checkpoint

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden"


def _check(weights, ids) -> dict:
    out = []
    for m in (FastModel(weights), ReferenceModel(weights)):
        st = m.new_state(128)
        rows = [f32(m.prefill(st, ids[:80]))] + [f32(m.decode(st, ids[t:t + 1])) for t in (80, 81)]
        out.append(np.concatenate(rows))
    stats, fails = agreement(*out)
    return {"ok": not fails, "failures": fails, **stats}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.bench_cpu_executor", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the tiny synthetic one)")
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--vm-steps", type=int, default=2, help="cpu-vm decode steps to time (0: skip the VM)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    load0 = os.getloadavg()
    weights = Checkpoint.open(a.model or ensure_checkpoint("tiny"))
    prose = load_golden(GOLDEN / f"oracle_prose{GOLDEN_SUFFIX}")["ids"].astype(np.int64)
    ids = np.resize(prose, a.prefill)
    check = _check(weights, prose)
    if not check["ok"]:
        print(json.dumps({"check": check}, indent=1))
        return 1
    cap = a.prefill + a.decode + 8
    t0 = time.perf_counter()
    ex = make_executor("cpu", weights, cap, slots=1)
    load_s = time.perf_counter() - t0
    pre = []
    for _ in range(a.reps + 1):                                           # first call: warm-up
        ex.reset(0)
        t = time.perf_counter()
        out = ex.prefill(ids)
        pre.append(time.perf_counter() - t)
    pre = pre[1:]
    dec, tok = [], int(np.argmax(out.logits.astype(np.float32)))
    for _ in range(a.decode):
        t = time.perf_counter()
        out = ex.step(tok)
        dec.append((time.perf_counter() - t) * 1e3)
        tok = int(np.argmax(out.logits.astype(np.float32)))
    p_med = statistics.median(pre)
    rows = [{"name": "cpu executor prefill", "shape": f"tiny T={a.prefill}", "ms": round(p_med * 1e3, 2),
             "tokens_per_s": round(a.prefill / p_med, 1), "all_ms": [round(x * 1e3, 2) for x in pre]},
            {"name": "cpu executor decode step", "shape": f"tiny context {a.prefill}..{a.prefill + a.decode}",
             "ms": round(statistics.median(dec), 2), "mean_ms": round(statistics.fmean(dec), 2),
             "min_ms": round(min(dec), 2), "max_ms": round(max(dec), 2), "steps": a.decode}]
    if a.vm_steps > 0:
        t0 = time.perf_counter()
        vm = make_executor("cpu-vm", weights, 64, slots=1)
        vm_load = time.perf_counter() - t0
        vm.reset(0)
        vm.prefill(prose[:16])
        vdec = []
        for t in range(a.vm_steps):
            s = time.perf_counter()
            vm.step(int(prose[16 + t]))
            vdec.append((time.perf_counter() - s) * 1e3)
        rows.append({"name": "cpu-vm executor decode step", "shape": "tiny context 16", "load_s": round(vm_load, 1),
                     "ms": round(statistics.median(vdec), 1), "all_ms": [round(x, 1) for x in vdec]})
    doc = {"benchmark": "cpu_executor", "device": cpu_name(), "nproc": os.cpu_count(),
           "sched_affinity": len(os.sched_getaffinity(0)), "loadavg_before": [round(x, 2) for x in load0],
           "loadavg_after": [round(x, 2) for x in os.getloadavg()], "numpy": np.__version__,
           "blas_threads_env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")},
           "commit": commit(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "load_s": round(load_s, 2), "executor_detail": ex.detail, "check": check, "results": rows}
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "cpu_executor.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
