"""Refit est_step_ms's GEMV constants (assembler/program.py ``MK_*``) to the megakernel's measured timing build.

``python3 -m tools.cost_fit [--timings bench/results/megakernel_timings.json.xz]`` (CPU; reads the xz'd JSON
that ``bench.bench_megakernel`` writes from the QMK_MK_TIMING build on the H200; ``.gz`` and plain ``.json`` too).

Every GEMV instruction of the timed 27B decode program (the runner's default: GDN steps per value head) is matched
to its words by (SM, index) — the program is rebuilt here from the same assembler, so a schedule change since the
timing run makes the match fail loudly — and the model
    t = MK_FIXED_S + prologue + max(bytes / (SM share of 4,468 GB/s · eff[fp8 | bf16]), rounds · K-blocks · kblock)
(prologue: MK_PRO_S of its sub word's prologue) is fitted by grid search on the mean squared relative error.
Prints the fit and, per class (op kind, prologue, bytes), the measured median against the fitted and the current
constants. The fit is measured data run through a model: the constants it gives are derived, not measured.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import lzma
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from assembler import program as P  # noqa: E402
from assembler.isa import local_reduce, sub_parts  # noqa: E402
from loader.config import preset  # noqa: E402
from megakernel.runner import build_program, split_gdn  # noqa: E402


def rows(timings: dict):
    """(measured s, bytes, serial K-blocks, fp8, prologue, op kind) per GEMV instruction of the timing run."""
    cfg = preset(timings["config"])
    p = split_gdn(build_program(cfg, timings["m"], timings["num_sms"]), cfg.gdn_head_group)
    out = []
    for sm, j, opc, opn, _layer, _f, s, e in timings["instructions"]:
        ins = p.sm_lists[sm][j]
        if p.graph.ops[ins.op].name != opn:
            raise SystemExit(f"cost_fit: instruction ({sm}, {j}) is {p.graph.ops[ins.op].name} here, {opn} in the "
                             f"timing run: the schedule changed since; time the current program first")
        if opc != "GEMV":
            continue
        seg = p.graph.ops[ins.op].segments[p.weight_segment[ins.w0][1]]
        tiles = (ins.row_end - ins.row_start) // 16
        kb = (seg.k // 128) // max(1, seg.split) * (2 if seg.epilogue == "swiglu" else 1)
        per_round = max(1, P.MK_WARPS // ins.nsplit) if local_reduce(ins) else P.MK_WARPS
        out.append(((e - s) * 1e-9, p.item_bytes[sm][j], -(-tiles // per_round) * kb, seg.fp8,
                    sub_parts(ins.sub)[0], opn.split(".")[-1]))
    return out


def columns(x) -> dict:
    """The rows as arrays: measured s, bytes, serial K-blocks, fp8 flag, prologue name."""
    dur, nb, ser, fp8, prologue, _ = (np.array(c) for c in zip(*x))
    return {"dur": dur.astype(float), "nb": nb.astype(float), "ser": ser.astype(float), "fp8": fp8.astype(bool),
            "pro": prologue}


def model(c: dict, eff8, eff16, kblock, pro: dict) -> np.ndarray:
    """est_step_ms's GEMV time of every row (assembler/program.py ``Program._mk_time``) for these constants."""
    bw = P.HBM_BYTES_PER_S / 132
    extra = np.zeros(len(c["dur"]))
    for name, v in pro.items():
        extra[c["pro"] == name] = v
    return P.MK_FIXED_S + extra + np.maximum(c["nb"] / (bw * np.where(c["fp8"], eff8, eff16)), c["ser"] * kblock)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timings", default=str(ROOT / "bench" / "results" / "megakernel_timings.json.xz"))
    a = ap.parse_args(argv)
    path = Path(a.timings)
    unpack = {".xz": lzma.decompress, ".gz": gzip.decompress}.get(path.suffix, lambda b: b)
    text = unpack(path.read_bytes()).decode()
    t = json.loads(text)["timings"]
    x = rows(t)
    c = columns(x)
    dur = c["dur"]
    best = None
    for e8 in np.arange(0.60, 0.80, 0.01):
        for e16 in (0.90, 0.93, 0.96, 0.99):
            for kbl in np.arange(0.3e-6, 0.9e-6, 0.05e-6):
                for pr in np.arange(0, 6e-6, 0.5e-6):
                    for pn in np.arange(0, 3e-6, 0.5e-6):
                        est = model(c, e8, e16, kbl, {"reduce_rmsnorm": pr, "rmsnorm": pn})
                        err = float(np.mean(((est - dur) / dur) ** 2))
                        if best is None or err < best[0]:
                            best = (err, e8, e16, kbl, pr, pn)
    err, e8, e16, kbl, pr, pn = best
    print(f"fit over {len(x)} GEMV instructions: rms relative error {err ** .5:.3f}; eff fp8 {e8:.2f}, eff bf16 "
          f"{e16:.2f}, K-block {kbl * 1e6:.2f} us, prologue reduce_rmsnorm {pr * 1e6:.1f} us, rmsnorm {pn * 1e6:.1f} us")
    new = model(c, e8, e16, kbl, {"reduce_rmsnorm": pr, "rmsnorm": pn})
    cur = model(c, P.MK_GEMV_EFF, P.MK_GEMV_EFF_BF16, P.MK_KBLOCK_S, P.MK_PRO_S)
    cls = collections.defaultdict(list)
    for i, r in enumerate(x):
        cls[(r[5], r[4], round(r[1] / 1e3))].append(i)
    print("class (op, prologue, KB)          count  measured   fit  current (us, medians)")
    for k in sorted(cls, key=str):
        ii = cls[k]
        print(f"{str(k):34s} {len(ii):5d} {np.median(dur[ii]) * 1e6:9.1f} {np.median(new[ii]) * 1e6:6.1f} "
              f"{np.median(cur[ii]) * 1e6:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
