"""Megakernel build variants on the H200: which build knobs and program forms make the 27B step fastest?
``python3 -m tools.mk_variants [--only a,b,...] [--out DIR] [--steps 20] [--rounds 3]`` (device; JSON to --out).

A variant is a program form (``fuse_reduce``; ``_defer_reduce``, ``_local_reduce``, ``_mlp_groups``) and/or extra
``QMK_*`` defines of the megakernel module (none changes a result). Each is gated bit-identical to the graph path
before it is timed. Add a variant to :func:`variants` to A/B a new knob; what earlier variants measured is in
bench/EXPERIMENTS.md.

Method: 27B synthetic weights, context 1024; all modules compiled first in parallel processes; per variant one
gate step (graph replay vs one megakernel step, every buffer bit-identical: megakernel.runner.compare_steps),
then ``--rounds`` rounds, each timing the graph (N replays) and every variant (one launch of N steps) with CUDA
events, interleaved so drift shows as a round-to-round difference. Writes ``mk_variants.json``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from assembler import graph  # noqa: E402
from assembler.options import PROGRAM  # noqa: E402
from bench.harness import bandwidth, events_ms, result_file  # noqa: E402
from discrete.step import DecodeStep  # noqa: E402
from discrete.weights_gpu import WeightsGPU  # noqa: E402
from loader.config import preset  # noqa: E402
from loader.synthetic import SyntheticWeights  # noqa: E402
from megakernel import runner  # noqa: E402
from megakernel.runner import Megakernel, compare_steps  # noqa: E402
from megakernel.warm import warm  # noqa: E402

PRESET, CTX = "qwen3.5-27b", 1024


def variants() -> list[tuple[str, bool, dict]]:
    """(name, fuse_reduce, extra defines) in timing order; the first is the default build (program options:
    assembler/options.py PROGRAM), each other one turns one default off (or a candidate on). Defines starting with
    ``_`` are program knobs, not compiler defines."""
    F = PROGRAM.fuse_reduce
    return [
        ("default", F, {}),
        ("fused" if not F else "unfused", not F, {}),
        # residual split-K reduces in the consumers' prologues (the default) or as GEMV_REDUCE stages
        ("no_defer", F, {"_defer_reduce": 0}),
        # the GDN step's conv inputs sized for M rows (the M = 1 build's default: 1 row), the GDN step's norm taken
        # from xn when its SM's in-projection left it there, ARGMAX with 16-byte loads in flight
        ("gdn_mr8", F, {"QMK_MK_GDN_MR": 8}),
        ("no_xn_reuse", F, {"QMK_MK_XN_REUSE": 0}),
        ("argmax_scalar", F, {"QMK_MK_ARGMAX_VEC": 0, "QMK_MK_KEYS": 0}),
        # the in-projections reduced on their own instructions (scheduler local_reduce), the head's per-SM best keys
        # for the ARGMAX, the GDN state copied to shared memory before the step's wait
        ("no_local", F, {"_local_reduce": 0}),
        ("no_keys", F, {"QMK_MK_KEYS": 0}),
        ("gdn_state_prefetch", F, {"QMK_MK_GDN_STATE_PREFETCH": 1}),  # rejected: +0.15 ms (bench/EXPERIMENTS.md)
        # not yet measured: gate|up grouped per down split, down split j waiting only on its group and cut by when
        # its group ends (graph mlp_groups; est_step −0.19 ms)
        ("mlp_groups", F, {"_mlp_groups": 1}),
        # the counter protocol (sync.cuh, mk_wait_all); the default is fence 0, acquire polls, no sleep
        ("sync_fence_poll_spin", F, {"QMK_MK_BUMP_FENCE": 1, "QMK_MK_POLL_ACQUIRE": 0, "QMK_MK_SPIN_NS": 32}),
        ("bump_fence", F, {"QMK_MK_BUMP_FENCE": 1}),
        ("poll_relaxed", F, {"QMK_MK_POLL_ACQUIRE": 0}),
        ("spin32", F, {"QMK_MK_SPIN_NS": 32}),
    ]


def _megakernel(runner, Megakernel, step, fuse_reduce: bool, x: dict, defines):
    """One variant's Megakernel; program knobs: ``_defer_reduce``, ``_local_reduce``, ``_mlp_groups`` (the graph's
    DEFAULT_MLP_GROUPS while it is built, runner.build_program's cache cleared around it: its key omits it)."""
    old = graph.DEFAULT_MLP_GROUPS
    grp = bool(x.get("_mlp_groups", old))
    if grp != old:
        graph.DEFAULT_MLP_GROUPS = grp
        runner.build_program.cache_clear()
    try:
        return Megakernel(step, fuse_reduce=fuse_reduce, defines=defines,
                          defer_reduce=None if "_defer_reduce" not in x else bool(x["_defer_reduce"]),
                          local_reduce=bool(x.get("_local_reduce", PROGRAM.local_reduce)))
    finally:
        if grp != old:
            graph.DEFAULT_MLP_GROUPS = old
            runner.build_program.cache_clear()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=None, help="comma-separated variant names")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    vs = variants()
    if a.only:
        keep = set(a.only.split(","))
        vs = [v for v in vs if v[0] in keep]
    t0 = time.perf_counter()
    defs = lambda x: {k: v for k, v in x.items() if not k.startswith("_")} or None  # noqa: E731 ("_": a program knob)
    warm([], jobs=[(PRESET, [str(runner.SOURCE)], {"fuse_reduce": f, "timing": False, "extra": defs(x)}, True)
                          for _, f, x in vs])
    print(f"compiled {len(vs)} variants in {time.perf_counter() - t0:.1f} s", flush=True)
    cfg, N = preset(PRESET), a.steps
    w = WeightsGPU.from_synthetic(SyntheticWeights(cfg, 0))
    cap = CTX + N * (a.rounds * len(vs) + 4) + 64
    ga = DecodeStep(cfg, w, cap, 1, debug_logits=True)
    gb = DecodeStep(cfg, w, cap, 1, debug_logits=True)
    mks = [(name, _megakernel(runner, Megakernel, gb, f, x, defs(x))) for name, f, x in vs]
    for s in (ga, gb):
        s.poison()
        s.reset(CTX, [1000])
    ga.capture()
    meta = {"preset": PRESET, "context": CTX, "timed_steps": N, "rounds": a.rounds,
            "variants": {n: {"fuse_reduce": f, "defines": x} for n, f, x in vs},
            "smem": {n: m.smem for n, m in mks},
            "method": "gate: one step per variant, every buffer bit-identical to the graph path; then per round "
                      "CUDA events around N graph replays and around one N-step launch of each variant"}
    res, meta["gates"] = [], []
    for name, m in mks:
        ga.replay()
        m.step()
        m.check()
        bad = compare_steps(ga, gb, m.program, 1)
        meta["gates"].append({"name": name, "identical": bad is None,
                              "first_mismatch": None if bad is None else list(map(str, bad))})
        print(meta["gates"][-1], flush=True)
        if bad is not None:
            result_file("mk_variants", [], meta, a.out)
            return 1
    nbytes = cfg.weight_bytes_per_token
    for r in range(a.rounds):
        g_ms = events_ms(ga.stream, lambda: [ga.replay() for _ in range(N)], N)
        res.append({"name": f"graph r{r}", "round": r, "shape": f"{PRESET} ctx{CTX} M=1", "correct": True, "ms": g_ms,
                    **bandwidth(nbytes, g_ms)})
        print(f"round {r} graph {g_ms:.3f} ms", flush=True)
        for name, m in mks:
            m.run_steps(1)
            ms = events_ms(gb.stream, lambda: m.run_steps(N), N)
            m.check()
            res.append({"name": f"{name} r{r}", "round": r, "shape": f"{PRESET} ctx{CTX} M=1", "correct": True, "ms": ms,
                        **bandwidth(nbytes, ms)})
            print(f"round {r} {name} {ms:.3f} ms", flush=True)
        result_file("mk_variants", res, meta, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
