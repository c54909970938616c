"""Static checks of an assembled program, over two unrolled steps (step 2 sees step 1's leftovers).

1. Every wait names a real counter with the right per-step total; every bump is to a real counter.
2. No deadlock: one complete simulation suffices for every interleaving, because counters only grow and a
   satisfied wait stays satisfied (an enabled instruction stays enabled until it runs).
3. No overshoot: a counter's bumps of step k+1 are ordered after every bump and every wait of step k, so a
   waiter never sees a mix of two steps.
4. Every byte an instruction reads has a producer in the same step that is known complete when the
   instruction starts (vector clocks of per-SM prefixes implied by program order and waits).
5. No two instructions of a step write the same bytes; state (recurrent, conv, KV) has one owner per step.
   Exception, the fused split-K reduce (asm_regions): the output rows of a fused segment are a joint write of
   its split instructions, exactly one per split (each split's instructions cover the segment's rows once);
   by check 4 a reader of those rows must then know ALL of them complete, so a dropped wait still fails.
6. Across steps: a step-2 write is ordered after every step-1 read or write of the same bytes, and the
   embed of step 2 after step 1's argmax (its token).
7. History reads (asm_regions.history_reads: a GDN part's reads of conv-ring channels another part of its key
   head writes, the previous positions): step 2's reader is ordered after step 1's writer, and some instruction
   writes every such byte.
Raises :class:`VerifyError` naming the instruction (sm, index, op) and the buffer at the first failure.
"""
from __future__ import annotations

import bisect

import numpy as np

from assembler.asm_regions import history_reads, reduce_touches, regions
from assembler.isa import fused_reduce
from assembler.program import Program


class VerifyError(AssertionError):
    """The program is unsafe; the message names the instruction and the failed check."""


def _where(prog: Program, s: int, j: int, step: int | None = None) -> str:
    ins = prog.sm_lists[s][j]
    return f"sm {s} #{j} ({prog.graph.ops[ins.op].name}{'' if step is None else f', step {step}'})"


def verify(prog: Program, steps: int = 2) -> dict:
    """Run every check; return a summary dict (instructions, waits, counters checked). Raises VerifyError."""
    n, C = prog.num_sms, len(prog.counters)
    lists = prog.sm_lists
    total = np.zeros(C, np.int64)
    for s, lst in enumerate(lists):
        for j, ins in enumerate(lst):
            if not 0 <= ins.bump < C:
                raise VerifyError(f"{_where(prog, s, j)} bumps unknown counter {ins.bump}")
            total[ins.bump] += ins.bump_by
    for s, lst in enumerate(lists):
        for j, ins in enumerate(lst):
            for c, e, o in ins.waits:
                if not 0 <= c < C or total[c] == 0:
                    raise VerifyError(f"{_where(prog, s, j)} waits on counter {c}, which nothing bumps (unreachable)")
                if e != total[c] or o not in (0, -e):
                    raise VerifyError(f"{_where(prog, s, j)} waits on {prog.counters[c].name} for {e}/step{o:+d}; "
                                      f"it is bumped {total[c]} per step (offset must be 0 or −expected)")
    _simulate(prog, steps, total)
    vc = _clocks(prog, steps)
    _check_data(prog, vc)
    return {"instructions": sum(len(l) for l in lists), "waits": sum(i.nwaits for l in lists for i in l),
            "counters": C, "steps": steps}


