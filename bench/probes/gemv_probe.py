"""Diagnostics for the GEMV bandwidth ceiling (issue 5): see gemv_probe.cu for the kernels.

``python3 -m bench.probes.gemv_probe [--out DIR] [--ncu-target]`` (H200). Prints a table and writes
``gemv_probe.json``: contiguous-read ceilings per size, the GEMV access pattern without arithmetic, the
production kernel, dynamic task tickets, per-warp start/end stamps. ``--ncu-target``: only a few production GEMV
launches (gate|up, z), for ``ncu``. Every figure is weight bytes over the median event-timed graph replay,
operands rotated through > 2 × L2. Results of run 6 (2026-11-29): ``run6_*`` beside this file and
docs/kernels-gemv.md.

``--quick`` / ``--bulk-variants`` time the REJECTED bulk-staged kernel and L2-prefetch variants; they need
``git apply bench/probes/rejected_gemv_bulk_and_l2_prefetch.patch`` first (``Gemv(bulk=...)``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import bandwidth, copies_for, device_meta, time_rotation  # noqa: E402
from discrete.build import nvrtc_options, translation_unit  # noqa: E402
from discrete.partition import gemv_slices  # noqa: E402
from loader.config import preset  # noqa: E402

HERE = Path(__file__).resolve().parent
SHAPES = {"gate_up": (34816, 5120, 1), "down": (5120, 17408, 8), "gdn_qkv": (10240, 5120, 4),
          "gdn_z": (6144, 5120, 8), "out_o": (5120, 6144, 8), "attn_qkv": (14336, 5120, 4)}
EPI = {"gate_up": "swiglu", "down": "residual", "out_o": "residual"}


def module(cfg, defines=None):
    import cupy as cp
    code = translation_unit(cfg, [], defines) + (HERE / "gemv_probe.cu").read_text()
    return cp.RawModule(code=code, options=nvrtc_options(), backend="nvrtc")


def save(out_dir, name: str, obj) -> int:
    """Write obj as JSON to out_dir/name (creating out_dir); returns 0 (the exit status)."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / name).write_text(json.dumps(obj, indent=1))
    return 0


