"""Parking a session in host memory against re-running it: bytes, park and unpark times, the copy rate, and the
prefill time of the same tokens, per prompt length (``Session.park`` / ``unpark``, docs/server.md "Parking").

``python3 -m bench.bench_park [--model DIR | --preset NAME] [--executor EX] [--lengths 256,1024] [--reps 3]
[--out DIR]``

Per length L: a session prefills L ids with a checkpoint at the prompt's end, as the server's requests leave them
(with the last multiple of 64 the prefill reaches: one checkpoint when L is a multiple of 64), decodes one token; then ``--reps`` times: park, unpark,
timed apart; on an executor with two slots (the cpu ones; the GPU executors hold one) ``--reps`` times a fork
(``Session.fork``: a parked copy unparked into the free slot), timed, then one turn in the fork, which must reuse
every token of the parent. Checks before it reports (exit 1 on a failure): after the last unpark the session's
next greedy tokens equal those of a second session given the same ids, never parked; every fork reused them all. The prefill time is the first
session's (``Timings.prefill_ms``, one cold run). Prints the JSON; writes ``park_<executor>.json`` into ``--out``
when given (bench/results/e2e/: end-to-end results, beside serve.json).
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

from bench.harness import commit, cpu_name, device_meta
from host.engine import Engine


def _run(eng, L: int, reps: int) -> dict:
    ids = [(7 * i + 11) % 4000 + 100 for i in range(L)]
    s = eng.new_session()
    r = s.generate(ids, max_new_tokens=1, stop_ids=[], checkpoint_at=[L]).result()
    park_ms, unpark_ms, nbytes = [], [], 0
    for _ in range(reps):
        t = time.perf_counter()
        p = s.park()
        park_ms.append((time.perf_counter() - t) * 1e3)
        nbytes = p.nbytes
        t = time.perf_counter()
        s.unpark()
        unpark_ms.append((time.perf_counter() - t) * 1e3)
    fork_ms, fork_ok = [], True
    nxt = ids + r.ids
    if eng.executor.slots > 1:  # a fork into a free slot (one slot: the fork would stay parked)
        for _ in range(reps):
            t = time.perf_counter()
            f = s.fork()
            fork_ms.append((time.perf_counter() - t) * 1e3)
            fork_ok &= f.generate(nxt, max_new_tokens=4, stop_ids=[]).result().timings.reused_tokens == len(nxt) - 1
            f.close()
    got = s.generate(nxt, max_new_tokens=4, stop_ids=[]).result()
    s.close()
    ref = eng.generate(nxt, max_new_tokens=4, stop_ids=[]).result()
    um = statistics.median(unpark_ms)
    return {"prompt_tokens": L, "checkpoints": len(s.checkpoints), "bytes": nbytes,
            "park_ms": round(statistics.median(park_ms), 2), "unpark_ms": round(um, 2),
            "unpark_gbps": round(nbytes / (um * 1e-3) / 1e9, 2), "prefill_ms": round(r.timings.prefill_ms, 1),
            "fork_ms": round(statistics.median(fork_ms), 2) if fork_ms else None,
            "reused_after_unpark": got.timings.reused_tokens, "check": got.ids == ref.ids and fork_ok,
            "all_park_ms": [round(x, 2) for x in park_ms], "all_unpark_ms": [round(x, 2) for x in unpark_ms]}


def main(argv=None) -> int:
    """Run the benchmark (arguments as in the module docstring); returns the exit status (1: a check failed)."""
    ap = argparse.ArgumentParser(prog="python3 -m bench.bench_park", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the trained small model)")
    ap.add_argument("--preset", default=None, help="a preset name instead (synthetic weights)")
    ap.add_argument("--executor", default=None)
    ap.add_argument("--lengths", default="256,1024")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    lengths = [int(x) for x in a.lengths.split(",")]
    load0 = os.getloadavg()
    eng = Engine.load(a.model or a.preset, a.executor, capacity=max(lengths) + 64, slots=2, quiet=True)
    rows = [_run(eng, L, a.reps) for L in lengths]
    ex = eng.executor
    device = cpu_name()
    if ex.name in ("graph", "megakernel"):
        device = device_meta()["device"]
    doc = {"benchmark": "park", "executor": ex.name, "model": a.model or a.preset or "qwen3.5-tiny-trained",
           "device": device, "nproc": os.cpu_count(), "loadavg_before": [round(x, 2) for x in load0],
           "loadavg_after": [round(x, 2) for x in os.getloadavg()], "commit": commit(),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "transfer_rate_measured_gbps": round(ex.transfer_rate / 1e9, 2), "results": rows}
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / f"park_{ex.name}.json").write_text(text + "\n")
    return 0 if all(r["check"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
