"""Whole decode step on the device (``discrete/step.py``): ms/token of the 27B synthetic model at several
contexts, CUDA graph on and off, the launch inventory, where the time goes per op category, and a check that
nothing allocates in a 1,000-token loop.

``python3 -m bench.bench_step [--out DIR] [--contexts 1024 8192 32768]``

Checks before it times (a failed check aborts): one eager step and one graph replay from the same state give
bit-identical hidden rows and tokens. Graph timing: CUDA events around each replay (median of ``--reps``) and
around a back-to-back loop of ``--reps`` replays (throughput, includes the gaps between replays). Eager timing:
events around ``--eager-reps`` kernel-by-kernel steps (Python launch overhead included). Per category: the graph
re-captured without that category's kernels; its cost = full − without (results are garbage then; timing only).
Context c: the control block is set to pos = c (KV content is whatever the pool holds; timing only).
Floor: the weight bytes one step must stream / the H200's measured 4,468 GB/s (derived). Each result row also
carries the ``bench/report.py`` fields: ms = graph loop ms/token, bytes = weights + K/V read at that context,
correct = the eager-vs-graph bit-identity gate above.
"""
from __future__ import annotations

import argparse
import time
from collections import Counter

import numpy as np

from bench.harness import H200_READ_GBPS, events_ms, replay_times_ms, result_file
from discrete.step import DecodeStep
from discrete.weights_gpu import WeightsGPU
from loader.config import preset
from loader.synthetic import SyntheticWeights

CATEGORIES = ("embed", "norm", "in_proj", "gdn", "attn", "out_proj", "mlp", "lm_head", "finish")
FLOOR_STATED_MS = 6.09   # the weight-streaming floor for the 27B


def _median_graph(cp, stream, g, reps: int) -> float:
    return float(np.median(replay_times_ms(g, stream, 3, reps)))


def main(argv=None) -> int:
    import cupy as cp

    ap = argparse.ArgumentParser(prog="python3 -m bench.bench_step")
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--eager-reps", type=int, default=5)
    ap.add_argument("--alloc-steps", type=int, default=1000)
    a = ap.parse_args(argv)
    cfg = preset("qwen3.5-27b")
    t0 = time.perf_counter()
    w = WeightsGPU.from_synthetic(SyntheticWeights(cfg, 0))
    t_mat = time.perf_counter() - t0
    print(f"materialised {w.nbytes / 1e9:.2f} GB in {t_mat:.1f} s", flush=True)
    cap = max(a.contexts) + a.alloc_steps + 4 * a.reps + 256
    t0 = time.perf_counter()
    step = DecodeStep(cfg, w, cap, 1)
    t_init = time.perf_counter() - t0
    s = step.stream
    # ---- check before timing: eager == graph replay from the same state
    step.reset(tokens=(9707,))
    step.run_eager()
    tok_e, hn_e = step.read_token(), step.buffer("hn").view(np.uint16).copy()
    step.reset(tokens=(9707,))
    step.capture()
    step.replay()
    tok_g, hn_g = step.read_token(), step.buffer("hn").view(np.uint16).copy()
    if tok_e != tok_g or not np.array_equal(hn_e, hn_g) or ((hn_e & 0x7FFF) > 0x7F80).any():
        raise SystemExit(f"check failed: eager token {tok_e} vs graph {tok_g}; hidden equal {np.array_equal(hn_e, hn_g)}")
    inv = Counter(c for c, _ in step.launches(1))
    kernels = {c: n * DecodeStep.kernels_per_launch(c) for c, n in inv.items()}
    print(f"launch inventory: {sum(kernels.values())} kernels/step {kernels}", flush=True)
    floor_ms = cfg.weight_bytes_per_token / (H200_READ_GBPS * 1e9) * 1e3
    results = []
    with s:
        for ctx in a.contexts:
            step.reset(pos=ctx, tokens=(9707,))
            eager = events_ms(s, lambda: [step.run_eager() for _ in range(a.eager_reps)], a.eager_reps)
            step.reset(pos=ctx, tokens=(9707,))
            med = _median_graph(cp, s, step._graph, a.reps)
            step.reset(pos=ctx, tokens=(9707,))
            loop = events_ms(s, lambda: [step._graph.launch(s) for _ in range(a.reps)], a.reps)
            nbytes = cfg.weight_bytes_per_token + ctx * cfg.kv_bytes_per_token  # bytes the step must read
            r = {"name": "decode step, CUDA graph", "shape": f"{cfg.name} context {ctx}", "M": 1, "ms": round(loop, 4),
                 "bytes": nbytes, "correct": True, "context": ctx, "graph_ms_median": round(med, 4), "graph_ms_loop": round(loop, 4),
                 "eager_ms": round(eager, 3), "weight_floor_ms_derived": round(floor_ms, 3),
                 "graph_vs_floor": round(loop / floor_ms, 3)}
            # per category at this context: the graph without that category
            step.reset(pos=ctx, tokens=(9707,))
            cats = {}
            for c in CATEGORIES:
                g = step.capture_without((c,))
                n = max(5, a.reps // 3)
                cats[c] = round(loop - events_ms(s, lambda g=g: [g.launch(s) for _ in range(n)], n), 4)
                del g
            r["ms_by_category"] = cats
            print(r, flush=True)
            results.append(r)
            result_file("step", results, {"model": cfg.name, "partial": True}, a.out)  # kept if a later part dies
        # ---- nothing allocates after start-up: a 1,000-token graph loop
        step.reset(pos=a.contexts[0], tokens=(9707,))
        step.replay()
        s.synchronize()
        pool = cp.get_default_memory_pool()
        before = {"used_bytes": pool.used_bytes(), "total_bytes": pool.total_bytes(), "n_free_blocks": pool.n_free_blocks()}
        t0 = time.perf_counter()
        for _ in range(a.alloc_steps):
            step.replay()
        tok = step.read_token()
        dt = time.perf_counter() - t0
        after = {"used_bytes": pool.used_bytes(), "total_bytes": pool.total_bytes(), "n_free_blocks": pool.n_free_blocks()}
    alloc = {"steps": a.alloc_steps, "before": before, "after": after, "unchanged": before == after,
             "wall_ms_per_token_incl_host_loop": round(dt / a.alloc_steps * 1e3, 4), "last_token": tok,
             "context_start": a.contexts[0]}
    print(alloc, flush=True)
    extra = {"model": cfg.name, "method": __doc__.split("\n\n")[2].replace("\n", " "),
             "materialise_s": round(t_mat, 2), "weights_gb": round(w.nbytes / 1e9, 3), "step_init_s": round(t_init, 2),
             "weight_bytes_per_token": cfg.weight_bytes_per_token, "floor_stated_ms": FLOOR_STATED_MS,
             "floor_derived_ms": round(floor_ms, 3), "kernels_per_step": sum(kernels.values()),
             "launch_inventory": kernels, "alloc_check": alloc, "check": {"eager_token": tok_e, "graph_token": tok_g}}
    p = result_file("step", results, extra, a.out)
    print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