def _simulate(prog: Program, steps: int, total: np.ndarray) -> None:
    """Greedy execution of ``steps`` steps; raises VerifyError on deadlock (naming the blocked heads)."""
    lists, n = prog.sm_lists, prog.num_sms
    ctr = np.zeros(len(total), np.int64)
    pos = [0] * n
    L = [len(l) for l in lists]
    progress = True
    while progress:
        progress = False
        for s in range(n):
            while pos[s] < steps * L[s]:
                k, j = divmod(pos[s], L[s])
                ins = lists[s][j]
                if any(ctr[c] < (k + 1) * e + o for c, e, o in ins.waits):
                    break
                ctr[ins.bump] += ins.bump_by
                pos[s] += 1
                progress = True
    stuck = [(s, pos[s] % L[s], pos[s] // L[s] + 1) for s in range(n) if pos[s] < steps * L[s]]
    if stuck:
        s, j, k = stuck[0]
        ins = lists[s][j]
        blk = [prog.counters[c].name for c, e, o in ins.waits if ctr[c] < k * e + o]
        raise VerifyError(f"deadlock: {len(stuck)} SMs blocked, first {_where(prog, s, j, k)} waiting on {blk}")


def _clocks(prog: Program, steps: int) -> dict:
    """Vector clock (per-SM unrolled prefix known complete at start) of every instruction instance; checks
    the no-overshoot ordering (3) on the way."""
    lists, n = prog.sm_lists, prog.num_sms
    L = np.array([len(l) for l in lists])
    order = prog._global_order()
    bumpers: dict[int, list] = {}
    for s, j in order:
        bumpers.setdefault(lists[s][j].bump, []).append((s, j))
    vc: dict = {}
    done: dict = {}

    def clock(c: int, k: int) -> np.ndarray:
        if (c, k) not in done:
            v = np.zeros(n, np.int64)
            for s, j in bumpers[c]:
                v = np.maximum(v, vc[(k, s, j)])
                v[s] = max(v[s], k * L[s] + j + 1)
            done[(c, k)] = v
        return done[(c, k)]

    for k in range(steps):
        for s, j in order:
            ins = lists[s][j]
            u = k * L[s] + j
            v = vc[(k, s, j - 1)].copy() if j else (vc[(k - 1, s, L[s] - 1)].copy() if k else np.zeros(n, np.int64))
            v[s] = max(v[s], u)
            for c, e, o in ins.waits:
                kk = k + o // e if e else k
                if kk >= 0:
                    v = np.maximum(v, clock(c, kk))
            vc[(k, s, j)] = v
    for (c, k), v in list(done.items()):
        if k + 1 < steps:
            for s, j in bumpers[c]:
                if np.any(vc[(k + 1, s, j)] < clock(c, k)):
                    raise VerifyError(f"overshoot: {_where(prog, s, j, k + 2)} can bump {prog.counters[c].name} "
                                      f"before step {k + 1}'s bumps of it are complete")
    return {"vc": vc, "L": L, "steps": steps}


def _joint(prog: Program, a, b, buf: int) -> bool:
    """Two fused-reduce GEMV instructions of one segment and different splits writing its output ``buf``."""
    return (fused_reduce(a) and fused_reduce(b) and a.op == b.op and a.w0 == b.w0 and a.buf1 == b.buf1 == buf
            and a.split != b.split)


def _check_fused_cover(prog: Program) -> None:
    """Each split of a fused segment covers its rows exactly once (a tile's arrival count is then S per step)."""
    rows: dict = {}
    for s, lst in enumerate(prog.sm_lists):
        for j, ins in enumerate(lst):
            if fused_reduce(ins):
                rows.setdefault((ins.op, ins.w0, ins.nsplit), {}).setdefault(ins.split, []).append(
                    (ins.row_start, ins.row_end, s, j))
    for (oi, w0, S), per in rows.items():
        n = prog.graph.ops[oi].segments[prog.weight_segment[w0][1]].n_out
        for sp in range(S):
            rr = sorted(per.get(sp, []))
            if not rr or rr[0][0] != 0 or rr[-1][1] != n or any(a[1] != b[0] for a, b in zip(rr, rr[1:])):
                raise VerifyError(f"fused reduce of {prog.graph.ops[oi].name} segment {prog.weight_segment[w0][1]}: "
                                  f"split {sp} does not cover rows [0, {n}) exactly once: {[r[:2] for r in rr]}")


def _check_data(prog: Program, clk: dict) -> None:
    lists, vc, L, steps = prog.sm_lists, clk["vc"], clk["L"], clk["steps"]
    acc = {}
    hist = {}
    writes: dict[int, list] = {}
    touches: dict[int, list] = {}
    for s, lst in enumerate(lists):
        for j, ins in enumerate(lst):
            r, w, st = regions(prog, ins)
            acc[(s, j)] = (r, w, st)
            hist[(s, j)] = history_reads(prog, ins)
            for b, lo, hi in w + st:
                writes.setdefault(b, []).append((lo, hi, s, j))
            for b, lo, hi in r + w + st + reduce_touches(prog, ins) + hist[(s, j)]:
                touches.setdefault(b, []).append((lo, hi, s, j))
    for b, lst in writes.items():
        lst.sort()
        active: list = []
        for lo1, hi1, s1, j1 in lst:
            active = [a for a in active if a[1] > lo1]
            for lo0, hi0, s0, j0 in active:
                if not _joint(prog, lists[s0][j0], lists[s1][j1], b):
                    raise VerifyError(f"{_where(prog, s0, j0)} and {_where(prog, s1, j1)} both write "
                                      f"{prog.buffers[b].name}[{lo1}:{min(hi0, hi1)}]")
            active.append((lo1, hi1, s1, j1))
    _check_fused_cover(prog)
    known = lambda k, s, j, ps, pj, pk: vc[(k, s, j)][ps] > pk * L[ps] + pj
    for (s, j), (reads, _, _) in acc.items():
        for b, lo, hi in reads:
            buf = prog.buffers[b]
            lst = writes.get(b, [])
            if not lst and buf.kind == "io":
                continue  # host input (tokens, MTP hidden)
            i = max(0, bisect.bisect_left(lst, (lo, -1, -1, -1)) - 1)
            cur = lo
            while i < len(lst) and lst[i][0] < hi:
                wlo, whi, ps, pj = lst[i]
                if whi > lo:
                    if wlo > cur:
                        break
                    for k in range(steps):
                        if not known(k, s, j, ps, pj, k):
                            raise VerifyError(f"{_where(prog, s, j, k + 1)} reads {buf.name}[{max(lo, wlo)}:"
                                              f"{min(hi, whi)}] before its producer {_where(prog, ps, pj)} is known done")
                    cur = max(cur, whi)
                i += 1
            if cur < hi:
                raise VerifyError(f"{_where(prog, s, j)} reads {buf.name}[{cur}:{hi}], which no instruction of the step writes")
    for (s, j), hr in hist.items():  # 7: the previous step's writer of the history is known done
        for b, lo, hi in hr:
            cover = 0
            for wlo, whi, ps, pj in writes.get(b, []):
                if wlo < hi and whi > lo:
                    cover += min(hi, whi) - max(lo, wlo)
                    for k in range(1, steps):
                        if not known(k, s, j, ps, pj, k - 1):
                            raise VerifyError(f"{_where(prog, s, j, k + 1)} reads the history "
                                              f"{prog.buffers[b].name}[{lo}:{hi}] before step {k}'s writer "
                                              f"{_where(prog, ps, pj)} is known done")
            if cover < hi - lo:
                raise VerifyError(f"{_where(prog, s, j)} reads the history {prog.buffers[b].name}[{lo}:{hi}], which "
                                  f"no instruction writes")
    am = [(s, j) for s, lst in enumerate(lists) for j, i in enumerate(lst) if prog.graph.ops[i.op].kind == "argmax"]
    for (s, j) in acc:
        if prog.graph.ops[lists[s][j].op].kind != "embed":
            continue
        for ps, pj in am:  # the token of step k+1 is the argmax of step k (persistent loop)
            for k in range(1, steps):
                if not known(k, s, j, ps, pj, k - 1):
                    raise VerifyError(f"{_where(prog, s, j, k + 1)} reads the token before step {k}'s argmax "
                                      f"{_where(prog, ps, pj)} is known done")
    for (s, j), (_, w, st) in acc.items():
        for b, lo, hi in w + st:
            for tlo, thi, ts, tj in touches[b]:
                if tlo < hi and thi > lo:
                    for k in range(1, steps):
                        if not known(k, s, j, ts, tj, k - 1):
                            raise VerifyError(f"{_where(prog, s, j, k + 1)} writes {prog.buffers[b].name}[{lo}:{hi}] "
                                              f"before step {k}'s access by {_where(prog, ts, tj)} is known done")
