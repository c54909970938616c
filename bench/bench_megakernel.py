"""Megakernel vs CUDA-graph path on the 27B synthetic model at a 1k context, in the same run (article Part 6.4).

Gate first (STYLE habit 11): two greedy steps of both paths must be bit-identical in every buffer, else nothing
is timed. Then, with CUDA events: the graph replayed N times; the megakernel running N steps in one launch
(default program: GEMV_REDUCE instructions after each split-K op, GEMV weight prefetch before the waits;
variants: GDN per key head, and ``fuse_reduce=True``, the split-K reduce inside the GEMV instructions); the megakernel one launch per step; the persistent grid driven step by step from the host through mapped
memory (host round trip included); the NOP program (waits + bumps only: the dependency machinery's floor).
The weight bytes streamed per token (ModelConfig.weight_bytes_per_token) give the bandwidth column. Writes
``bench/results/megakernel.json`` and ``bench/results/megakernel_timings.json.xz`` (per-instruction globaltimer
stamps of one step, QMK_MK_TIMING build; xz'd JSON, ``xzcat`` reads it) under ``--out`` (default bench/results).

``python3 bench/bench_megakernel.py [--preset qwen3.5-27b] [--context 1024] [--steps 20] [--out DIR]``
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import lzma
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from assembler.options import PROGRAM  # noqa: E402
from bench.harness import bandwidth, commit, device_meta, events_ms, result_file  # noqa: E402
from discrete.step import DecodeStep  # noqa: E402
from discrete.weights_gpu import WeightsGPU  # noqa: E402
from loader.config import preset  # noqa: E402
from loader.synthetic import SyntheticWeights  # noqa: E402
from megakernel.runner import Megakernel, compare_steps  # noqa: E402
from megakernel.timings import collect  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3.5-27b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    cfg, N, ctx = preset(a.preset), a.steps, a.context
    t0 = time.perf_counter()
    w = WeightsGPU.from_synthetic(SyntheticWeights(cfg, 0))
    cap = ctx + 8 * N + 64  # every launch below advances the position
    ga = DecodeStep(cfg, w, cap, 1, debug_logits=True)
    gb = DecodeStep(cfg, w, cap, 1, debug_logits=True)
    mk = Megakernel(gb)                # default: GDN per value head
    mk3 = Megakernel(gb, gdn_split=1)  # the program as assembled (GDN per key head)
    mkr = Megakernel(gb, fuse_reduce=not PROGRAM.fuse_reduce)  # the other split-K reduce program
    rname = "fused_reduce" if mkr.fuse_reduce else "reduce_instr"
    mkd = Megakernel(gb, defer_reduce=not PROGRAM.defer_reduce)  # residual reduces deferred or as GEMV_REDUCE stages
    dname = "no_defer" if PROGRAM.defer_reduce else "defer_reduce"
    print(f"setup {time.perf_counter() - t0:.1f} s; program {mk.program.stats()}", flush=True)
    for s in (ga, gb):
        s.poison()
        s.reset(ctx, [1000])
    ga.capture()
    gate = None
    for k, m in enumerate((mk, mk3, mkr, mkd)):  # one gate step each: every variant timed below
        ga.replay()
        m.step()
        m.check()
        gate = compare_steps(ga, gb, m.program, 1)
        if gate is not None:
            gate = (["default", "gdn_split1", rname, dname][k],) + gate
            break
    meta = {"preset": a.preset, "context": ctx, "timed_steps": N, "num_sms": mk.num_sms, "threads": mk.threads,
            "smem_bytes": mk.smem, "gate_identical": gate is None, "gate_first_mismatch": gate,
            "program": mk.program.stats(), "method": "CUDA events around N consecutive steps (graph replays / "
            "one megakernel launch), after 2 gate steps; per-step figures are the mean"}
    if gate is not None:
        print(f"GATE FAILED: {gate}; nothing timed", flush=True)
        result_file("megakernel", [{"name": "megakernel_step", "shape": f"{a.preset} ctx{ctx}", "correct": False}],
                    meta, a.out)
        return 1
    nbytes = cfg.weight_bytes_per_token
    shape = f"{a.preset} ctx{ctx} M=1"
    res = []
    for _ in range(3):
        ga.replay()
    g_ms = events_ms(ga.stream, lambda: [ga.replay() for _ in range(N)], N)
    res.append({"name": "graph_step", "shape": shape, "correct": True, "ms": g_ms, **bandwidth(nbytes, g_ms)})
    save = lambda: result_file("megakernel", res, meta, a.out)  # noqa: E731  (after every row: a hang keeps the rest)
    def one_launch(m, suffix: str, **note) -> float:
        """N steps of ``m`` in one launch (after 2 warm-up steps), recorded as megakernel_step_one_launch<suffix>."""
        m.run_steps(2)
        ms = events_ms(gb.stream, lambda: m.run_steps(N), N)
        m.check()
        res.append({"name": f"megakernel_step_one_launch{suffix}", "shape": shape, "correct": True, "ms": ms,
                    **bandwidth(nbytes, ms), **note})
        save()
        return ms

    one_launch(mk, "")
    one_launch(mk3, "_gdn_split1")
    one_launch(mkr, f"_{rname}", note=f"fuse_reduce={mkr.fuse_reduce} (the default program's other "
               "split-K reduce: in the GEMV instructions / as GEMV_REDUCE instructions)")
    one_launch(mkd, f"_{dname}", note=f"defer_reduce={mkd.defer_reduce} (the out / o / down split-K "
               "reduces in the consumers' prologues / as GEMV_REDUCE instructions)")
    l_ms = events_ms(gb.stream, lambda: [mk.step() for _ in range(N)], N)
    mk.check()
    res.append({"name": "megakernel_step_per_launch", "shape": shape, "correct": True, "ms": l_ms, **bandwidth(nbytes, l_ms)})
    save()
    mk.start_persistent()
    t = time.perf_counter()
    for _ in range(N):
        mk.release(1)
        mk.wait_token(timeout_s=30)
    p_ms = (time.perf_counter() - t) * 1e3 / N
    mk.stop_persistent()
    res.append({"name": "megakernel_persistent_host_loop", "shape": shape, "correct": True, "ms": p_ms,
                **bandwidth(nbytes, p_ms), "note": "host perf_counter per released step, mapped-memory round trip"})
    save()
    print(json.dumps(res, indent=1), flush=True)
    nop = Megakernel(gb, nop=True)
    nop.run_steps(2)
    n_ms = events_ms(gb.stream, lambda: nop.run_steps(N), N)
    nop.check()
    res.append({"name": "megakernel_nop_floor", "shape": shape, "correct": True, "ms": n_ms, "bytes": 0, "gbps": 0.0,
                "frac_of_measured_bw": 0.0, "note": "same program, every opcode NOP: fetch + waits + bumps only"})
    save()
    print(json.dumps(res[-1]), flush=True)
    tm = Megakernel(gb, timing=True)
    tm.run_steps(2)
    data = collect(tm)
    out = Path(a.out) if a.out else Path(__file__).resolve().parent / "results"
    doc = {"benchmark": "megakernel_timings", **device_meta(), "commit": commit(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "preset": a.preset,
           "context": ctx, "results": [], "timings": data}
    # ~60k instruction rows (2.6 MB of JSON): xz'd (325 KB; gzip -9 gave 616 KB), the same stamps give the same bytes
    (out / "megakernel_timings.json.xz").write_bytes(lzma.compress((json.dumps(doc) + "\n").encode(),
                                                                   preset=9 | lzma.PRESET_EXTREME))
    kinds = sorted(data["per_op_kind"].items(), key=lambda kv: -kv[1]["run_ns"])
    print("timed step (timing build):", data["step_ns"] / 1e6, "ms;", json.dumps(kinds[:8]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
