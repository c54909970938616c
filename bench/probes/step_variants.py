"""Decode-step GEMV kernel choices on the H200 (issue 5): which ``Gemv`` defines make the 27B graph step fastest?
``python3 -m bench.probes.step_variants [--out DIR] [--reps 30] [--rounds 3] [--steps 8]`` (device; JSON to --out).

Each variant is a ``DecodeStep(..., gemv_defines=...)`` on the same 27B synthetic weights (``QMK_GEMV_M1`` picks the
M = 1 kernels, -1 the rule of discrete/gemv.py; ``QMK_GEMV_TMA_KPB`` the TMA box width in K-blocks). Gate before
timing: from the same state, ``--steps`` greedy graph replays of every variant give the default's tokens and
bit-identical final hidden rows (a variant that does not is reported and not timed). Timing: ``--rounds`` rounds,
each timing every variant's graph (median of ``--reps`` replays, CUDA events, context 1024), interleaved so drift
shows as a round-to-round difference. Writes ``step_variants.json``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import replay_times_ms, result_file  # noqa: E402

CTX = 1024
# e4m3_placed (session 10): with bench/probes/pending_e4m3_signrep.patch applied, the previous e4m3 widening as the
# control of the sign-replicate one (without the patch the define is ignored and it equals "rule")
VARIANTS = [("rule", {}), ("tma_kpb2", {"QMK_GEMV_TMA_KPB": 2}), ("e4m3_placed", {"QMK_E4M3_SIGNREP": 0})]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--only", default=None, help="comma-separated variant names (the first is the reference)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from discrete.step import DecodeStep
    from discrete.weights_gpu import WeightsGPU
    from loader.config import preset
    from loader.synthetic import SyntheticWeights

    vs = VARIANTS
    if a.only:
        keep = a.only.split(",")
        vs = [v for k in keep for v in VARIANTS if v[0] == k]
    cfg = preset("qwen3.5-27b")
    w = WeightsGPU.from_synthetic(SyntheticWeights(cfg, 0))
    cap = CTX + a.steps + 8 * a.reps + 64
    rows, steps, ref = [], {}, None
    for name, defs in vs:
        st = DecodeStep(cfg, w, cap, 1, gemv_defines=defs)
        st.reset(pos=CTX, tokens=(9707,))
        st.capture()
        toks = []
        for _ in range(a.steps):
            st.replay()
            toks.append(st.read_token())
        hn = st.buffer("hn").view(np.uint16).copy()
        kinds = sorted({f"{k}:{ops[k].m1_kind}" for ops in st.layer_ops for k in ("in", "out", "gate_up", "down")})
        if ref is None:
            ref = (toks, hn)
        same = toks == ref[0] and np.array_equal(hn, ref[1])
        rows.append({"variant": name, "defines": defs, "bit_identical_to_first": bool(same), "tokens": toks,
                     "kinds": kinds})
        print(name, "bit-identical" if same else "DIFFERS", toks, kinds, flush=True)
        if same:
            steps[name] = st
    for rnd in range(a.rounds):
        for name, st in steps.items():
            st.reset(pos=CTX, tokens=(9707,))
            ms = float(np.median(replay_times_ms(st._graph, st.stream, 3, a.reps)))
            rows.append({"variant": name, "round": rnd, "graph_ms_median": round(ms, 4)})
            print(f"round {rnd} {name:>8} {ms:.3f} ms/token", flush=True)
    p = result_file("step_variants", rows, {"model": cfg.name, "context": CTX, "method": __doc__.split("\n\n")[1]},
                    a.out)
    print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