def weights(cp, N, K, copies, seed=0):
    cp.random.seed(seed)
    out = []
    for _ in range(copies):
        w = cp.random.randint(0, 256, size=(N, K), dtype=cp.int32).astype(cp.uint8)
        w[(w & 0x7F) == 0x7F] = 0  # no NaN codes
        s = (cp.random.random((-(-N // 128), K // 128), dtype=cp.float32) * 0.01 + 0.001).view(cp.uint32) >> 16
        out.append((w, s.astype(cp.uint16)))
    return out


def shape_setup(cp, xg, N, K, S):
    """Operands of one probe shape: (weight + scale bytes, weight copies over > 2 × L2, x [1, K] bf16 bits from
    the float rows xg, slices on the device, the most tasks any slice holds)."""
    nb = N * K + (-(-N // 128)) * (K // 128) * 2
    ws = weights(cp, N, K, copies_for(nb))
    x = cp.asarray((xg[:1, :K].view(np.uint32) >> 16).astype(np.uint16))
    sl_host = gemv_slices(N, K, S)
    return nb, ws, x, cp.asarray(sl_host), int((sl_host[:, 1] - sl_host[:, 0]).max())


def main(argv=None) -> int:
    import cupy as cp
    from discrete.gemv import Gemv
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--ncu-target", action="store_true")
    ap.add_argument("--bulk", action="store_true", help="--ncu-target: the bulk-staged kernel")
    ap.add_argument("--quick", action="store_true", help="skip the read-only probes (run 6 part 1)")
    ap.add_argument("--bulk-variants", action="store_true", help="build variants of the bulk kernel (run 6 part 3)")
    ap.add_argument("--runs", action="store_true", help="per-row run length probes (session 4)")
    ap.add_argument("--ring", action="store_true", help="ring-tile knobs: where the math costs (session 4)")
    a = ap.parse_args(argv)
    cfg = preset("qwen3.5-27b")
    if a.runs:
        return run_length(cfg, a.out)
    if a.ring:
        return ring_knobs(cfg, a.out, a.quick)
    if a.ncu_target:
        for name in ("gate_up", "gdn_z"):
            N, K, S = SHAPES[name]
            (w, s), = weights(cp, N, K, 1)
            g = Gemv(cfg, w, s, split=S, name=name, **({"bulk": True} if a.bulk else {}))
            x = cp.asarray((np.random.default_rng(0).standard_normal((1, K)).astype(np.float32).view(np.uint32) >> 16)
                           .astype(np.uint16))
            P = cp.zeros(g.partials_size(1), cp.float32)
            for _ in range(3):
                g.partial(x, P)
        cp.cuda.Device().synchronize()
        return 0

    if a.bulk_variants:
        return bulk_variants(cfg, a.out)
    mod = module(cfg)
    sink = cp.zeros(4, cp.uint32)
    res = {"meta": device_meta(), "rows": []}
    rows = res["rows"]

    def rec(kind, shape, t, nbytes, **kw):
        r = {"kind": kind, "shape": shape, "us": round(t["median_ms"] * 1e3, 2), **bandwidth(nbytes, t["median_ms"]), **kw}
        rows.append(r)
        print(f"{kind:22s} {shape:10s} {r['us']:8.2f} us {r['pct_of_4468']:6.1f} %  {kw if kw else ''}", flush=True)

    # 1. contiguous read ceiling at each shape's size (and 1 GB)
    sizes = {k: v[0] * v[1] for k, v in SHAPES.items()}
    sizes["1GB"] = 1 << 30
    for name, nb in ({} if a.quick else sizes).items():
        n = copies_for(nb)
        bufs = [cp.empty(nb, cp.uint8) for _ in range(n)]
        for b in bufs:
            b[:] = 1
        for kern, blocks, threads in (("probe_stream4", 132, 1024), ("probe_stream8", 132, 1024),
                                      ("probe_stream4", 264, 512), ("probe_stream8", 132, 512)):
            f = mod.get_function(kern)
            t = time_rotation([lambda b=b: f((blocks,), (threads,), (b, np.uint64(nb), sink)) for b in bufs])
            rec(f"{kern}x{blocks}x{threads}", name, t, nb)
        del bufs
        cp.get_default_memory_pool().free_all_blocks()

    xg = np.random.default_rng(0).standard_normal((8, 17408)).astype(np.float32)
    for name, (N, K, S) in SHAPES.items():
        nb = N * K + (-(-N // 128)) * (K // 128) * 2
        ws = weights(cp, N, K, copies_for(nb))
        x = cp.asarray((xg[:1, :K].view(np.uint32) >> 16).astype(np.uint16))
        slices = cp.asarray(gemv_slices(N, K, S))
        # 2. access pattern only
        for kern, threads in () if a.quick else (("probe_tile_read2", 896), ("probe_tile_read4", 768)):
            f = mod.get_function(kern)
            t = time_rotation([lambda w=w: f((132,), (threads,), (w, np.int32(K), np.int32(S), slices, sink))
                               for w, _ in ws])
            rec(kern, name, t, nb)
        # production kernel (partials only), the baseline
        gs = [Gemv(cfg, w, s, split=S, name=name, epilogue=EPI.get(name, "store"), bulk=False) for w, s in ws]
        P = cp.zeros(gs[0].partials_size(8), cp.float32)  # S · 8 · N: enough for every launch below
        t = time_rotation([lambda g=g: g.partial(x, P) for g in gs])
        rec("prod_partial", name, t, nb)
        ref_P = gs[0].partial(x, P).copy()
        # bulk-staged kernel: bit identity with the tile kernel (partials, M = 1 and 8; fused epilogue M = 1), timing
        epi = EPI.get(name, "store")
        x8 = cp.asarray((xg[:, :K].view(np.uint32) >> 16).astype(np.uint16))
        gb = [Gemv(cfg, w, s, split=S, name=name, bulk=True, epilogue=epi) for w, s in ws]
        gt = Gemv(cfg, *ws[0], split=S, name=name, bulk=False, epilogue=epi)
        same = {}
        for M in (1, 3, 8):
            xm = x8[:M].copy()
            P[:] = np.nan
            want = gt.partial(xm, P).copy()
            P[:] = np.nan
            got = gb[0].partial(xm, P)
            same[f"partial_M{M}"] = bool(cp.array_equal(got.view(cp.uint32), want.view(cp.uint32)))
            n_out = gt.n_out
            res = cp.asarray(np.random.default_rng(M).integers(0, 1 << 14, (M, N)).astype(np.uint16)) \
                if epi == "residual" else None
            o1 = cp.full((M, n_out), 0xFFFF, cp.uint16)
            o2 = cp.full((M, n_out), 0xFFFF, cp.uint16)
            gt(xm, o1, P, residual=res, fused=False)
            for fused in (True, False):
                o2[:] = 0xFFFF
                gb[0](xm, o2, P, residual=res, fused=fused)
                same[f"out_M{M}_fused{int(fused)}"] = bool(cp.array_equal(o1, o2))
        ok = all(same.values())
        print(f"bulk {name}: bit-identical to tile: {ok} {same if not ok else ''}", flush=True)
        if ok:
            t = time_rotation([lambda g=g: g.partial(x, P) for g in gb])
            rec("bulk_partial", name, t, nb, slots=gb[0]._bulk_plan[1][0])
            out1 = cp.zeros((1, gb[0].n_out), cp.uint16)
            res1 = cp.zeros((1, N), cp.uint16) if epi == "residual" else None
            t = time_rotation([lambda g=g: g(x, out1, P, residual=res1, fused=True) for g in gb])
            rec("bulk_fused", name, t, nb)
            t = time_rotation([lambda g=g: g(x, out1, P, residual=res1, fused=False) for g in gb])
            rec("bulk_part+reduce", name, t, nb)
            t = time_rotation([lambda g=g: g(x, out1, P, residual=res1) for g in gs])
            rec("tile_default_call", name, t, nb)
            x8m = x8.copy()
            t = time_rotation([lambda g=g: g.partial(x8m, P) for g in gb])
            rec("bulk_partial_M8", name, t, nb)
            t = time_rotation([lambda g=g: g.partial(x8m, P) for g in gs])
            rec("tile_partial_M8", name, t, nb)
        rows.append({"kind": "bulk_identity", "shape": name, **same})
        del gb, gt
        if a.quick:
            del ws, gs
            cp.get_default_memory_pool().free_all_blocks()
            continue
        # 3. dynamic tickets
        T = (N // 16) * S
        ticket = cp.zeros(2, cp.uint32)
        for kern, blocks, threads in (("probe_gemv_dyn", 132, 896), ("probe_gemv_dyn512", 264, 512)):
            f = mod.get_function(kern)
            args = lambda w, s: (w, s, x, np.int32(1), np.int32(N), np.int32(K), np.int32(S), np.int32(T), P, ticket)
            P[:] = np.nan
            f((blocks,), (threads,), args(*ws[0]))
            same = bool(cp.array_equal(P[:ref_P.size].view(cp.uint32), ref_P.reshape(-1).view(cp.uint32)))
            t = time_rotation([lambda w=w, s=s: f((blocks,), (threads,), args(w, s)) for w, s in ws])
            rec(f"{kern}x{blocks}", name, t, nb, bit_identical=same, ticket_after=[int(v) for v in ticket.get()])
        # 4. per-warp stamps of one production launch (copy 0, after the timed runs: clocks are up)
        stamps = cp.zeros(2 * 132 * 28, cp.uint64)
        f = mod.get_function("probe_gemv_timed")
        for _ in range(3):
            f((132,), (896,), (ws[0][0], ws[0][1], x, np.int32(1), np.int32(N), np.int32(K), np.int32(S), slices, P, stamps))
        cp.cuda.Device().synchronize()
        st = stamps.get().reshape(132, 28, 2).astype(np.int64)
        used = st[:, :, 1] > 0
        t0 = st[:, :, 0][used].min()
        starts, ends = (st[:, :, 0][used] - t0) / 1e3, (st[:, :, 1][used] - t0) / 1e3
        per_sm_end = np.array([(st[b, used[b], 1].max() - t0) / 1e3 for b in range(132)])
        dur = ends - starts
        d = {"warps": int(used.sum()), "start_us_p50_max": [float(np.median(starts)), float(starts.max())],
             "end_us_min_p10_p50_p90_max": [float(v) for v in np.percentile(ends, [0, 10, 50, 90, 100])],
             "sm_end_us_min_p50_max": [float(per_sm_end.min()), float(np.median(per_sm_end)), float(per_sm_end.max())],
             "warp_dur_us_min_p50_max": [float(dur.min()), float(np.median(dur)), float(dur.max())],
             "ideal_us": nb / 4468e3}
        rows.append({"kind": "stamps", "shape": name, **d})
        print(f"stamps {name}: {json.dumps(d)}", flush=True)
        del ws, gs
        cp.get_default_memory_pool().free_all_blocks()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gemv_probe.json").write_text(json.dumps(res, indent=1))
    return 0


# (kernel, warps): RUN bytes per row per batch, D batches in flight per warp (gemv_probe.cu, session 4)
RUN_SHAPES = {"gate_up": (34816, 5120, 1), "down_s4": (5120, 17408, 4), "gdn_qkv_s2": (10240, 5120, 2),
              "gdn_z_s2": (6144, 5120, 2)}
RUN_CONFIGS = [("probe_tile_read2", 28), ("probe_run_reg_128_2_896", 28), ("probe_run_reg_128_4_512", 16),
               ("probe_run_reg_256_2_512", 16), ("probe_run_reg_128_8_384", 12), ("probe_run_reg_512_2_384", 12),
               ("probe_run_cp_128_2", 16), ("probe_run_cp_128_2", 28), ("probe_run_cp_128_4", 16),
               ("probe_run_cp_256_2", 16), ("probe_run_cp_512_1", 16), ("probe_run_cp_128_6", 16),
               ("probe_run_cp_256_3", 16), ("probe_run_cp_512_2", 12), ("probe_run_cp_1024_1", 12),
               ("probe_run_cp_512_2", 8), ("probe_run_cp_256_2", 28), ("probe_run_cp_128_4", 28)]


def run_length(cfg, out_dir) -> int:
    """Read-only probes of the per-row run length (gemv_probe.cu, session 4) on the production task partition."""
    import cupy as cp
    mod = module(cfg)
    sink = cp.zeros(4, cp.uint32)
    rows = []
    for name, (N, K, S) in RUN_SHAPES.items():
        nb = N * K
        ws = [w for w, _ in weights(cp, N, K, copies_for(nb))]
        slices = cp.asarray(gemv_slices(N, K, S))
        for kern, warps in RUN_CONFIGS:
            run, d = (128, 2) if kern == "probe_tile_read2" else map(int, kern.split("_")[3:5])
            if (K // S) % run:
                continue
            smem = d * 16 * run * warps if "_cp_" in kern else 0
            f = mod.get_function(kern)
            if smem > 48 * 1024:
                f.max_dynamic_shared_size_bytes = smem
            t = time_rotation([lambda w=w: f((132,), (32 * warps,), (w, np.int32(K), np.int32(S), slices, sink),
                                             shared_mem=smem) for w in ws])
            r = {"kernel": kern, "shape": name, "warps": warps, "run_bytes": run, "batches_in_flight": d,
                 "inflight_kb_per_sm": d * 16 * run * warps // 1024, "us": round(t["median_ms"] * 1e3, 2),
                 **bandwidth(nb, t["median_ms"])}
            rows.append(r)
            print(f"{name:11s} {kern:26s} w{warps:2d} run {run:4d} D {d} inflight {r['inflight_kb_per_sm']:4d} KB "
                  f"{r['us']:8.2f} us {r['pct_of_4468']:6.1f} %", flush=True)
        del ws
        cp.get_default_memory_pool().free_all_blocks()
    return save(out_dir, "gemv_run_length.json", {"meta": device_meta(), "rows": rows})


RING_SHAPES = {"gate_up": (34816, 5120, 1), "down": (5120, 17408, 8), "down_s4": (5120, 17408, 4),
               "gdn_qkv": (10240, 5120, 4), "gdn_z": (6144, 5120, 8), "gdn_z_s2": (6144, 5120, 2),
               "attn_qkv": (14336, 5120, 4), "out_o": (5120, 6144, 8)}
RING_FLAGS = {0: "ring tile", 1: "x in smem", 2: "no widening", 4: "no mma", 8: "mma non-volatile",
              9: "x smem + mma nv", 3: "x smem + no widening", 6: "no widening, no mma", 16: "x only for g < M"}


def ring_knobs(cfg, out_dir, a_quick=False) -> int:
    """The ring tile's loop with parts switched off (gemv_probe.cu probe_ring_F), per ring depth R."""
    import cupy as cp
    from discrete.gemv import Gemv
    mod = module(cfg, {"QMK_GEMV_RING_MAX": 2})  # gemv_fp8_partial here = the ring build
    rows = []
    xg = np.random.default_rng(0).standard_normal((1, 17408)).astype(np.float32)
    for name, (N, K, S) in RING_SHAPES.items():
        nb, ws, x, slices, tasks = shape_setup(cp, xg, N, K, S)
        warps = min(28, tasks)
        P = cp.zeros(S * N, cp.float32)
        gs = [Gemv(cfg, w, sc, split=S, name=name) for w, sc in ws]
        want = gs[0].partial(x, P).copy()
        t = time_rotation([lambda g=g: g.partial(x, P) for g in gs])
        rows.append({"flags": None, "variant": "production register tile", "shape": name, "S": S,
                     "us": round(t["median_ms"] * 1e3, 2), **bandwidth(nb, t["median_ms"])})
        print(f"{name:9s} S{S} production register tile {rows[-1]['us']:8.2f} us {rows[-1]['pct_of_4468']:6.1f} %")
        del gs

        def go(F, R, w):
            smem = warps * R * 2048 + 2 * K
            f = mod.get_function(f"probe_ring_{F}")
            if f.max_dynamic_shared_size_bytes < smem:
                f.max_dynamic_shared_size_bytes = smem
            f((132,), (32 * warps,), (w[0], w[1], x, np.int32(N), np.int32(K), np.int32(S), slices, P, np.int32(R)),
              shared_mem=smem)

        depths = [R for R in (2, 3, 4, 6, 8) if warps * R * 2048 + 2 * K <= 227 * 1024]
        for nw in (warps, 28):  # the production tile function, launched with min(28, tasks) or 28 warps
            smem = 28 * 2 * 2048
            f = mod.get_function("probe_prod_ring")
            if f.max_dynamic_shared_size_bytes < smem:
                f.max_dynamic_shared_size_bytes = smem
            launch = lambda w, nw=nw, f=f, smem=smem: f(
                (132,), (32 * nw,), (w[0], w[1], x, np.int32(N), np.int32(K), np.int32(S), slices, P, np.int32(2)),
                shared_mem=smem)
            P[:] = np.nan
            launch(ws[0])
            same = bool(cp.array_equal(P.view(cp.uint32), want.reshape(-1).view(cp.uint32)))
            t = time_rotation([lambda w=w: launch(w) for w in ws])
            rows.append({"flags": None, "variant": f"production ring tile, {nw} warps", "shape": name, "S": S,
                         "warps": nw, "R": 2, "us": round(t["median_ms"] * 1e3, 2), **bandwidth(nb, t["median_ms"]),
                         "bit_identical": same})
            print(f"{name:9s} S{S} w{nw:2d} R2 production ring tile {rows[-1]['us']:8.2f} us "
                  f"{rows[-1]['pct_of_4468']:6.1f} %  same={same}", flush=True)
        # session 4: M at run time; the production kernel (gemv_fp8_partial, ring 2, partials only) launched
        # directly with the Gemv's shared-memory size or with 112 KB
        used = warps * 2 * 2048
        for label, kern, smem, extra in (("probe_prod_ring_m", "probe_prod_ring_m", 28 * 4096, "M"),
                                         ("gemv_fp8_partial smem=used", "gemv_fp8_partial", used, "prod"),
                                         ("gemv_fp8_partial smem=112K", "gemv_fp8_partial", 28 * 4096, "prod")):
            f = mod.get_function(kern)
            if f.max_dynamic_shared_size_bytes < smem:
                f.max_dynamic_shared_size_bytes = smem
            i32 = np.int32
            if extra == "M":
                launch = lambda w, f=f, smem=smem: f((132,), (32 * warps,), (
                    w[0], w[1], x, i32(1), i32(N), i32(K), i32(S), slices, P, i32(2)), shared_mem=smem)
            else:
                z = np.uint64(0)
                launch = lambda w, f=f, smem=smem: f((132,), (896,), (
                    w[0], w[1], x, i32(1), i32(N), i32(K), i32(S), slices, P, i32(2), i32(-1), z, z, z),
                    shared_mem=smem)
            P[:] = np.nan
            launch(ws[0])
            same = bool(cp.array_equal(P.view(cp.uint32), want.reshape(-1).view(cp.uint32)))
            t = time_rotation([lambda w=w: launch(w) for w in ws])
            rows.append({"flags": None, "variant": label, "shape": name, "S": S, "R": 2, "smem": smem,
                         "us": round(t["median_ms"] * 1e3, 2), **bandwidth(nb, t["median_ms"]), "bit_identical": same})
            print(f"{name:9s} S{S} {label:32s} {rows[-1]['us']:8.2f} us {rows[-1]['pct_of_4468']:6.1f} %  "
                  f"same={same}", flush=True)
        for F, label in RING_FLAGS.items():
            if a_quick and F not in (0, 16):
                continue
            for R in (depths if F in (0, 1, 9, 16) else depths[-1:]) if not a_quick else depths[:2]:
                P[:] = np.nan
                go(F, R, ws[0])
                same = bool(cp.array_equal(P.view(cp.uint32), want.reshape(-1).view(cp.uint32))) \
                    if F in (0, 1, 8, 9, 16) else None
                t = time_rotation([lambda w=w: go(F, R, w) for w in ws])
                r = {"flags": F, "variant": label, "shape": name, "S": S, "warps": warps, "R": R,
                     "us": round(t["median_ms"] * 1e3, 2), **bandwidth(nb, t["median_ms"]), "bit_identical": same}
                rows.append(r)
                print(f"{name:9s} S{S} w{warps:2d} R{R} {label:22s} {r['us']:8.2f} us {r['pct_of_4468']:6.1f} %  "
                      f"same={same}", flush=True)
        del ws
        cp.get_default_memory_pool().free_all_blocks()
    return save(out_dir, "gemv_ring_knobs.json", {"meta": device_meta(), "rows": rows})


BULK_VARIANTS = {"bulk": {}}
TILE_VARIANTS = {"pf4d8": {"QMK_GEMV_PF_UNITS": 4, "QMK_GEMV_PF_DIST": 8},
                 "pf4d4": {"QMK_GEMV_PF_UNITS": 4, "QMK_GEMV_PF_DIST": 4},
                 "pf8d8": {"QMK_GEMV_PF_UNITS": 8, "QMK_GEMV_PF_DIST": 8},
                 "pf8d16": {"QMK_GEMV_PF_UNITS": 8, "QMK_GEMV_PF_DIST": 16},
                 "pf16d16": {"QMK_GEMV_PF_UNITS": 16, "QMK_GEMV_PF_DIST": 16},
                 "pf40d0": {"QMK_GEMV_PF_UNITS": 40, "QMK_GEMV_PF_DIST": 0},
                 "pf8d8_hint256": {"QMK_GEMV_PF_UNITS": 8, "QMK_GEMV_PF_DIST": 8, "QMK_LD_L2_PREFETCH": 256}}


def bulk_variants(cfg, out_dir) -> int:
    """Time build variants of the bulk kernel (partials, M = 1) against the tile kernel on three shapes."""
    import cupy as cp
    from discrete.gemv import Gemv
    rows = []
    xg = np.random.default_rng(0).standard_normal((1, 17408)).astype(np.float32)
    for name in ("gate_up", "down", "gdn_qkv", "gdn_z", "out_o"):
        N, K, S = SHAPES[name]
        nb = N * K + (-(-N // 128)) * (K // 128) * 2
        ws = weights(cp, N, K, copies_for(nb))
        x = cp.asarray((xg[:, :K].view(np.uint32) >> 16).astype(np.uint16))
        gt = [Gemv(cfg, w, s, split=S, name=name, bulk=False) for w, s in ws]
        P = cp.zeros(gt[0].partials_size(8), cp.float32)
        want = gt[0].partial(x, P).copy()
        t = time_rotation([lambda g=g: g.partial(x, P) for g in gt])
        r = {"variant": "tile", "shape": name, "us": round(t["median_ms"] * 1e3, 2), **bandwidth(nb, t["median_ms"])}
        rows.append(r)
        print(r, flush=True)
        for vn, d in list(BULK_VARIANTS.items()) + list(TILE_VARIANTS.items()):
            try:
                gb = [Gemv(cfg, w, s, split=S, name=name, bulk=vn in BULK_VARIANTS, defines=d) for w, s in ws]
            except Exception as e:  # noqa: BLE001 - a variant that does not build is reported, not fatal
                rows.append({"variant": vn, "shape": name, "error": repr(e)[:300]})
                print(vn, name, "error", repr(e)[:300], flush=True)
                continue
            P[:] = np.nan
            got = gb[0].partial(x, P)
            same = bool(cp.array_equal(got.view(cp.uint32), want.view(cp.uint32)))
            if gb[0].bulk and not gb[0]._bulk_plan[1]:
                continue
            t = time_rotation([lambda g=g: g.partial(x, P) for g in gb])
            r = {"variant": vn, "shape": name, "us": round(t["median_ms"] * 1e3, 2), **bandwidth(nb, t["median_ms"]),
                 "bit_identical": same}
            rows.append(r)
            print(r, flush=True)
        del ws, gt, gb
        cp.get_default_memory_pool().free_all_blocks()
    return save(out_dir, "gemv_bulk_variants.json", rows)


if __name__ == "__main__":
    sys.exit(main())
