"""Phase clocks of the megakernel's GDN_STEP (session 7 probe): where its 22 µs per value head go, against the
discrete GDN kernel's 8.3 µs (bench/probes/run10/gdn_stamps_final.json). Needs the stamp hooks of
``bench/probes/mk_gdn_stamps.patch`` applied (``git apply``; revert after: the GPU record hashes those files).
``python3 -m bench.probes.mk_gdn_stamps [--out DIR]`` (device): 27B synthetic, context 1024, M = 1; the megakernel
built with QMK_GDN_STAMPS and QMK_GDN_STAMP_BLOCK = an SM that runs GDN steps; stamp 0 = GDN_STEP entry, 1 = after
its RMSNorm of the hidden row, 2.. = gdn.cuh's phases of the last value head that SM ran. Writes mk_gdn_stamps.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PHASES = ("entry", "rmsnorm of x", "loads issued", "conv", "a/b dots", "sync 1", "l2norm + gates, sync 2",
          "recurrence + state store", "sync 3", "gated norm")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--norm-stamps", action="store_true",
                    help="stamps 10-15 inside the RMSNorm of x (needs bench/probes/run12/mk_gdn_norm_stamps.patch, "
                         "which applies to d0f796c)")
    a = ap.parse_args(argv)
    import cupy as cp

    from assembler.isa import Opcode
    from discrete.step import DecodeStep
    from discrete.weights_gpu import WeightsGPU
    from loader.config import preset
    from loader.synthetic import SyntheticWeights
    from megakernel import runner
    cfg = preset("qwen3.5-27b")
    w = WeightsGPU.from_synthetic(SyntheticWeights(cfg, 0))
    ds = DecodeStep(cfg, w, 2048, 1)
    n = cp.cuda.Device().attributes["MultiProcessorCount"]
    prog = runner.split_gdn(runner.build_program(cfg, 1, n), cfg.gdn_head_group)  # the default program's SM lists
    sms = sorted({s for s, lst in enumerate(prog.sm_lists) for i in lst if i.opcode == Opcode.GDN_STEP})
    block = sms[len(sms) // 2]
    extra = {"QMK_GDN_STAMPS": 1, "QMK_GDN_STAMP_BLOCK": block}
    if a.norm_stamps:
        extra["QMK_GDN_NORM_STAMPS"] = 1
    mk = runner.Megakernel(ds, defines=extra)
    mod = runner._load(cfg, False, extra, mk.fuse_reduce, True)
    st = cp.ndarray((16,), cp.int64, mod.get_global("qmk_gdn_stamps"))
    rows = []
    ds.reset(1024, [1000])
    for _ in range(a.reps):
        st.fill(0)
        cp.cuda.Device().synchronize()
        mk.step()
        mk.check()
        rows.append(st.get())
    raw = np.stack(rows[2:])
    d = np.median(np.diff(raw[:, :len(PHASES)], axis=1), axis=0)
    res = {"block": block, "gdn_sms": len(sms), "phases_cycles": {p: float(c) for p, c in zip(PHASES[1:], d)},
           "total_cycles": float(np.median([r[len(PHASES) - 1] - r[0] for r in rows[2:]])),
           "raw_minus_entry_median": [float(v) for v in np.median(raw - raw[:, :1], axis=0)]}
    print(json.dumps(res, indent=1))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "mk_gdn_stamps.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
