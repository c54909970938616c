"""Reading what the megakernel did, for tests and error reports: the error codes the kernel records before it
traps (:data:`ERRORS`, named by ``megakernel/include/mk_params.h``), the counters short of a step's target (a
deadlock's first suspects), and the first bit difference between two decode steps' device memory
(:func:`compare_steps`: megakernel ≡ discrete is a bit-identity, STYLE.md habit 4).
"""
from __future__ import annotations

import numpy as np

from megakernel.build import COUNTER_SEED

ERRORS = {1: "unknown opcode", 2: "unsupported GEMV prologue (MTP concat, or an unknown one)",
          3: "bad row range",
          4: "fused split-K reduce in the program, but the module was built without it",
          5: "a GEMV or GDN step of M != 1 rows, but the module was built for M = 1",
          6: "a local-reduce GEMV with more splits than the block has warps, or not a store epilogue"}


def raise_on_error(mirror: np.ndarray) -> None:
    """Raise RuntimeError naming the error the kernel recorded in ``mirror`` (uint32 [4] host copy: word 2 the
    code of :data:`ERRORS`, word 3 its detail); nothing when word 2 is 0."""
    if mirror[2]:
        raise RuntimeError(f"megakernel error {mirror[2]} ({ERRORS.get(int(mirror[2]), '?')}), detail {mirror[3]}")


def short_counters(counters, values: np.ndarray, step: int, show: int = 8) -> str:
    """The counters (``Program.counters``) whose values (uint32 [n] host copy, seeded with COUNTER_SEED) are below
    their target ``step`` × expected, as one line naming the first ``show`` of them."""
    low = [(c.name, int((int(v) - COUNTER_SEED) % 2**32), step * c.expected)
           for c, v in zip(counters, values) if (int(v) - COUNTER_SEED) % 2**32 < step * c.expected]
    return f"{len(low)} counters short of step {step}: " + ", ".join(f"{n}={v}/{t}" for n, v, t in low[:show])


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def compare_steps(a, b, program, m: int):
    """First bit difference between two DecodeSteps over every buffer ``program`` writes, in graph order:
    activations [m rows] (bf16 / int32 bits), argmax ids, GDN recurrent state (fp32 bits) and conv rings, then
    the KV page pools. Returns None, or (buffer, layer or None, flat index, value a, value b, count)."""
    sa, sb = a.state, b.state
    sa.stream.synchronize()
    sb.stream.synchronize()
    for name, buf in program.graph.buffers.items():
        if buf.kind == "act":
            x, y = sa.buf[name][:m].get(), sb.buf[name][:m].get()
        elif name == "next":
            x, y = a.next_ids[:m].get(), b.next_ids[:m].get()
        elif name == "hidden.out":
            x, y = sa.buf["hn"][:m].get(), sb.buf["hn"][:m].get()
        elif buf.kind == "state" and name.startswith(("rec.", "conv.")):
            i = _layer_of(name)
            x, y = ((sa.rec[i].get().view(np.uint32), sb.rec[i].get().view(np.uint32)) if name.startswith("rec.")
                    else (sa.ring[i].get(), sb.ring[i].get()))
        else:
            continue
        d = np.flatnonzero(x.reshape(-1) != y.reshape(-1))
        if d.size:
            return name, _layer_of(name), int(d[0]), int(x.reshape(-1)[d[0]]), int(y.reshape(-1)[d[0]]), int(d.size)
    pa, pb = sa.kv.pool.get(), sb.kv.pool.get()
    d = np.flatnonzero(pa.reshape(-1) != pb.reshape(-1))
    if d.size:
        idx = np.unravel_index(d[0], pa.shape)  # [page, attn layer, k|v, kv head, slot, dim]
        return "kv_pool", int(program.graph.cfg.full_layers[idx[1]]), int(d[0]), int(pa.reshape(-1)[d[0]]), \
            int(pb.reshape(-1)[d[0]]), int(d.size)
    return None
