"""Programmatic Dependent Launch on the H200 (issue 5): is the 27B decode step bit-identical with PDL, and how
much faster is it? ``bash scripts/pdl_probe.sh`` (device; JSON to $OUT) or
``python3 -m bench.probes.pdl_probe [--out DIR] [--reps 30] [--quick]``.

1. Check (a failure aborts before any timing): 27B synthetic weights, DecodeStep with pdl False and True
   (debug logits on), 8 graph replays from position 0 teacher-forced and 8 greedy, activations NaN-poisoned
   before each: logits, argmax and final hidden bit-identical (uint16); one eager step likewise.
2. Step timing at context 1024, as bench/bench_step.py: CUDA events around each graph replay (median of
   --reps after 3 warm-ups) and around a loop of --reps back-to-back replays; pdl off, on (every kernel) and
   GEMV-only, interleaved over two rounds (drift shows as a round-to-round difference).
3. GEMV microbenchmark: one graph of the 64 layers' gate|up + down projections (x_{i+1} = x_i +
   down(swiglu(gate_up(x_i))), the real 27B weights: 17.1 GB, no L2 reuse), fused reduce (the step's M = 1
   form, 128 kernels) and partial + reduce (256 kernels); PDL off / on, on with QMK_PDL_PREFETCH_UNITS 0, 4, 8
   (default 2). Outputs checked bit-identical to the PDL-off graph before timing; bandwidth vs 4,468 GB/s.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import bandwidth, replay_times_ms, result_file, step_variant_rounds  # noqa: E402
from loader.config import FIRST_PADDING_ID, preset  # noqa: E402
from loader.synthetic import SyntheticWeights  # noqa: E402

CTX = 1024
CHECK_STEPS = 8
FIRST_TOKEN = 9707
PREFETCH_VARIANTS = (0, 4, 8)


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


def _mismatch(a, b, what: str) -> str | None:
    a, b = _bits(a), _bits(b)
    bad = np.argwhere(a != b)
    if a.shape != b.shape:
        return f"{what}: shapes {a.shape} vs {b.shape}"
    if bad.size:
        i = tuple(bad[0])
        return f"{what}: {len(bad)} mismatches, first at {i}: {a[i]:#06x} vs {b[i]:#06x}"
    return None


def _check_run(step, toks, greedy: bool) -> dict:
    step.reset(tokens=(FIRST_TOKEN,))
    if step._graph is None:
        step.capture()
    out = {"logits": [], "ids": [], "hidden": []}
    for t in toks:
        step.poison()
        step.replay(None if greedy else [int(t)])
        out["logits"].append(step.buffer("logits", 1)[0].copy())
        out["hidden"].append(step.buffer("hn", 1)[0].copy())
        out["ids"].append(step.read_token())
    return out


def check(cfg, w, log, out_dir) -> dict:
    """Section 1: raises SystemExit on the first mismatch."""
    from discrete.step import DecodeStep
    toks = np.random.default_rng(5).integers(0, FIRST_PADDING_ID, size=CHECK_STEPS)
    runs = {}
    for pdl in (False, True):
        step = DecodeStep(cfg, w, CTX + 64, 1, debug_logits=True, pdl=pdl)
        r = {"forced": _check_run(step, toks, False), "greedy": _check_run(step, toks, True)}
        step.reset(tokens=(FIRST_TOKEN,))
        step.poison()
        step.run_eager()
        r["eager"] = {"logits": [step.buffer("logits", 1)[0].copy()], "hidden": [step.buffer("hn", 1)[0].copy()],
                      "ids": [step.read_token()]}
        runs[pdl] = r
        del step
    problems = []
    for mode in ("forced", "greedy", "eager"):
        a, b = runs[False][mode], runs[True][mode]
        if a["ids"] != b["ids"]:
            problems.append(f"{mode}: argmax {a['ids']} vs {b['ids']}")
        for k in ("logits", "hidden"):
            for p, (x, y) in enumerate(zip(a[k], b[k])):
                m = _mismatch(x, y, f"{mode} {k} step {p}")
                if m:
                    problems.append(m)
                    break
    nan = any(((_bits(h) & 0x7FFF) > 0x7F80).any() for h in runs[False]["forced"]["hidden"])
    res = {"steps": CHECK_STEPS, "bit_identical": not problems, "problems": problems,
           "greedy_ids": runs[False]["greedy"]["ids"], "forced_ids": runs[False]["forced"]["ids"],
           "nan_in_hidden": bool(nan)}
    log(f"check: {res}")
    if problems or nan:
        result_file("pdl_probe", [], {"check": res, "aborted": "check failed"}, out_dir)
        raise SystemExit(f"check failed: {problems or 'NaN in hidden'}")
    return res


def step_timing(cfg, w, reps: int, log) -> list[dict]:
    """Section 2."""
    from discrete.step import DecodeStep
    cap = CTX + 8 * reps + 256
    variants = {"off": False, "all": True, "gemv": "gemv"}
    steps = {}
    for name, pdl in variants.items():
        st = DecodeStep(cfg, w, cap, 1, pdl=pdl)
        st.reset(pos=CTX, tokens=(FIRST_TOKEN,))
        st.capture()
        steps[name] = st
    rows = step_variant_rounds(cfg, steps, reps, CTX, FIRST_TOKEN, lambda name: {
        "name": f"decode step, CUDA graph, pdl={name}", "pdl": name}, log)
    steps.clear()
    return rows


def gemv_micro(cfg, w, reps: int, log, quick: bool) -> list[dict]:
    """Section 3."""
    import cupy as cp
    from discrete.gemv import Gemv
    H, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    variants = [("off", False, None), ("pdl", True, None)]
    if not quick:
        variants += [(f"pdl_prefetch{u}", True, {"QMK_PDL_PREFETCH_UNITS": u}) for u in PREFETCH_VARIANTS]
    x0 = cp.asarray((np.random.default_rng(1).standard_normal((1, H)).astype(np.float32).view(np.uint32) >> 16)
                    .astype(np.uint16))
    rows, ref = [], {}
    for fused in (True, False):
        for name, pdl, defines in variants:
            gu = [Gemv(cfg, w.layers[i]["gate_up"].w, w.layers[i]["gate_up"].scale, epilogue="swiglu",
                       name=f"L{i}.gate_up", defines=defines, pdl=pdl) for i in range(L)]
            dn = [Gemv(cfg, w.layers[i]["down"].w, w.layers[i]["down"].scale, epilogue="residual",
                       name=f"L{i}.down", defines=defines, pdl=pdl) for i in range(L)]
            P = cp.full(max(g.partials_size(1) for g in gu + dn), np.nan, cp.float32)
            x = cp.zeros((L + 1, 1, H), cp.uint16)
            x[0] = x0
            act = cp.full((L, 1, F), 0x7FC1, cp.uint16)
            s = cp.cuda.Stream(non_blocking=True)
            with s:
                s.begin_capture()
                for i in range(L):
                    gu[i](x[i], act[i], P, fused=fused)
                    dn[i](act[i], x[i + 1], P, residual=x[i], fused=fused)
                g = s.end_capture()
                g.launch(s)
                s.synchronize()
                out = (x.get(), act.get())
                key = fused
                if name == "off":
                    ref[key] = out
                same = all(_mismatch(a, b, "") is None for a, b in zip(ref[key], out))
                t = replay_times_ms(g, s, 3, reps)
            nbytes = sum(gg.weight_bytes for gg in gu + dn)
            med = float(np.median(t))
            r = {"name": f"64 x (gate|up + down) graph, {'fused reduce' if fused else 'partial + reduce'}, {name}",
                 "shape": f"{cfg.name} 64 layers", "M": 1, "variant": name, "fused": fused, "pdl": pdl,
                 "defines": defines or {}, "kernels": 2 * L * (1 if fused else 2), "ms": round(med, 4),
                 "ms_min": round(float(t.min()), 4), "us_per_pair": round(med * 1e3 / L, 2),
                 "bytes": nbytes, "correct": bool(same), **bandwidth(nbytes, med)}
            log(r)
            rows.append(r)
            del g, gu, dn, P, x, act
            if not same:
                raise SystemExit(f"gemv micro: {name} (fused={fused}) outputs differ from pdl off")
    return rows


def main(argv=None) -> int:
    from discrete.weights_gpu import WeightsGPU
    ap = argparse.ArgumentParser(prog="python3 -m bench.probes.pdl_probe")
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="GEMV micro without the prefetch sweep")
    a = ap.parse_args(argv)
    t00 = time.perf_counter()

    def log(x):
        print(f"[{time.perf_counter() - t00:6.1f} s] {x}", flush=True)

    cfg = preset("qwen3.5-27b")
    w = WeightsGPU.from_synthetic(SyntheticWeights(cfg, 0))
    log(f"materialised {w.nbytes / 1e9:.2f} GB")
    chk = check(cfg, w, log, a.out)
    steps = step_timing(cfg, w, a.reps, log)
    result_file("pdl_probe", steps, {"check": chk, "partial": True}, a.out)
    micro = gemv_micro(cfg, w, max(10, a.reps // 2), log, a.quick)
    by = {}
    for r in steps:
        by.setdefault(r["pdl"], []).append(r["graph_ms_loop"])
    summary = {k: round(float(np.mean(v)), 4) for k, v in by.items()}
    summary["saving_ms_all"] = round(summary["off"] - summary["all"], 4)
    summary["saving_ms_gemv"] = round(summary["off"] - summary["gemv"], 4)
    log(f"step ms/token (loop, mean of rounds): {summary}")
    p = result_file("pdl_probe", steps + micro,
                    {"model": cfg.name, "method": " ".join(__doc__.split("\n\n", 1)[1].split()), "check": chk,
                     "step_summary_ms": summary, "wall_s": round(time.perf_counter() - t00, 1)}, a.out)
    log(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
