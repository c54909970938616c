"""Session 5 probe: the fp8 GEMV tile fed by TMA 2D copies (tma_probe.cu) against the production M = 1 kernels.

``python3 -m bench.probes.tma_probe [--out DIR] [--quick]`` (H200). Per shape (27B, M = 1): ``Gemv.partial``
with each M = 1 kind (general kernel, cp.async ring, register tile, the rule), then ``probe_tma_{1,2}`` (the
production TMA loop, boxes of 16 rows × 128 / 256 bytes) over warp counts and ring depths 2-3 that fit in shared
memory. Every variant's partials are compared bit for bit with the general kernel's before it is timed. Writes
``tma_probe.json``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import bandwidth, device_meta, time_rotation  # noqa: E402
from bench.probes.gemv_probe import RING_SHAPES, save, shape_setup  # noqa: E402
from discrete.build import nvrtc_options, translation_unit  # noqa: E402
from discrete.gemv import tensor_map  # noqa: E402
from loader.config import preset  # noqa: E402

HERE = Path(__file__).resolve().parent
MAX_WARPS = {1: 28, 2: 20}  # the kernels' __launch_bounds__
SMEM_MAX = 227 * 1024


def main(argv=None) -> int:
    import cupy as cp
    from discrete.gemv import Gemv
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="fewer warp counts / depths")
    ap.add_argument("--shapes", nargs="*", default=list(RING_SHAPES))
    a = ap.parse_args(argv)
    cfg = preset("qwen3.5-27b")
    code = translation_unit(cfg, [], {}) + '#include "gemv.cu"\n' + (HERE / "tma_probe.cu").read_text()
    mod = cp.RawModule(code=code, options=nvrtc_options(), backend="nvrtc")
    rows = []
    xg = np.random.default_rng(0).standard_normal((1, 17408)).astype(np.float32)
    for name in a.shapes:
        N, K, S = RING_SHAPES[name]
        nb, ws, x, slices, tasks = shape_setup(cp, xg, N, K, S)
        P = cp.zeros(S * N, cp.float32)
        want = None
        for knob, label in ((0, "general kernel"), (1, "m1 cp.async ring"), (2, "m1 register tile"),
                            (-1, "production rule")):
            gs = [Gemv(cfg, w, sc, split=S, name=name, defines={"QMK_GEMV_M1": knob}) for w, sc in ws]
            P[:] = np.nan
            got = gs[0].partial(x, P).copy().reshape(-1)
            want = got if want is None else want
            same = bool(cp.array_equal(got.view(cp.uint32), want.view(cp.uint32)))
            t = time_rotation([lambda g=g: g.partial(x, P) for g in gs])
            rows.append({"variant": label, "kind": gs[0].m1_kind, "shape": name, "S": S, "tasks_per_sm": tasks,
                         "us": round(t["median_ms"] * 1e3, 2), **bandwidth(nb, t["median_ms"]), "bit_identical": same})
            print(f"{name:9s} S{S} tasks/SM {tasks:3d} {label:18s} ({gs[0].m1_kind}) {rows[-1]['us']:8.2f} us "
                  f"{rows[-1]['pct_of_4468']:6.1f} %  same={same}", flush=True)
            del gs
        for kpb in (1, 2):
            maps = [tensor_map(w, kpb) for w, _ in ws]
            sb = 16 * 128 * kpb
            warps = sorted({min(MAX_WARPS[kpb], tasks), *(w for w in (8, 12, 16) if w < tasks)})
            if a.quick:
                warps = warps[-2:]
            kern = f"probe_tma_{kpb}"
            f = mod.get_function(kern)
            for nw in warps:
                depths = [R for R in (2, 3) if nw * R * (sb + 8) + 128 <= SMEM_MAX]
                for R in depths[:1] if a.quick else depths:
                    smem = nw * R * (sb + 8) + 128
                    if f.max_dynamic_shared_size_bytes < smem:
                        f.max_dynamic_shared_size_bytes = smem

                    def go(i, f=f, nw=nw, R=R, smem=smem, maps=maps, ws=ws):
                        f((132,), (32 * nw,), (maps[i], ws[i][1], x, np.int32(N), np.int32(K), np.int32(S),
                                               slices, P, np.int32(R)), shared_mem=smem)
                    P[:] = np.nan
                    go(0)
                    same = bool(cp.array_equal(P.view(cp.uint32), want.view(cp.uint32)))
                    t = time_rotation([lambda i=i: go(i) for i in range(len(ws))])
                    r = {"variant": kern, "shape": name, "S": S, "warps": nw, "R": R,
                         "kb_in_flight_per_sm": nw * (R - 1) * sb // 1024,
                         "us": round(t["median_ms"] * 1e3, 2), **bandwidth(nb, t["median_ms"]),
                         "bit_identical": same}
                    rows.append(r)
                    print(f"{name:9s} S{S} {kern:13s} w{nw:2d} R{R:2d} {r['us']:8.2f} us "
                          f"{r['pct_of_4468']:6.1f} %  same={same}", flush=True)
            del maps
        del ws
        cp.get_default_memory_pool().free_all_blocks()
    return save(a.out, "tma_probe.json", {"meta": device_meta(), "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
