"""RMSNorm fused into the GEMV launch (issue 5, ``DecodeStep(fuse_norm=...)``) on the H200: is the 27B decode step
bit-identical with the fusion, and how much faster is it? ``bash scripts/norm_probe.sh`` (device; JSON to $OUT)
or ``python3 -m bench.probes.norm_probe [--out DIR] [--reps 30]``.

1. Check (a failure aborts before any timing): 27B synthetic weights, DecodeStep with fuse_norm False and True
   (PDL on, the default; debug logits on), 8 teacher-forced graph replays from position 0 with the activations
   NaN-poisoned before each: after every step the whole activation arena (logits, hidden, every normed input
   xn.*, q|k|v, ...) and the argmax bit-identical (uint16); after the last step also the split-K scratch, GDN
   recurrent state (uint32), conv rings and the KV pool (compared on the device).
2. Step timing at context 1024, as bench/bench_step.py: CUDA events around each graph replay (median of --reps
   after 3 warm-ups) and around a loop of --reps back-to-back replays; fuse_norm off / on, interleaved over two
   rounds (drift shows as a round-to-round difference).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import result_file, step_variant_rounds  # noqa: E402
from loader.config import FIRST_PADDING_ID, preset  # noqa: E402
from loader.synthetic import SyntheticWeights  # noqa: E402

CTX = 1024
CHECK_STEPS = 8
FIRST_TOKEN = 9707


def _first_mismatch(a, b, what: str) -> str | None:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    bad = np.flatnonzero(a != b)
    if bad.size:
        i = int(bad[0])
        return f"{what}: {bad.size} mismatches, first at flat index {i}: {a.flat[i]:#x} vs {b.flat[i]:#x}"
    return None


def _arena_name(step, flat_u16: int) -> str:
    """The arena buffer holding uint16 element ``flat_u16`` (for mismatch reports)."""
    base = step.arena.data.ptr
    for name, b in step.buf.items():
        lo = (b.data.ptr - base) // 2
        if lo <= flat_u16 < lo + b.nbytes // 2:
            return f"{name}[{np.unravel_index(flat_u16 - lo, b.shape)}]"
    return "padding"


def check(cfg, w, log, out_dir) -> dict:
    """Section 1: raises SystemExit on the first mismatch."""
    import cupy as cp
    from discrete.step import DecodeStep
    toks = [int(t) for t in np.random.default_rng(5).integers(0, FIRST_PADDING_ID, size=CHECK_STEPS)]
    steps, runs = {}, {}
    for fuse in (False, True):
        st = DecodeStep(cfg, w, CTX + 64, 1, debug_logits=True, fuse_norm=fuse)
        st.reset(tokens=(FIRST_TOKEN,))
        st.capture()
        arenas, ids = [], []
        for t in toks:
            st.poison()
            st.replay([t])
            ids.append(st.read_token())
            arenas.append(st.arena.view(cp.uint16).get())
        steps[fuse], runs[fuse] = st, (arenas, ids)
        log(f"fuse_norm={fuse}: 8 graph steps, ids {ids}")
    problems = []
    if runs[False][1] != runs[True][1]:
        problems.append(f"argmax {runs[False][1]} vs {runs[True][1]}")
    for p, (a, b) in enumerate(zip(runs[False][0], runs[True][0])):
        bad = np.flatnonzero(a != b)
        if bad.size:
            problems.append(f"arena step {p}: {bad.size} mismatches, first {_arena_name(steps[False], int(bad[0]))}: "
                            f"{a[bad[0]]:#06x} vs {b[bad[0]]:#06x}")
            break
    a, b = steps[False], steps[True]
    pairs = [("partials", a.partials.view(cp.uint32), b.partials.view(cp.uint32)), ("kv", a.kv.pool, b.kv.pool),
             ("ctrl", a.ctrl, b.ctrl)]
    pairs += [(f"rec.{i}", a.rec[i].view(cp.uint32), b.rec[i].view(cp.uint32)) for i in a.rec]
    pairs += [(f"ring.{i}", a.ring[i], b.ring[i]) for i in a.ring]
    for name, x, y in pairs:
        if not bool(cp.array_equal(x, y)):
            problems.append(_first_mismatch(x.get(), y.get(), name) or f"{name}: differs")
    hn = a.buffer("hn", 1).view(np.uint16)
    nan = bool(((hn & 0x7FFF) > 0x7F80).any())  # the final hidden must have been written
    res = {"steps": CHECK_STEPS, "bit_identical": not problems, "problems": problems, "forced_ids": runs[False][1],
           "compared": ["arena (every activation buffer) after each step", "argmax"] + [p[0] for p in pairs]}
    log(f"check: {res}")
    steps.clear()
    if problems or nan:
        result_file("norm_probe", [], {"check": res, "aborted": "check failed"}, out_dir)
        raise SystemExit(f"check failed: {problems or 'NaN in the final hidden'}")
    return res


def step_timing(cfg, w, reps: int, log) -> list[dict]:
    """Section 2."""
    from discrete.step import DecodeStep
    cap = CTX + 8 * reps + 256
    steps = {}
    for fuse in (False, True):
        st = DecodeStep(cfg, w, cap, 1, fuse_norm=fuse)
        st.reset(pos=CTX, tokens=(FIRST_TOKEN,))
        st.capture()
        steps[fuse] = st
        inv = Counter(c for c, _ in st.launches(1))
        log(f"fuse_norm={fuse}: launch closures per step {dict(inv)}")
    rows = step_variant_rounds(cfg, steps, reps, CTX, FIRST_TOKEN, lambda fuse: {
        "name": f"decode step, CUDA graph, fuse_norm={fuse}", "fuse_norm": fuse, "pdl": True}, log)
    steps.clear()
    return rows


def main(argv=None) -> int:
    from discrete.weights_gpu import WeightsGPU
    ap = argparse.ArgumentParser(prog="python3 -m bench.probes.norm_probe")
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    t00 = time.perf_counter()

    def log(x):
        print(f"[{time.perf_counter() - t00:6.1f} s] {x}", flush=True)

    cfg = preset("qwen3.5-27b")
    w = WeightsGPU.from_synthetic(SyntheticWeights(cfg, 0))
    log(f"materialised {w.nbytes / 1e9:.2f} GB")
    chk = check(cfg, w, log, a.out)
    rows = step_timing(cfg, w, a.reps, log)
    by = {}
    for r in rows:
        by.setdefault("on" if r["fuse_norm"] else "off", []).append(r["graph_ms_loop"])
    summary = {k: round(float(np.mean(v)), 4) for k, v in by.items()}
    summary["saving_ms"] = round(summary["off"] - summary["on"], 4)
    log(f"step ms/token (loop, mean of rounds): {summary}")
    p = result_file("norm_probe", rows,
                    {"model": cfg.name, "method": " ".join(__doc__.split("\n\n", 1)[1].split()), "check": chk,
                     "step_summary_ms": summary, "wall_s": round(time.perf_counter() - t00, 1)}, a.out)
    log(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
