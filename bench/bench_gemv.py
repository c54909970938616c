"""Benchmark of the GEMV family and the lm_head on the 27B shapes (article Parts 4.3, 4.4, 9).

``PYTHONPATH=. python3 bench/bench_gemv.py [--preset qwen3.5-27b] [--rows 1 8] [--out DIR] [--only ...]
[--sweep [SHAPE ...]] [--splits] [--name gemv]``; ``--check-fused PRESET`` only checks (no timing).

Per shape and row count M: a correctness check on copy 0 — the fused launch (store epilogue) against the NumPy
reference (a row subset, all splits; one bf16 ulp as in tests/gpu/test_gemv.py), and the fused launch with the
shape's own epilogue bit-identical to the two-launch partial + reduce (tests/gpu covers the latter against
the reference) — a shape that fails is reported as failed and not timed; then CUDA-graph replays over distinct
weight copies (> 126 MB together) of (a) the split-K partial kernel alone, (b) the fused launch with the
shape's epilogue (forced, any M) and (c) partial + separate reduce. ``--sweep``: build variants (M = 1), each bit-identical to
the default build or reported and not timed. ``--splits``: the fused launch at S/2 and 2·S (other numerics:
checked against the reference at that split), evidence for the split rule. lm_head: projection + merge.
Bytes = weight + scale bytes. Writes {name}.json (under bench/results/ or --out) after every shape.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from assembler.numerics import split_k  # noqa: E402
from assembler.ref import ops as ref  # noqa: E402
from assembler.ref.numerics import BF16, FP8  # noqa: E402
from bench.harness import bandwidth, copies_for, result_file, time_rotation  # noqa: E402
from discrete.gemv import Gemv  # noqa: E402
from discrete.lm_head import LmHead  # noqa: E402
from loader.config import preset  # noqa: E402

# (name, rows, cols, fp8, epilogue, calls per token of the 27B: 48 GDN + 16 attention layers, + lm_head). The
# calls are the decode step's launches (discrete/step.py): the GDN in-projection is one launch over the fused
# in_proj_qkv|z rows ("gdn_in"); its two parts stay timed alone for comparison (0 calls), and in_proj_b|a is
# computed inside the GDN step, never launched as a GEMV (0 calls: counting its 96 calls would add ≈ 0.6 ms of
# fused launches the step does not make).
def shapes(cfg):
    h, f, nl = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    ng, na = len(cfg.linear_layers), len(cfg.full_layers)
    return [("gate_up", 2 * f, h, True, "swiglu", nl), ("down", h, f, True, "residual", nl),
            ("gdn_in", cfg.gdn_conv_dim + cfg.gdn_value_dim, h, True, "store", ng),
            ("gdn_qkv", cfg.gdn_conv_dim, h, True, "store", 0), ("gdn_z", cfg.gdn_value_dim, h, True, "store", 0),
            ("gdn_out", h, cfg.gdn_value_dim, True, "residual", ng),
            ("in_proj_ab", cfg.linear_num_value_heads, h, False, "store", 0),
            ("attn_q", cfg.q_proj_rows, h, True, "store", 0), ("attn_kv", cfg.kv_rows, h, True, "store", 0),
            ("attn_qkv", cfg.q_proj_rows + 2 * cfg.kv_rows, h, True, "store", na),
            ("attn_o", h, cfg.attn_out_dim, True, "residual", na), ("mtp_fc", h, 2 * h, False, "store", 0)]


def check_rows(out_u16, w, s, x, rows, S):
    """Compare out[:, rows] with the reference (store epilogue) on those rows; returns (ok, n_bad)."""
    from tests.gpu.test_gemv import close_mask
    P = np.stack([ref.gemv_partial(w, s, x, rows, S, i) for i in range(S)])
    want = ref.gemv_reduce(P, "store")
    ok = close_mask(out_u16[:, rows], want)
    return bool(ok.all()), int((~ok).sum())


# build variants (results must not depend on them). QMK_GEMV_M1 picks the M = 1 kernel (0: the general kernel,
# 1: *_m1 cp.async ring, 2: *_m1r register tile, 3: *_m1t* TMA ring; default: the rule of discrete/gemv.py).
# What the other GEMV knobs measured (ring depth QMK_GEMV_RING_MAX, the ring's L2 hint, QMK_GEMV_X_MASK) is in
# bench/EXPERIMENTS.md.
VARIANTS = {"noM1": {"QMK_GEMV_M1": 0}, "m1ring": {"QMK_GEMV_M1": 1}, "m1reg": {"QMK_GEMV_M1": 2},
            "m1tma": {"QMK_GEMV_M1": 3}, "tma_kpb2": {"QMK_GEMV_M1": 3, "QMK_GEMV_TMA_KPB": 2},
            "tma_kpb1": {"QMK_GEMV_M1": 3, "QMK_GEMV_TMA_KPB": 1}}
LMH_VARIANTS = {"xbranch": {"QMK_GEMV_X_MASK": 2}, "pf0": {"QMK_LD_L2_PREFETCH": 0},
                "st3mb3pf256": {"QMK_GEMV_STAGES": 3, "QMK_LMH_MIN_BLOCKS": 3, "QMK_LD_L2_PREFETCH": 256}}


def make_weights(rng, N, K, fp8):
    """(host weight, host scale or None, device weight bits, device scale bits or None)."""
    import cupy as cp
    if fp8:
        wb = rng.integers(0, 256, size=(N, K), dtype=np.uint8)
        wb[(wb & 0x7F) == 0x7F] &= 0xFE
        s = (rng.uniform(0.5, 2.0, size=(-(-N // 128), K // 128)) * 2.0 ** -9).astype(np.float32).astype(BF16)
        return wb.view(FP8), s, cp.asarray(wb), cp.asarray(s.view(np.uint16))
    w = (rng.standard_normal((N, K), dtype=np.float32) * 0.05).astype(BF16)
    return w, None, cp.asarray(w.view(np.uint16)), None


def fused_vs_two_launch(ge, x_d, partials, r_d):
    """(fused == partial + reduce bitwise, fused output) for one input; launches the fused path twice (its
    tile counters must come back to 0) and, for the residual epilogue, once more in place (out = residual)."""
    import cupy as cp
    M = x_d.shape[0]
    want = cp.full((M, ge.n_out), 0x7FC0, cp.uint16)
    partials.fill(np.nan)
    ge.reduce(ge.partial(x_d, partials), want, r_d)
    ok = True
    for _ in range(2):
        got = cp.full((M, ge.n_out), 0x7FC0, cp.uint16)
        partials.fill(np.nan)
        ge(x_d, got, partials, r_d, fused=True)
        ok &= bool(cp.array_equal(got, want))
    if r_d is not None:
        inplace = r_d.copy()
        ge(x_d, inplace, partials, inplace, fused=True)
        ok &= bool(cp.array_equal(inplace, want))
    ok &= not bool(ge.counters.any())
    return ok, want


def bench_shape(cfg, name, N, K, fp8, epi, rows_list, rng, variants=None, splits=False):
    """Check then time one shape; ``variants`` (name → defines) are timed after the default build and must
    reproduce its output bits exactly (a variant that does not is reported, not timed)."""
    import cupy as cp
    w_host, s, w0, s_d = make_weights(rng, N, K, fp8)
    g0 = Gemv(cfg, w0, s_d, name=name)
    R = copies_for(g0.weight_bytes)
    ws = [w0] + [w0.copy() for _ in range(R - 1)]
    ss = [s_d] + [s_d.copy() for _ in range(R - 1)] if fp8 else [None] * R
    gs = [Gemv(cfg, ws[i], ss[i], name=name) for i in range(R)]
    ge = [Gemv(cfg, ws[i], ss[i], epilogue=epi, name=name) for i in range(R)]
    S = g0.split
    res = []
    for M in rows_list:
        x = (rng.standard_normal((M, K), dtype=np.float32)).astype(BF16)
        x_d = cp.asarray(x.view(np.uint16))
        partials = cp.full(g0.partials_size(M), np.nan, cp.float32)
        out = cp.full((M, N), 0x7FC0, cp.uint16)
        g0(x_d, out, partials)
        rows = np.unique(np.concatenate([np.arange(min(N, 64)), rng.choice(N, min(N, 512), replace=False)]))
        ok, nbad = check_rows(cp.asnumpy(out), w_host, s, x, rows, S)
        r_d = cp.asarray(rng.standard_normal((M, N), dtype=np.float32).astype(BF16).view(np.uint16)) \
            if epi == "residual" else None
        fused_ok, want_e = fused_vs_two_launch(ge[0], x_d, partials, r_d)
        base = {"shape": name, "N": N, "K": K, "weight": "fp8" if fp8 else "bf16", "split": S, "M": M,
                "copies": R, "check_rows": int(rows.size), "correct": ok and fused_ok, "ring": g0.ring,
                "smem": g0.smem}
        if not (ok and fused_ok):
            res.append({**base, "variant": "FAILED CHECK", "bad": nbad, "fused_bit_identical": fused_ok})
            continue
        outs = [cp.empty((M, ge[0].n_out), cp.uint16) for _ in range(R)]
        t_p = time_rotation([lambda i=i: gs[i].partial(x_d, partials) for i in range(R)])
        t_f = time_rotation([lambda i=i: ge[i](x_d, outs[i], partials, r_d, fused=True) for i in range(R)])
        t_2 = time_rotation([lambda i=i: ge[i].reduce(ge[i].partial(x_d, partials), outs[i], r_d) for i in range(R)])
        res.append({**base, "variant": "partial", **t_p, **bandwidth(g0.weight_bytes, t_p["median_ms"])})
        res.append({**base, "variant": f"fused({epi})", **t_f, **bandwidth(g0.weight_bytes, t_f["median_ms"])})
        res.append({**base, "variant": f"partial+reduce({epi})", **t_2, **bandwidth(g0.weight_bytes, t_2["median_ms"])})
        for vname, defs in ((variants or {}).items() if M == 1 else ()):
            gv = [Gemv(cfg, ws[i], ss[i], name=name, defines=defs) for i in range(R)]
            gve = [Gemv(cfg, ws[i], ss[i], epilogue=epi, name=name, defines=defs) for i in range(R)]
            o = cp.full((M, N), 0x7FC0, cp.uint16)
            gv[0](x_d, o, partials)
            oe = cp.full((M, ge[0].n_out), 0x7FC0, cp.uint16)
            gve[0](x_d, oe, partials, r_d, fused=True)
            same = bool(cp.array_equal(o, out)) and bool(cp.array_equal(oe, want_e))
            vb = {**base, "ring": gv[0].ring, "smem": gv[0].smem, "defines": defs}
            if not same:
                res.append({**vb, "variant": f"sweep:{vname}", "correct": False, "note": "bits differ from default"})
                continue
            t_v = time_rotation([lambda i=i: gv[i].partial(x_d, partials) for i in range(R)])
            t_vf = time_rotation([lambda i=i: gve[i](x_d, outs[i], partials, r_d, fused=True) for i in range(R)])
            res.append({**vb, "variant": f"sweep:{vname}:partial", **t_v, **bandwidth(g0.weight_bytes, t_v["median_ms"])})
            res.append({**vb, "variant": f"sweep:{vname}:fused", **t_vf, **bandwidth(g0.weight_bytes, t_vf["median_ms"])})
        if splits and M == 1:
            res += bench_splits(cfg, name, N, K, epi, ws, ss, w_host, s, x, x_d, r_d, rows, R)
    del ws, ss, gs, ge
    cp.get_default_memory_pool().free_all_blocks()
    return res


def bench_splits(cfg, name, N, K, epi, ws, ss, w_host, s, x, x_d, r_d, rows, R):
    """The fused launch at S/2 and 2·S (K-block count permitting): checked against the reference at that
    split (store epilogue, row subset), then timed with the shape's epilogue. Evidence for the split rule."""
    import cupy as cp
    S0, nkb, res = split_k(N, K), K // 128, []
    for S in sorted({S0 // 2, 2 * S0} - {0}):
        if nkb % S:
            continue
        g = Gemv(cfg, ws[0], ss[0], name=name, split=S)
        P = cp.full(g.partials_size(1), np.nan, cp.float32)
        o = cp.full((1, N), 0x7FC0, cp.uint16)
        g(x_d, o, P, fused=True)
        ok, nbad = check_rows(cp.asnumpy(o), w_host, s, x, rows, S)
        b = {"shape": name, "N": N, "K": K, "split": S, "M": 1, "copies": R, "correct": ok, "variant": f"split{S}:fused({epi})"}
        if not ok:
            res.append({**b, "bad": nbad})
            continue
        ge = [Gemv(cfg, ws[i], ss[i], epilogue=epi, name=name, split=S) for i in range(R)]
        outs = [cp.empty((1, ge[0].n_out), cp.uint16) for _ in range(R)]
        t = time_rotation([lambda i=i: ge[i](x_d, outs[i], P, r_d, fused=True) for i in range(R)])
        res.append({**b, "ring": ge[0].ring, **t, **bandwidth(ge[0].weight_bytes, t["median_ms"])})
    return res


def check_fused(cfg, rng, rows_list):
    """Fused launch vs partial + reduce, bitwise, for every shape of cfg (tests/gpu's shape list), every M in
    rows_list, the shape's epilogue and store; returns the list of failures (strings)."""
    import cupy as cp
    from tests.gpu.test_gemv import shapes as test_shapes
    bad = []
    for name, N, K, fp8, epi in test_shapes(cfg):
        _, _, w_d, s_d = make_weights(rng, N, K, fp8)
        for e in sorted({epi, "store"}):
            g = Gemv(cfg, w_d, s_d, epilogue=e, name=name)
            partials = cp.empty(g.partials_size(max(rows_list)), cp.float32)
            for M in rows_list:
                x_d = cp.asarray(rng.standard_normal((M, K), dtype=np.float32).astype(BF16).view(np.uint16))
                r_d = cp.asarray(rng.standard_normal((M, N), dtype=np.float32).astype(BF16).view(np.uint16)) \
                    if e == "residual" else None
                ok, _ = fused_vs_two_launch(g, x_d, partials, r_d)
                print(f"check-fused {name:>10} {e:<8} M={M} S={g.split} ring={g.ring}: {'ok' if ok else 'DIFFERS'}",
                      flush=True)
                if not ok:
                    bad.append(f"{name}/{e}/M={M}")
    return bad


def bench_lm_head(cfg, rows_list, rng, variants=None):
    import cupy as cp
    from tests.gpu.test_gemv import close_mask
    from tests.gpu.test_lm_head import rand_w_dev
    V, K = cfg.vocab_size, cfg.hidden_size
    w_d = rand_w_dev(V, K, 1234)
    head = LmHead(cfg, w_d)
    res = []
    for M in rows_list:
        x = (rng.standard_normal((M, K), dtype=np.float32)).astype(BF16)
        x_d = cp.asarray(x.view(np.uint16))
        bufs = head.buffers(M)
        logits = cp.full((M, V), 0x7FC0, cp.uint16)
        ids = cp.asnumpy(head(x_d, bufs, topk=True, logits=logits)).astype(np.int64)
        lg = cp.asnumpy(logits)
        rows = np.unique(np.concatenate([rng.choice(V, 2048, replace=False), ids]))
        want = ref.gemv(cp.asnumpy(w_d[cp.asarray(rows)]).view(BF16), None, x, "store", split=1)
        ok = bool(close_mask(lg[:, rows], want).all()) and np.array_equal(ids, ref.argmax(lg.view(BF16)))
        base = {"shape": "lm_head", "N": V, "K": K, "weight": "bf16", "split": 1, "M": M, "copies": 1,
                "check_rows": int(rows.size), "correct": ok}
        if not ok:
            res.append({**base, "variant": "FAILED CHECK"})
            continue
        for variant, topk in (("argmax", False), ("topk", True)):
            t = time_rotation([lambda: head(x_d, bufs, topk=topk)], reps=15)
            res.append({**base, "variant": variant, **t, **bandwidth(head.weight_bytes, t["median_ms"])})
        for vname, defs in ((variants or {}).items() if M == 1 else ()):
            hv = LmHead(cfg, w_d, defines=defs)
            lv = cp.full((M, V), 0x7FC0, cp.uint16)
            hv(x_d, bufs, topk=False, logits=lv)
            if not np.array_equal(cp.asnumpy(lv), lg):
                res.append({**base, "variant": f"sweep:{vname}", "correct": False, "note": "bits differ from default"})
                continue
            t = time_rotation([lambda: hv(x_d, bufs, topk=False)], reps=15)
            res.append({**base, "variant": f"sweep:{vname}:argmax", "defines": defs, **t,
                        **bandwidth(head.weight_bytes, t["median_ms"])})
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-27b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="gemv", help="result file stem")
    ap.add_argument("--only", nargs="*", default=None, help="shape names to run (default all + lm_head)")
    ap.add_argument("--sweep", nargs="*", default=None, help=f"shapes to also time in variants {list(VARIANTS)} / {list(LMH_VARIANTS)} (M=1; none named: all)")
    ap.add_argument("--splits", action="store_true", help="also time the fused launch at S/2 and 2S (M=1)")
    ap.add_argument("--check-fused", action="store_true", help="only check fused == two-launch on every shape")
    a = ap.parse_args(argv)
    cfg = preset(a.preset)
    rng = np.random.default_rng(20261129)
    if a.check_fused:
        bad = check_fused(cfg, rng, a.rows)
        print(f"check-fused {a.preset}: {'all bit-identical' if not bad else 'FAILED: ' + ', '.join(bad)}")
        sys.exit(1 if bad else 0)
    results, per_token = [], {}
    meta = {"preset": a.preset}
    for name, N, K, fp8, epi, calls in shapes(cfg):
        if a.only is not None and name not in a.only:
            continue
        sw = VARIANTS if a.sweep is not None and (not a.sweep or name in a.sweep) else None
        r = bench_shape(cfg, name, N, K, fp8, epi, a.rows, rng, sw, a.splits)
        results += r
        per_token[name] = calls
        for e in r:
            print(f"{e['shape']:>10} M={e['M']} {e['variant']:<28} " + (
                f"{e['median_ms'] * 1e3:8.2f} us {e['gbps']:7.0f} GB/s {e['pct_of_4468']:6.1f} %" if "gbps" in e else "FAILED"),
                flush=True)
        result_file(a.name, results, {**meta, "family_per_token": family_summary(results, per_token)}, a.out)
    if a.only is None or "lm_head" in a.only:
        sw = LMH_VARIANTS if a.sweep is not None and (not a.sweep or "lm_head" in a.sweep) else None
        for e in bench_lm_head(cfg, a.rows, rng, sw):
            results.append(e)
            print(f"   lm_head M={e['M']} {e['variant']:<28} " + (
                f"{e['median_ms'] * 1e3:8.2f} us {e['gbps']:7.0f} GB/s {e['pct_of_4468']:6.1f} %" if "gbps" in e else "FAILED"),
                flush=True)
    summary = family_summary(results, per_token)
    for k, v in summary.items():
        print(f"family per token ({k}): {v}")
    p = result_file(a.name, results, {**meta, "family_per_token": summary}, a.out)
    print(f"wrote {p}")


def family_summary(results, per_token):
    """Derived: per-token GEMV-family bytes / time at M=1 (each shape × its calls per token), per variant."""
    kinds = {"partial": lambda v: v == "partial", "fused": lambda v: v.startswith("fused("),
             "partial+reduce": lambda v: v.startswith("partial+reduce")}
    kinds.update({f"sweep:{n}:fused": (lambda v, n=n: v == f"sweep:{n}:fused") for n in VARIANTS})
    out = {}
    for kind, match in kinds.items():
        nbytes = ms = 0.0
        seen = set()
        for e in results:
            if e["M"] != 1 or "gbps" not in e or e["shape"] not in per_token or not match(e["variant"]):
                continue
            seen.add(e["shape"])
            nbytes += e["bytes"] * per_token[e["shape"]]
            ms += e["median_ms"] * per_token[e["shape"]]
        if ms:
            out[kind] = {"bytes": int(nbytes), "ms": round(ms, 4), "shapes": len(seen), **bandwidth(int(nbytes), ms)}
    return out


if __name__ == "__main__":
    main()
