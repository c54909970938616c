"""Per-instruction timings of the megakernel (a ``QMK_MK_TIMING`` build): three ``globaltimer`` stamps per
instruction of the last step — fetched, waits met, done (after the bump) — turned into JSON for
``qwen-mk inspect --timings`` and the benchmark.

``python3 -m megakernel.timings --preset tiny [--steps N] [--context L] [--out FILE]`` (needs a GPU). The
inspect command should call :func:`run` with the same arguments and print or write what it returns.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from assembler.isa import Opcode


def collect(mk) -> dict:
    """Timings of the last step ``mk`` (a ``Megakernel(..., timing=True)``) ran, in ns from the first fetch.

    Returns {"columns": [...], "instructions": [[sm, index, opcode, op, layer, fetch, start, end], ...],
    "per_op": {op name: {"count", "run_ns", "wait_ns", "first_start", "last_end"}}, "per_op_kind": {opcode:kind:
    {"count", "run_ns", "wait_ns"}}, "per_sm": [{"busy_ns", "wait_ns"}], "step_ns"}. Raises ValueError when the
    megakernel was not built with timing."""
    if mk.d_timing is None:
        raise ValueError("timings.collect: the Megakernel was built without timing=True")
    mk.check()
    t = mk.d_timing.get().astype(np.int64)                     # [num_sms, max_len, 3]
    prog, g = mk.program, mk.program.graph
    valid = [(s, j) for s in range(prog.num_sms) for j in range(int(mk.lens[s]))]
    t0 = min(int(t[s, j, 0]) for s, j in valid) if valid else 0
    rows, kinds, per_op = [], {}, {}
    per_sm = [{"busy_ns": 0, "wait_ns": 0} for _ in range(prog.num_sms)]
    for s, j in valid:
        ins = prog.sm_lists[s][j]
        f, a, e = (int(v) - t0 for v in t[s, j])
        op = g.ops[ins.op]
        rows.append([s, j, Opcode(ins.opcode).name, op.name, ins.layer, f, a, e])
        po = per_op.setdefault(op.name, {"count": 0, "run_ns": 0, "wait_ns": 0, "first_start": a, "last_end": e})
        po["count"] += 1
        po["run_ns"] += e - a
        po["wait_ns"] += a - f
        po["first_start"], po["last_end"] = min(po["first_start"], a), max(po["last_end"], e)
        k = kinds.setdefault(f"{Opcode(ins.opcode).name}:{op.kind}", {"count": 0, "run_ns": 0, "wait_ns": 0})
        k["count"] += 1
        k["run_ns"] += e - a
        k["wait_ns"] += a - f
        per_sm[s]["busy_ns"] += e - a
        per_sm[s]["wait_ns"] += a - f
    return {"config": g.cfg.name, "m": g.m, "num_sms": prog.num_sms, "step_ns": max((r[7] for r in rows), default=0),
            "per_op_kind": kinds, "per_op": per_op, "per_sm": per_sm,
            "columns": ["sm", "index", "opcode", "op", "layer", "fetch_ns", "start_ns", "end_ns"], "instructions": rows}


def run(preset: str = "tiny", steps: int = 2, context: int = 0, num_sms: int | None = None, seed: int = 0) -> dict:
    """Build the synthetic model of ``preset`` on the GPU, run ``steps`` megakernel steps from position
    ``context`` with timing on, and return :func:`collect` of the last one."""
    from discrete.step import DecodeStep
    from discrete.weights_gpu import WeightsGPU
    from loader.config import preset as get_preset
    from loader.synthetic import SyntheticWeights
    from megakernel.runner import Megakernel
    cfg = get_preset(preset)
    w = WeightsGPU.from_synthetic(SyntheticWeights(cfg, seed))
    ds = DecodeStep(cfg, w, context + steps + 8, 1)
    ds.reset(context, [1])
    mk = Megakernel(ds, num_sms, timing=True)
    mk.run_steps(steps)
    return collect(mk)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--context", type=int, default=0)
    ap.add_argument("--out", default="-")
    a = ap.parse_args(argv)
    data = run(a.preset, a.steps, a.context)
    text = json.dumps(data)
    if a.out == "-":
        sys.stdout.write(text + "\n")
    else:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
