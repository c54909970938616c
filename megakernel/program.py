"""The programs the megakernel runs, built on the host with the assembler (no GPU): the assembled program of
one step (:func:`assemble`, cached), the runner's GDN split over value heads (:func:`split_gdn`), and the word
array and per-SM lengths uploaded to the device (:func:`program_words`, :func:`stage_lengths`).

The runner's default choices (fused or separate reduce, deferred reduces, local reduces, GDN split) are applied
by ``megakernel.runner.build_program`` and ``megakernel.runner.Megakernel``; every function here takes them as
arguments.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from assembler.graph import verify_graph
from assembler.isa import FIELDS, WAITS_OFFSET, Opcode
from assembler.program import Counter, Program
from assembler.scheduler import schedule
from loader.config import ModelConfig


@functools.lru_cache(maxsize=16)
def assemble(cfg: ModelConfig, m: int, num_sms: int, layer_limit: int | None, fuse_reduce: bool,
             defer_reduce: bool, local_reduce: bool) -> Program:
    """The assembled program of ``verify_graph(cfg, m, layer_limit, defer_reduce)`` for ``num_sms`` SMs, scheduled
    with ``fuse_reduce`` / ``local_reduce`` (cached per process: the 27B schedule takes seconds; callers never
    modify it)."""
    return schedule(verify_graph(cfg, m, layer_limit, defer_reduce), num_sms, fuse_reduce,
                    local_reduce=local_reduce)


def _cover_waits(prog, ins) -> tuple:
    """Waits that order every read of a GDN_STEP instruction without help from its SM's program order: the
    final counter(s) of the in-projection (its one group, or the groups of its key heads) and of the op that
    wrote its input x (buf2). (The scheduler's own waits may rely on producers placed earlier on the same SM.)"""
    names = {c.name: i for i, c in enumerate(prog.counters)}
    g = prog.graph
    layer = ins.layer
    groups = len(g.op(f"L{layer}.in").groups)  # one group (graph default) or one per key head
    want = [names[f"L{layer}.in.out{h if groups > 1 else 0}"] for h in range(ins.row_start, ins.row_end)]
    want = list(dict.fromkeys(want))
    xname = prog.buffers[ins.buf2].name
    prod = next(oi for oi, op in enumerate(g.ops) if xname in op.writes)
    want += [i for i, c in enumerate(prog.counters) if c.op == prod and c.stage == "out"]
    want = list(dict.fromkeys(want))  # deferred reduces (graph.defer_reduces): x's producer is the in-projection
    if len(want) > 4:
        raise ValueError(f"split_gdn: a GDN part would need {len(want)} waits")
    return tuple((c, prog.counters[c].expected, 0) for c in want)


def split_gdn(prog, parts: int):
    """A copy of ``prog`` where every GDN_STEP instruction becomes ``parts`` instructions over disjoint value-head
    parts (its ``split`` / ``nsplit`` fields; the kernel's GDN_STEP honours them), the extra ones on the least
    loaded SMs, each inserted in stage order (so every wait still points at an earlier stage: deadlock-free);
    the op's counter then expects ``parts`` × as many bumps. The value heads of one key head are independent
    (discrete/kernels/gdn.cuh runs them as separate blocks), so results are unchanged; only the time on the
    critical path shrinks. A performance knob of the runner until the scheduler partitions GDN this way."""
    grp = prog.graph.cfg.gdn_head_group
    entries = [[(prog.stage_of[(s, j)], j, ins, prog.item_bytes[s][j]) for j, ins in enumerate(lst)]
               for s, lst in enumerate(prog.sm_lists)]
    load = np.array([sum(b) for b in prog.item_bytes], np.float64)
    factor: dict[int, int] = {}
    for s, lst in enumerate(prog.sm_lists):
        for j, ins in enumerate(lst):
            if ins.opcode != Opcode.GDN_STEP:
                continue
            k = min(parts, (ins.row_end - ins.row_start) * grp)
            if factor.setdefault(ins.bump, k) != k:
                raise ValueError(f"split_gdn: instructions of counter {ins.bump} cover different head counts")
            st, nb = prog.stage_of[(s, j)], prog.item_bytes[s][j] // k
            entries[s][j] = (st, j, dataclasses.replace(ins, split=0, nsplit=k), nb)
            busy = {t for t in range(prog.num_sms) if any(e[0] == st for e in entries[t])}
            cw = _cover_waits(prog, ins)
            for p in range(1, k):
                free = [t for t in np.argsort(load, kind="stable") if t not in busy]
                t = int(free[0] if free else np.argmin(load))
                busy.add(t)
                load[t] += nb
                entries[t].append((st, 1 << 30, dataclasses.replace(ins, split=p, nsplit=k, waits=cw, nwaits=len(cw)), nb))
    counters = [Counter(c.name, c.op, c.stage, c.group, c.expected * factor.get(i, 1))
                for i, c in enumerate(prog.counters)]
    lists, item_bytes, stage_of = [], [], {}
    for s, ent in enumerate(entries):
        ent = sorted(ent, key=lambda e: (e[0], e[1]))
        out = []
        for j, (st, _, ins, nb) in enumerate(ent):
            w = tuple((c, e * factor.get(c, 1), o * factor.get(c, 1)) for c, e, o in ins.waits)
            out.append(dataclasses.replace(ins, waits=w))
            stage_of[(s, j)] = st
        lists.append(out)
        item_bytes.append([e[3] for e in ent])
    new = Program(prog.graph, prog.num_sms, lists, counters, prog.weights, prog.weight_segment, item_bytes,
                  prog.buffers, prog.buffer_id)
    new.stage_of = stage_of
    return new


def program_words(prog, nop: bool = False, drop_wait: tuple[int, int, int] | None = None) -> np.ndarray:
    """int32 [num_sms, max_len, WORDS]. ``nop``: opcodes zeroed (waits, bumps kept). ``drop_wait`` = (sm, index,
    k): remove wait k of that instruction (tests: a missing dependency must show)."""
    w = prog.words().copy()
    if nop:
        w[:, :, 0] = int(Opcode.NOP)
    if drop_wait is not None:
        s, j, k = drop_wait
        nw = FIELDS.index("nwaits")
        n = int(w[s, j, nw])
        if not 0 <= k < n:
            raise ValueError(f"program_words: instruction ({s}, {j}) has {n} waits; cannot drop wait {k}")
        trip = w[s, j, WAITS_OFFSET:WAITS_OFFSET + 3 * n].reshape(n, 3)
        trip = np.delete(trip, k, axis=0)
        w[s, j, WAITS_OFFSET:WAITS_OFFSET + 3 * n] = 0
        w[s, j, WAITS_OFFSET:WAITS_OFFSET + 3 * (n - 1)] = trip.reshape(-1)
        w[s, j, nw] = n - 1
    return w


def stage_lengths(prog, stop_after: int | None) -> np.ndarray:
    """Instructions per SM to run: all, or those of stages ≤ stop_after (a prefix of each SM's list)."""
    out = np.zeros(prog.num_sms, np.int32)
    for s, lst in enumerate(prog.sm_lists):
        out[s] = len(lst) if stop_after is None else sum(1 for j in range(len(lst)) if prog.stage_of[(s, j)] <= stop_after)
    return out
