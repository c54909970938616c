"""Benchmark of GPU prefill (``discrete.prefill.Prefill``) on the 27B synthetic weights (issue 23).

``python3 -m bench.bench_prefill [--preset qwen3.5-27b] [--lengths 512 4096 32768] [--out DIR]``

Checked, then timed. Check: a 300-token prompt through Prefill leaves the same GDN state, conv rings, KV pages
and next-step logits (bit patterns) as eager 8-row decode passes; a failure is reported and nothing is timed.
Rows (wall clock, host ``perf_counter`` around the whole call, the stream synchronised):

* ``cold`` per length T: a fresh session (position 0), T random ids → the first generated token: Prefill over
  T − 1 ids, then the last id as the captured M = 1 decode step and its device argmax read back (TTFT);
  tokens/s = T / TTFT; ``profile_ms``: GPU milliseconds per category from CUDA events of a second, profiled run
  (embed, norm, gemm, split = the in-projection's column copies, the GDN kernels gdn_in / gdn_recur / gdn_out and
  their total gdn, the attention stages attn_prep / attn_scores / attn_values / attn_reduce and their total attn).
* ``append``: a 4,096-token session appended with 256 tokens → first token.
* ``eager`` per short length: the same prompt as eager 8-row decode passes (the path Prefill replaces), and
  ``prefill`` at the same length: the crossover.
* ``cublas``: ``cupy.matmul`` bf16 on the same projection shapes at M = 4,096 (weights widened to bf16 outside
  the timing), summed over one forward pass's calls: the library anchor for the ``gemm`` category.
Writes ``prefill.json`` to ``--out`` (default ``bench/results/e2e``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_gemm import cublas_dtype, shapes  # noqa: E402
from bench.harness import result_file  # noqa: E402
from discrete.prefill import Prefill  # noqa: E402
from discrete.step import DecodeStep  # noqa: E402
from discrete.weights_gpu import WeightsGPU  # noqa: E402
from loader.config import FIRST_PADDING_ID, preset  # noqa: E402
from loader.synthetic import SyntheticWeights  # noqa: E402

TARGETS_S = {4096: 0.35, 32768: 4.0}  # issue 23: cold prefill wall time


def _ids(n, seed):
    return np.random.default_rng(seed).integers(0, FIRST_PADDING_ID, size=n)


def ttft(step, pre, ids, fresh: bool = True, profile=None) -> float:
    """Seconds from ids to the first generated token (Prefill on ids[:-1], the last id as a graph replay)."""
    if fresh:
        step.reset()
    step.stream.synchronize()
    t0 = time.perf_counter()
    if ids.size > 1:
        pre.run(ids[:-1], profile)
    step.replay([int(ids[-1])])
    step.read_token()
    return time.perf_counter() - t0


def check(step, pre) -> str | None:
    """None when a 300-token Prefill equals eager decode passes bit for bit, else the first difference."""
    ids = _ids(301, 11)
    snaps = []
    for way in ("eager", "prefill"):
        step.reset()
        if way == "eager":
            step.prefill(ids[:300])
        else:
            pre.run(ids[:300])
        step.run_eager([int(ids[300])])
        step.stream.synchronize()
        s = {f"rec{i}": a.get().view(np.uint32) for i, a in step.rec.items()}
        s.update({f"ring{i}": a.get() for i, a in step.ring.items()})
        for j, i in enumerate(step.cfg.full_layers):
            k, v = step.kv.gather(step.sess, j, step.pos)
            s[f"k{i}"], s[f"v{i}"] = k.view(np.uint16), v.view(np.uint16)
        s["logits"] = step.buffer("logits", 1).view(np.uint16)
        snaps.append(s)
    for k in snaps[0]:
        if not np.array_equal(snaps[0][k], snaps[1][k]):
            return f"{k}: {int(np.sum(snaps[0][k] != snaps[1][k]))} elements differ"
    return None


def cublas_pass_s(cfg, M: int = 4096, reps: int = 5) -> dict:
    """cuBLAS bf16 seconds for one forward pass's projections at M rows (Σ shape time × calls), per shape."""
    import cupy as cp
    dt, dname = cublas_dtype()
    out, total = {}, 0.0
    for name, N, K, _epi, calls in shapes(cfg):
        if not calls:
            continue
        x = cp.asarray(np.random.default_rng(1).standard_normal((M, K), np.float32).astype(dt))
        w = cp.asarray((np.random.default_rng(2).standard_normal((K, N), np.float32) * 0.01).astype(dt))
        y = cp.empty((M, N), dt)
        cp.matmul(x, w, out=y)
        ts = []
        for _ in range(reps):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            cp.matmul(x, w, out=y)
            b.record()
            b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b))
        ms = float(np.median(ts))
        out[name] = {"N": N, "K": K, "calls": calls, "ms": round(ms, 4),
                     "tflops": round(2 * M * N * K / ms / 1e9, 1)}
        total += ms * calls
        del x, w, y
    return {"M": M, "dtype": dname, "pass_s": round(total / 1e3, 4), "shapes": out}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-27b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--short", type=int, nargs="+", default=[2, 8, 16, 64, 256])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "e2e"))
    a = ap.parse_args(argv)
    cfg = preset(a.preset)
    cap = max([*a.lengths, 4096 + 256]) + 16
    t0 = time.perf_counter()
    w = WeightsGPU.from_synthetic(SyntheticWeights(cfg, 0))
    step = DecodeStep(cfg, w, cap, 1, debug_logits=True)
    pre = Prefill(step)
    meta = {"preset": a.preset, "chunk": pre.chunk, "scratch_bytes": int(pre.nbytes), "capacity": cap,
            "targets_s": {str(k): v for k, v in TARGETS_S.items()},
            "start_s": round(time.perf_counter() - t0, 1)}
    bad = check(step, pre)
    print(f"check (300 ids, prefill vs eager decode passes, bits): {'OK' if bad is None else bad}", flush=True)
    if bad is not None:
        result_file("prefill", [], {**meta, "check": bad}, a.out)
        sys.exit(1)
    meta["check"] = "bit-identical to eager decode passes (300 ids)"
    step.reset()
    step.capture()                      # the last id runs as the decode graph, as the executor does
    ttft(step, pre, _ids(64, 1))        # warm-up
    results = []
    for T in a.lengths:
        ids = _ids(T, T)
        s = ttft(step, pre, ids)
        prof: dict = {}
        ttft(step, pre, ids, profile=prof)
        for cat in ("gdn", "attn"):  # the mixers' totals beside their stages
            prof[cat] = sum(v for k, v in prof.items() if k.startswith(cat + "_"))
        e = {"variant": "cold", "tokens": T, "ttft_s": round(s, 4), "tokens_per_s": round(T / s, 1),
             "profile_ms": {k: round(v, 2) for k, v in sorted(prof.items())}}
        if T in TARGETS_S:
            e["target_s"] = TARGETS_S[T]
        results.append(e)
        print(f"cold T={T}: TTFT {s:.3f} s ({T / s:.0f} tokens/s); GPU ms {e['profile_ms']}", flush=True)
        result_file("prefill", results, meta, a.out)
    base = _ids(4096, 40)
    ttft(step, pre, base)
    app = _ids(256, 41)
    s = ttft(step, pre, app, fresh=False)
    results.append({"variant": "append", "tokens": 256, "context": 4096, "ttft_s": round(s, 4)})
    print(f"append 256 to 4,096: TTFT {s:.3f} s", flush=True)
    for T in a.short:
        ids = _ids(T, 100 + T)
        sp = ttft(step, pre, ids)
        step.reset()
        step.stream.synchronize()
        t1 = time.perf_counter()
        step.prefill(ids)
        se = time.perf_counter() - t1
        results.append({"variant": "short", "tokens": T, "prefill_s": round(sp, 4), "eager_passes_s": round(se, 4)})
        print(f"T={T}: Prefill {sp * 1e3:.1f} ms, eager 8-row passes {se * 1e3:.1f} ms", flush=True)
    result_file("prefill", results, meta, a.out)
    del pre, step, w
    import cupy as cp
    cp.get_default_memory_pool().free_all_blocks()
    cb = cublas_pass_s(cfg)
    meta["cublas_4096"] = cb
    print(f"cuBLAS {cb['dtype']} projections of one 4,096-row pass: {cb['pass_s']} s", flush=True)
    p = result_file("prefill", results, meta, a.out)
    print(f"wrote {p}")


if __name__ == "__main__":
    main()
