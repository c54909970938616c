"""Benchmark of the GEMV family and the lm_head on the 27B shapes (article Parts 4.3, 4.4, 9).

``PYTHONPATH=. python3 bench/bench_gemv.py [--preset qwen3.5-27b] [--rows 1 8] [--out DIR]``

Per shape and row count M: a correctness check on copy 0 against the NumPy reference (a row subset, all splits;
one bf16 ulp as in tests/gpu/test_gemv.py) — a shape that fails is reported as failed and not timed — then
CUDA-graph replays over distinct weight copies (> 126 MB together) of (a) the split-K partial kernel alone and
(b) partial + reduce with the shape's epilogue (lm_head: projection + merge, argmax and top-k variants).
Bytes = weight + scale bytes. Writes gemv.json (JSON under bench/results/ or --out) and prints a table.
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
from loader.config import preset  # noqa: E402

# (name, rows, cols, fp8, epilogue, calls per token of the 27B: 48 GDN + 16 attention layers, + lm_head)
def shapes(cfg):
    h, f, nl = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    ng, na = len(cfg.linear_layers), len(cfg.full_layers)
    return [("gate_up", 2 * f, h, True, "swiglu", nl), ("down", h, f, True, "residual", nl),
            ("gdn_qkv", cfg.gdn_conv_dim, h, True, "store", ng), ("gdn_z", cfg.gdn_value_dim, h, True, "store", ng),
            ("gdn_out", h, cfg.gdn_value_dim, True, "residual", ng),
            ("in_proj_ab", cfg.linear_num_value_heads, h, False, "store", 2 * ng),
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


VARIANTS = {"pf128": {"QMK_LD_L2_PREFETCH": 128}, "pf256": {"QMK_LD_L2_PREFETCH": 256}}
LMH_VARIANTS = {"pf0": {"QMK_LD_L2_PREFETCH": 0},
                "st3mb3pf256": {"QMK_GEMV_STAGES": 3, "QMK_LMH_MIN_BLOCKS": 3, "QMK_LD_L2_PREFETCH": 256}}


def bench_shape(cfg, name, N, K, fp8, epi, rows_list, rng, variants=None):
    """Check then time one shape; ``variants`` (name → defines) are timed after the default build and must
    reproduce its output bits exactly (a variant that does not is reported, not timed)."""
    import cupy as cp
    from discrete.gemv import Gemv
    if fp8:
        wb = rng.integers(0, 256, size=(N, K), dtype=np.uint8)
        wb[(wb & 0x7F) == 0x7F] &= 0xFE
        s = (rng.uniform(0.5, 2.0, size=(-(-N // 128), K // 128)) * 2.0 ** -9).astype(np.float32).astype(BF16)
        w_host, w0 = wb.view(FP8), cp.asarray(wb)
        s_d = cp.asarray(s.view(np.uint16))
    else:
        w_host = (rng.standard_normal((N, K), dtype=np.float32) * 0.05).astype(BF16)
        s, s_d, w0 = None, None, cp.asarray(w_host.view(np.uint16))
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
        cp.cuda.runtime.deviceSynchronize()
        rows = np.unique(np.concatenate([np.arange(min(N, 64)), rng.choice(N, min(N, 512), replace=False)]))
        ok, nbad = check_rows(cp.asnumpy(out), w_host, s, x, rows, S)
        base = {"shape": name, "N": N, "K": K, "weight": "fp8" if fp8 else "bf16", "split": S, "M": M,
                "copies": R, "check_rows": int(rows.size), "correct": ok}
        if not ok:
            res.append({**base, "variant": "FAILED CHECK", "bad": nbad})
            continue
        r_d = cp.zeros((M, N), cp.uint16) if epi == "residual" else None
        outs = [cp.empty((M, ge[0].n_out), cp.uint16) for _ in range(R)]
        t_p = time_rotation([lambda i=i: gs[i].partial(x_d, partials) for i in range(R)])
        t_e = time_rotation([lambda i=i: ge[i](x_d, outs[i], partials, r_d) for i in range(R)])
        res.append({**base, "variant": "partial", **t_p, **bandwidth(g0.weight_bytes, t_p["median_ms"])})
        res.append({**base, "variant": f"partial+reduce({epi})", **t_e, **bandwidth(g0.weight_bytes, t_e["median_ms"])})
        want = cp.asnumpy(out)
        for vname, defs in ((variants or {}).items() if M == 1 else ()):
            gv = [Gemv(cfg, ws[i], ss[i], name=name, defines=defs) for i in range(R)]
            o = cp.full((M, N), 0x7FC0, cp.uint16)
            gv[0](x_d, o, partials)
            same = bool(np.array_equal(cp.asnumpy(o), want))
            if not same:
                res.append({**base, "variant": f"sweep:{vname}", "correct": False, "note": "bits differ from default"})
                continue
            t_v = time_rotation([lambda i=i: gv[i].partial(x_d, partials) for i in range(R)])
            res.append({**base, "variant": f"sweep:{vname}:partial", "defines": defs, **t_v,
                        **bandwidth(g0.weight_bytes, t_v["median_ms"])})
    del ws, ss, gs, ge
    cp.get_default_memory_pool().free_all_blocks()
    return res


def bench_lm_head(cfg, rows_list, rng, variants=None):
    import cupy as cp
    from discrete.lm_head import LmHead
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
    ap.add_argument("--only", nargs="*", default=None, help="shape names to run (default all + lm_head)")
    ap.add_argument("--sweep", nargs="*", default=None, help=f"shapes to also time in variants {list(VARIANTS)} / {list(LMH_VARIANTS)} (M=1; none named: all)")
    a = ap.parse_args(argv)
    cfg = preset(a.preset)
    rng = np.random.default_rng(20261129)
    results, per_token = [], {}
    for name, N, K, fp8, epi, calls in shapes(cfg):
        if a.only and name not in a.only:
            continue
        sw = VARIANTS if a.sweep is not None and (not a.sweep or name in a.sweep) else None
        r = bench_shape(cfg, name, N, K, fp8, epi, a.rows, rng, sw)
        results += r
        per_token[name] = calls
        for e in r:
            print(f"{e['shape']:>10} M={e['M']} {e['variant']:<28} " + (
                f"{e['median_ms'] * 1e3:8.2f} us {e['gbps']:7.0f} GB/s {e['pct_of_4468']:6.1f} %" if "gbps" in e else "FAILED"),
                flush=True)
    if not a.only or "lm_head" in a.only:
        sw = LMH_VARIANTS if a.sweep is not None and (not a.sweep or "lm_head" in a.sweep) else None
        for e in bench_lm_head(cfg, a.rows, rng, sw):
            results.append(e)
            print(f"   lm_head M={e['M']} {e['variant']:<28} " + (
                f"{e['median_ms'] * 1e3:8.2f} us {e['gbps']:7.0f} GB/s {e['pct_of_4468']:6.1f} %" if "gbps" in e else "FAILED"),
                flush=True)
    summary = family_summary(results, per_token)
    for k, v in summary.items():
        print(f"family per token ({k}): {v}")
    p = result_file("gemv", results, {"preset": a.preset, "family_per_token": summary}, a.out)
    print(f"wrote {p}")


def family_summary(results, per_token):
    """Derived: per-token GEMV-family bytes / time at M=1 (each shape × its calls per token), per variant."""
    out = {}
    for variant in ("partial", "with_reduce"):
        nbytes = ms = 0.0
        for e in results:
            if e["M"] != 1 or "gbps" not in e or e["shape"] not in per_token:
                continue
            if variant == "partial" and e["variant"] != "partial":
                continue
            if variant == "with_reduce" and not e["variant"].startswith("partial+reduce"):
                continue
            nbytes += e["bytes"] * per_token[e["shape"]]
            ms += e["median_ms"] * per_token[e["shape"]]
        if ms:
            out[variant] = {"bytes": int(nbytes), "ms": round(ms, 4), **bandwidth(int(nbytes), ms)}
    return out


if __name__ == "__main__":
    main()
