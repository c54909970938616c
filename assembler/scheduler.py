"""Cut every op of a graph into per-SM slices, order each SM's list, and derive counter waits.

Partition (DESIGN.md, "both paths share the work partition"): a GEMV op is a sequence of units (one 16-row
tile of one split of one segment, in group → segment range → split → tile order). By default (``balance``)
each GEMV stage is cut per op: its runs of one (group, segment, split) get SMs in proportion to their
bytes and each run is cut into equal contiguous chunks (±1 unit within a run), so every SM runs at most one
instruction of the op (every op is a barrier for its consumers, so the per-op maximum is what the step pays).
The water fill — contiguous runs so that each SM's cumulative bytes approach the mean (an SM that
carried a heavy GDN / attention slice gets fewer GEMV rows next) — is used with ``balance=False``, when an op has
more runs than SMs, and when the per-op cut would load its busiest SM more than ``BALANCE_SLACK`` × the water
fill's (few SMs). On the 27B with per-key-head in-projection groups, the water fill gave SMs 2-3
in-projection instructions that ran one after another (docs/megakernel.md, "Scheduling"). Split-K comes from
``assembler.numerics.split_k`` via the graph, never from the SM count. GDN steps (per key head), embed and argmax are whole items given to the
least-loaded SM. Attention is four stages (prep per KV head; scores and values per run of split-KV partitions
of one KV head; reduce per run of query heads), each stage's instructions on distinct SMs; the partition count
P = ``numerics.attn_partitions`` is fixed by the shape, so the cut changes only who computes which partition.

Split-K reduce: with ``fuse_reduce`` a split-K segment's GEMV instructions reduce their own tiles (the
last arriving warp of a tile's S splits, isa.py FUSE_REDUCE) and bump the op's ``out`` counter: no GEMV_REDUCE
stage, consumers wait on the GEMV instructions (all of them bumped ⇒ every tile's last arrival, and with it
the tile's reduce, happened). ``fuse_reduce=False``: partials bump ``part`` counters and GEMV_REDUCE
instructions wait on all of them. ``local_reduce``: the in-projections (split-K store
segments, ``local_candidate``) are cut into whole tiles with all their splits, and every instruction reduces its own
tiles in shared memory (isa.py LOCAL_REDUCE): no partial buffer, no reduce stage, consumers wait on the GEMV
instructions; kept only where whole tiles balance about as well as single splits (LOCAL_SLACK).

Order: stages in graph order (GEMV partials, then their reduce), so every wait points at an earlier stage:
no SM ever waits on work later in its own list, and one complete simulation proves every interleaving
deadlock-free (``assembler/verify.py``).

Counters: one per (op, stage, output group), bumped once per instruction; a wait needs ``step × expected``.
Waits are the minimal set that makes every producer of every byte an instruction reads known-complete
(vector clocks over the per-SM prefixes), so removing any one wait leaves a read unordered.
"""
from __future__ import annotations

import bisect

import numpy as np

from assembler.asm_regions import regions
from assembler.graph import Graph, Op, mtp_graph, verify_graph
from assembler.isa import ARGMAX_KEYS, MAX_WAITS, Instruction, Opcode, sub_word
from assembler.numerics import K_BLOCK, ROW_TILE, attn_partitions, split_blocks
from assembler.options import PROGRAM, ProgramOptions
from assembler.program import Counter, Program


def _gemv_units(op: Op, reduce: bool, local: bool = False) -> np.ndarray:
    """float64 [U, 6] units (group, seg, split, row0, row1, bytes) of a GEMV op's main or reduce stage.
    ``local``: the op's split-K segments reduce on their own instructions (LOCAL_REDUCE): a unit is a tile with
    all its splits (split 0, the whole row's bytes), and no reduce stage."""
    out = []
    for gi, grp in enumerate(op.groups):
        for seg_i, a, b in grp:
            seg = op.segments[seg_i]
            if reduce and (seg.split == 1 or seg.deferred or local):
                continue
            r = np.arange(a, b, ROW_TILE)
            nb = (ROW_TILE * seg.split * 4 * 2 if reduce else
                  ROW_TILE * seg.row_bytes if local else ROW_TILE * seg.row_bytes // seg.split)
            for s in ([0] if reduce or local else range(seg.split)):
                u = np.empty((r.size, 6), np.float64)
                u[:, 0], u[:, 1], u[:, 2], u[:, 3], u[:, 4], u[:, 5] = gi, seg_i, s, r, np.minimum(r + ROW_TILE, b), nb
                out.append(u)
    return np.concatenate(out) if out else np.zeros((0, 6))


def _apportion(costs: list[float], caps: list[int], n: int, ready: list[float] | None = None) -> list[int] | None:
    """SMs per run: one each, then one at a time to the run with the largest bytes per SM (capped at its unit
    count) — the minimax apportionment; with ``ready`` (bytes one SM streams before the run's input is complete)
    the run that would end last, ready + bytes per SM (greedy is optimal: only the last run's share can lower the
    maximum). None when there are more runs than SMs."""
    if len(costs) > n:
        return None
    r = ready or [0.0] * len(costs)
    cnt = [1] * len(costs)
    for _ in range(n - len(costs)):
        cand = [i for i in range(len(costs)) if cnt[i] < caps[i]]
        if not cand:
            break
        i = max(cand, key=lambda j: (r[j] + costs[j] / cnt[j], -j))
        cnt[i] += 1
    return cnt


def _runs(units: np.ndarray, sms: np.ndarray | None = None) -> list[tuple[int, int]]:
    """Maximal unit ranges [a, b) of one (group, segment, split) and contiguous rows — the pieces one instruction
    can cover — and, given the units' SMs, of one SM too (the instructions of an assignment)."""
    key = units[:, :3] if sms is None else np.concatenate([sms[:, None], units[:, :3]], 1)
    new = np.ones(len(units), bool)
    new[1:] = np.any(key[1:] != key[:-1], 1) | (units[1:, 3] != units[:-1, 4])
    starts = np.flatnonzero(new)
    return list(zip(starts.tolist(), np.append(starts[1:], len(units)).tolist()))


def _balanced(load: np.ndarray, units: np.ndarray, ready: np.ndarray | None = None) -> np.ndarray | None:
    """SM of each unit with every SM running at most one instruction of the op: the runs (``_runs``) get SMs in
    proportion to their bytes (``_apportion``), each run is cut into equal contiguous chunks (±1 unit), and the
    chunks go to the least-loaded SMs first. None when there are more runs than SMs (then ``_water_fill``).
    Why (the megakernel's timing build, docs/megakernel.md "Scheduling"): an op is a barrier for its consumers, so what counts is each
    op's slowest SM; the cumulative water fill cut runs at (segment, split) and head-group boundaries and gave
    SMs 2-3 instructions of the in-projection that ran one after another (each bound by its warps' streaming
    latency, not its bytes). ``ready`` (per unit, bytes; ``_Builder._ready``): when a run's input is complete
    relative to the others' — the SMs go to runs by ready + bytes per SM, and the runs ready first get the
    least-loaded SMs."""
    runs = _runs(units)
    r = None if ready is None else [float(ready[a]) for a, _ in runs]
    cnt = _apportion([float(units[a:b, 5].sum()) for a, b in runs], [b - a for a, b in runs], load.size, r)
    if cnt is None:
        return None
    order = np.argsort(load, kind="stable")
    sms = np.empty(len(units), np.int64)
    k = 0
    seq = range(len(runs)) if r is None else sorted(range(len(runs)), key=lambda i: (r[i], i))
    for (a, b), c in ((runs[i], cnt[i]) for i in seq):
        for j in range(c):
            sms[a + (b - a) * j // c: a + (b - a) * (j + 1) // c] = order[k]
            k += 1
    return sms


LOCAL_MAX_SPLIT = 16   # LOCAL_REDUCE needs a (tile, split) task per warp of a round: S ≤ the megakernel's 16 warps
LOCAL_SLACK = 1.02     # a local-reduce cut is kept unless its busiest SM carries more than this × the split cut's
                       # (whole tiles per SM instead of single splits; 27B in-projections on 132 SMs: 1.00)


def local_candidate(op: Op) -> bool:
    """Whether a GEMV op can reduce its split-K segments on their own instructions (LOCAL_REDUCE): every segment
    split-K (2..LOCAL_MAX_SPLIT) with a store epilogue, none deferred (the GDN / attention in-projections, the
    MTP fc)."""
    return (op.kind == "gemv" and bool(op.segments) and
            all(1 < s.split <= LOCAL_MAX_SPLIT and s.epilogue == "store" and not s.deferred for s in op.segments))


BALANCE_SLACK = 1.15  # the per-op cut is kept unless its busiest SM carries more than this × the water fill's
                      # (with a few SMs more than runs, whole runs land on single SMs: 27B on 13 SMs, 2.8 × the
                      # mean; on 132 SMs every 27B GEMV stage keeps the per-op cut)


def _max_share(sms: np.ndarray, units: np.ndarray, n: int) -> float:
    """Bytes of the op on its busiest SM under the assignment ``sms``."""
    return float(np.bincount(sms.astype(np.int64), weights=units[:, 5], minlength=n).max())


def _water_fill(load: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """SM of each unit: contiguous runs; SM i's share is proportional to its deficit below the new mean."""
    n, total = load.size, float(costs.sum())
    target = (load.sum() + total) / n
    d = np.maximum(target - load, 0.0)
    quota = d / d.sum() * total if d.sum() > 0 else np.full(n, total / n)
    mid = np.cumsum(costs) - costs / 2
    return np.minimum(np.searchsorted(np.cumsum(quota), mid, side="right"), n - 1)


class _Builder:
    def __init__(self, graph: Graph, num_sms: int, fuse_reduce: bool = True, balance: bool = True,
                 local_reduce: bool = False):
        self.g, self.n, self.fuse, self.balance, self.local = graph, num_sms, fuse_reduce, balance, local_reduce
        self.load = np.zeros(num_sms)
        self.lists: list[list[dict]] = [[] for _ in range(num_sms)]
        self.counters: list[Counter] = []
        self.ctr_id: dict = {}
        self.weights: list[tuple[str, ...]] = []
        self.wid: dict = {}
        self.weight_segment: dict[int, tuple[int, int]] = {}
        self.stage = 0
        self.group_span: dict[tuple[int, int], float] = {}  # (op, group) → bytes of its largest final instruction

    def counter(self, op_i: int, stage: str, group: int) -> int:
        key = (op_i, stage, group)
        if key not in self.ctr_id:
            self.ctr_id[key] = len(self.counters)
            self.counters.append(Counter(f"{self.g.ops[op_i].name}.{stage}{group}", op_i, stage, group, 0))
        return self.ctr_id[key]

    def weight(self, names: tuple[str, ...], seg: tuple[int, int] | None = None) -> int:
        if names not in self.wid:
            self.wid[names] = len(self.weights)
            self.weights.append(names)
        if seg is not None:
            self.weight_segment[self.wid[names]] = seg
        return self.wid[names]

    def emit(self, sm: int, nbytes: int, ctr: int, **f) -> None:
        self.lists[sm].append({"stage": self.stage, "ctr": ctr, "bytes": nbytes, "f": f})
        self.load[sm] += nbytes

    def whole(self) -> int:
        """The least-loaded SM (lowest index on ties) for an item that is not cut."""
        return int(np.argmin(self.load))

    # ------------------------------------------------------------------ ops
    def add_op(self, oi: int, op: Op) -> None:
        bid = self.buffer_id
        m = self.g.m
        L = op.layer
        if op.kind == "embed":
            self.stage += 1
            self.emit(self.whole(), op.bytes, self.counter(oi, "out", 0), opcode=Opcode.EMBED, layer=L,
                      m=m, row_start=0, row_end=1, buf0=bid[op.reads[0]], buf1=bid[op.writes[0]], op=oi)
        elif op.kind == "argmax":
            self.stage += 1
            self.emit(self.whole(), op.bytes, self.counter(oi, "out", 0), opcode=Opcode.ARGMAX, layer=L,
                      m=m, row_start=0, row_end=1, buf0=bid[op.reads[0]], buf1=bid[op.writes[0]], op=oi,
                      sub=ARGMAX_KEYS if self._keys_source(op.reads[0]) is not None else 0)
        elif op.kind == "gdn_step":
            self.stage += 1
            per = op.bytes // len(op.groups)
            for gi, (h0, h1) in enumerate(op.groups):
                sm = self.whole()
                f = dict(opcode=Opcode.GDN_STEP, buf0=bid[op.reads[0]], buf1=bid[op.reads[1]],
                         buf2=bid[op.reads[2]], buf3=bid[op.writes[0]], buf4=bid[op.state[0]],
                         buf5=bid[op.state[1]], w1=self.weight((op.norm[1],)))
                # one counter for all heads: every consumer (the out/o projection) reads the whole output
                self.emit(sm, per, self.counter(oi, "out", 0), layer=L, m=m, row_start=h0, row_end=h1, op=oi, **f)
        elif op.kind == "attn":
            self.add_attn(oi, op)
        elif op.kind == "gemv":
            self.add_gemv(oi, op)
        else:
            raise ValueError(f"scheduler: op {op.name} has unknown kind {op.kind!r}")

    def _keys_source(self, logits: str):
        """Index of the GEMV op (one store segment, split 1) writing the buffer an argmax reads: its instructions
        keep per-SM best keys for the ARGMAX (isa.py ARGMAX_KEYS); None when there is no such op."""
        for i, o in enumerate(self.g.ops):
            if o.kind == "gemv" and logits in o.writes:
                segs = [s for s in o.segments if s.out == logits]
                ok = len(segs) == 1 and segs[0].split == 1 and segs[0].epilogue == "store"
                return i if ok else None
        return None

    def spread(self, n: int) -> list[int]:
        """SMs for the ``n`` instructions of one stage: the least loaded first, distinct while n ≤ num_sms (so no
        two of them run in series on one SM)."""
        order = np.argsort(self.load, kind="stable")
        return [int(order[k % self.n]) for k in range(n)]

    def add_attn(self, oi: int, op: Op) -> None:
        """Attention as four stages, each spread over distinct SMs (docs/megakernel.md): ATTN_PREP per KV head,
        ATTN_SCORES and ATTN_VALUES per (KV head, run of partitions), ATTN_REDUCE per run of query heads of one KV
        head. Counters: prep / scores / values per KV head (a head's values wait on all of its scores: the
        merged softmax stats), one ``out`` counter for the reduce (the o projection reads all of o)."""
        bid, cfg, m, L = self.buffer_id, self.g.cfg, self.g.m, op.layer
        P, G = attn_partitions(cfg), cfg.gqa_group
        qg, k, v = (bid[b] for b in op.reads)
        q, sc, sm_m, sm_l, part = (bid[b] for b in op.scratch)
        kc, vc = (bid[b] for b in op.state)
        heads = [h for h0, h1 in op.groups for h in range(h0, h1)]
        per = max(1, self.n // len(heads))
        cut = lambda n, k: [(n * a // k, n * (a + 1) // k) for a in range(k)]  # noqa: E731
        stages = [
            ("prep", [(h, h, h + 1) for h in heads],
             dict(opcode=Opcode.ATTN_PREP, buf0=qg, buf1=k, buf2=v, buf3=q, buf4=kc, buf5=vc)),
            ("scores", [(h, h * P + a, h * P + b) for h in heads for a, b in cut(P, min(P, per))],
             dict(opcode=Opcode.ATTN_SCORES, buf0=q, buf1=sc, buf2=sm_m, buf3=sm_l, buf4=kc)),
            ("values", [(h, h * P + a, h * P + b) for h in heads for a, b in cut(P, min(P, per))],
             dict(opcode=Opcode.ATTN_VALUES, buf0=sc, buf1=sm_m, buf2=sm_l, buf3=part, buf5=vc)),
            ("out", [(0, h * G + a, h * G + b) for h in heads for a, b in cut(G, min(G, per))],
             dict(opcode=Opcode.ATTN_REDUCE, buf0=qg, buf1=part, buf3=bid[op.writes[0]])),
        ]
        share = {"prep": 2, "scores": 4, "values": 4, "out": 0}  # op bytes: KV append, K read back, V read back
        for stage, units, f in stages:
            self.stage += 1
            nb = op.bytes // share[stage] // len(units) if share[stage] else 0
            for sm, (gi, r0, r1) in zip(self.spread(len(units)), units):
                self.emit(sm, nb, self.counter(oi, stage, gi), layer=L, m=m, row_start=r0, row_end=r1, op=oi, **f)

    def add_gemv(self, oi: int, op: Op) -> None:
        bid, m = self.buffer_id, self.g.m
        if not op.norm:
            pro, src, src2, w1 = "none", bid[op.reads[0]], -1, -1
        elif isinstance(op.norm[0], tuple):
            (e, we), (h, wh) = op.norm
            pro, src, src2 = "mtp_concat", bid[e], bid[h]
            w1 = self.weight((we,))
            if self.weight((wh,)) != w1 + 1:
                raise ValueError(f"scheduler: {op.name}: the two MTP norm weights must be adjacent in the weight table")
        else:
            pro, src, src2, w1 = "rmsnorm", bid[op.norm[0]], -1, self.weight((op.norm[1],))
        src_split, src_resid = 0, -1
        if op.reduce_in:  # the norm input rebuilt from a deferred reduce (graph.defer_reduces): isa.py GEMV
            part, src_split, resid = op.reduce_in
            pro, src2, src_resid = "reduce_rmsnorm", bid[part], bid[resid]
        local, main_cut = False, None  # main_cut: the main stage's (units, SMs) when the local decision made it
        if self.local and local_candidate(op):
            lu, su = _gemv_units(op, False, True), _gemv_units(op, False)
            lsms, ssms = self._assign(lu), self._assign(su)
            local = _max_share(lsms, lu, self.n) <= LOCAL_SLACK * _max_share(ssms, su, self.n)
            main_cut = (lu, lsms) if local else (su, ssms)
        # the GEMV instructions of the head (the op an argmax reads) keep per-SM best keys (isa.py ARGMAX_KEYS)
        keyed = {s.out for s in op.segments if any(o.kind == "argmax" and s.out in o.reads for o in self.g.ops)
                 and self._keys_source(s.out) == oi}
        for reduce in ((False,) if self.fuse or local else (False, True)):
            if main_cut is not None and not reduce:
                units, sms = main_cut  # nothing was emitted since: the same cut
            else:
                units = _gemv_units(op, reduce, local)
                sms = self._assign(units, None if reduce else self._ready(oi, op, units)) if len(units) else None
            if not len(units):
                continue
            self.stage += 1
            runs = _runs(units, sms)
            K = self.g.buffers[op.norm[0]].shape[-1] if op.reduce_in else 0
            K8 = K // 8
            for ri, (a, b) in enumerate(runs):
                gi, si, s = (int(v) for v in units[a, :3])
                sm, r0, r1, nb = int(sms[a]), int(units[a, 3]), int(units[b - 1, 4]), int(round(units[a:b, 5].sum()))
                seg = op.segments[si]
                fused = self.fuse and seg.split > 1 and not seg.deferred and not local
                final = reduce or (seg.split == 1 and not seg.deferred) or fused or local
                main = not reduce
                f = dict(opcode=Opcode.GEMV_REDUCE if reduce else Opcode.GEMV, layer=op.layer,
                         sub=sub_word(pro if main else "none", seg.epilogue, fused, src_split if main else 0,
                                      local), m=m,
                         row_start=r0, row_end=r1,
                         split=s, nsplit=seg.split, buf0=src if main else -1, buf1=bid[seg.out],
                         buf2=bid[seg.residual] if seg.residual else (src_resid if main else -1),
                         buf3=bid[seg.partials] if seg.partials and not local else -1, buf4=src2 if main else -1,
                         w0=self.weight(seg.parts, (oi, si)), w1=w1 if main else -1, op=oi,
                         buf5=bid[op.norm_out] if op.norm_out and main and a == 0 else -1)
                if main and seg.out in keyed:
                    f["sub"] |= ARGMAX_KEYS  # the head: per-SM best keys for the ARGMAX
                if op.reduce_in and main:  # this slice's share of the rebuilt input: multiples of 8 columns,
                    last = ri == len(runs) - 1  # the last share to K whatever K is
                    f.update(aux0=8 * (K8 * ri // len(runs)), aux1=K if last else 8 * (K8 * (ri + 1) // len(runs)))
                self.emit(sm, nb, self.counter(oi, "out" if final else "part", gi), **f)
                if final:
                    self.group_span[(oi, gi)] = max(self.group_span.get((oi, gi), 0.0), float(nb))


    def _ready(self, oi: int, op: Op, units: np.ndarray) -> np.ndarray | None:
        """Per unit of a split-K GEMV without prologue (it reads only its split's K columns of its input,
        asm_regions): the bytes of the largest instruction of the producer's output groups that write those
        columns — when the split's input is complete, relative to the other splits' (gate|up grouped per down
        split, graph ``mlp_groups``: the groups holding the cut's longer chunks end last). None when the
        producer has one group (nothing ends early) or the op has a prologue."""
        if op.norm or op.reduce_in or len(op.reads) < 1:
            return None
        x = op.reads[0]
        pi = next((i for i in range(oi - 1, -1, -1) if x in self.g.ops[i].writes), None)
        if pi is None or self.g.ops[pi].kind != "gemv" or len(self.g.ops[pi].groups) < 2:
            return None
        prod = self.g.ops[pi]
        cols = [[(a, b) for si, a, b in grp if prod.segments[si].out == x] for grp in prod.groups]
        K = self.g.buffers[x].shape[-1]
        per: dict[tuple[int, int], float] = {}  # (segment, split) → ready: the same for all of its units
        for si, s in {(int(a), int(b)) for a, b in units[:, 1:3]}:
            seg = op.segments[si]
            if seg.split < 2:
                return None
            kb = split_blocks(K, seg.split, s)
            lo, hi = kb.start * K_BLOCK, kb.stop * K_BLOCK
            per[(si, s)] = max((self.group_span.get((pi, gi), 0.0) for gi, cs in enumerate(cols)
                                if any(a < hi and b > lo for a, b in cs)), default=0.0)
        ready = np.array([per[(int(a), int(b))] for a, b in units[:, 1:3]])
        return ready if np.ptp(ready) > 0 else None

    def _assign(self, units: np.ndarray, ready: np.ndarray | None = None) -> np.ndarray:
        """SM of each unit of one GEMV stage: the per-op cut (``_balanced``; ``ready`` as there) unless it would
        load its busiest SM more than BALANCE_SLACK × the water fill's (few SMs for the op's runs), else the
        water fill."""
        fill = _water_fill(self.load.copy(), units[:, 5])
        sms = _balanced(self.load, units, ready) if self.balance else None
        if sms is not None and _max_share(sms, units, self.n) > BALANCE_SLACK * _max_share(fill, units, self.n):
            sms = None  # too few SMs for the op's runs: whole runs would land on single SMs
        return fill if sms is None else sms


def schedule(graph: Graph, num_sms: int, fuse_reduce: bool | None = None, balance: bool = True,
             local_reduce: bool | None = None) -> Program:
    """Assemble ``graph`` for ``num_sms`` SMs (any count ≥ 1); ``fuse_reduce``: split-K reduce folded into the
    GEMV instructions (module docstring; False: separate GEMV_REDUCE instructions; None: ``PROGRAM``'s, the
    GPU's program, assembler/options.py); ``balance``: each GEMV stage
    cut so that every SM runs at most one instruction of it, balanced per op (``_balanced``; False: the
    cumulative water fill, measured slower on the 27B with per-key-head in-projection groups, which the graph
    no longer has); ``local_reduce``: split-K ops that ``local_candidate`` admits reduce on their own instructions
    (LOCAL_REDUCE: each instruction computes all splits of whole tiles, no GEMV_REDUCE stage) where that cut
    loads the busiest SM at most LOCAL_SLACK × the split cut's (None: ``PROGRAM``'s). Raises ValueError for
    num_sms < 1 or an instruction that would need more than MAX_WAITS waits."""
    if not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"schedule: num_sms must be an integer ≥ 1, got {num_sms!r}")
    fuse_reduce = PROGRAM.fuse_reduce if fuse_reduce is None else fuse_reduce
    local_reduce = PROGRAM.local_reduce if local_reduce is None else local_reduce
    bld = _Builder(graph, num_sms, fuse_reduce, balance, local_reduce)
    bld.buffer_id = {name: i for i, name in enumerate(graph.buffers)}
    for oi, op in enumerate(graph.ops):
        bld.add_op(oi, op)
    # counters: expected = number of bumpers per step
    exp = [0] * len(bld.counters)
    for lst in bld.lists:
        for it in lst:
            exp[it["ctr"]] += 1
    counters = [Counter(c.name, c.op, c.stage, c.group, e) for c, e in zip(bld.counters, exp)]
    prog = Program(graph, num_sms, [[] for _ in range(num_sms)], counters, bld.weights, bld.weight_segment,
                   [[it["bytes"] for it in lst] for lst in bld.lists], list(graph.buffers.values()), bld.buffer_id)
    draft = [[Instruction(**it["f"], bump=it["ctr"]) for it in lst] for lst in bld.lists]
    prog.stage_of = {(s, j): it["stage"] for s, lst in enumerate(bld.lists) for j, it in enumerate(lst)}
    prog.sm_lists = draft
    prog.sm_lists = _add_waits(prog, draft)
    return prog


def _add_waits(prog: Program, draft: list[list[Instruction]]) -> list[list[Instruction]]:
    """Minimal waits per instruction (see module docstring); the embed also waits on the previous step's
    argmax (offset −1), which orders every SSA buffer across steps."""
    n = prog.num_sms
    order = prog._global_order()
    writes: dict[int, list] = {}           # buffer → sorted [(lo, hi, sm, j)]
    vc: dict[tuple[int, int], np.ndarray] = {}
    bumpers: dict[int, list] = {}
    for s, j in order:
        bumpers.setdefault(draft[s][j].bump, []).append((s, j))
    ctr_stage = {c: max(prog.stage_of[p] for p in b) for c, b in bumpers.items()}
    # A GDN_STEP counter is known complete only through waits, never through program order: the runner's split_gdn
    # moves value-head parts of a step to other SMs (megakernel/runner.py), so a reader after the step on its SM
    # would outrun those parts (on one SM they stay on it). known: per instruction, bits of the GDN counters known
    # complete at its start (its SM's earlier waits and its own, each with what that counter's bumpers knew: they
    # all completed). Only graph.split_reads programs read a GDN output narrowly enough to need it (an out
    # projection's split of o written on its own SM); without it every such read already waited.
    gdn_bit = {c: 1 << k for k, c in enumerate(sorted(c for c, b in bumpers.items()
                                                      if draft[b[0][0]][b[0][1]].opcode == Opcode.GDN_STEP))}
    known: dict[tuple[int, int], int] = {}
    ctr_known: dict[int, int] = {}

    def known_of(c: int) -> int:
        if c not in ctr_known:
            k = gdn_bit.get(c, 0)
            for p in bumpers[c]:
                k |= known[p]
            ctr_known[c] = k
        return ctr_known[c]
    cc: dict[int, np.ndarray] = {}
    need_cache: dict[tuple, dict] = {}

    def clock_of(c: int) -> np.ndarray:
        if c not in cc:
            v = np.zeros(n, np.int64)
            for s, j in bumpers[c]:
                v = np.maximum(v, vc[(s, j)])
                v[s] = max(v[s], j + 1)
            cc[c] = v
        return cc[c]

    def need_of(b: int, lo: int, hi: int) -> dict:
        """counter → per-SM prefix length that must be complete to cover every writer of the region."""
        key = (b, lo, hi)
        if key not in need_cache:
            d: dict[int, np.ndarray] = {}
            lst = writes.get(b, [])
            k = max(0, bisect.bisect_left(lst, (lo, -1, -1, -1)) - 1)
            while k < len(lst) and lst[k][0] < hi:
                if lst[k][1] > lo:
                    ps, pj = lst[k][2:]
                    v = d.setdefault(draft[ps][pj].bump, np.zeros(n, np.int64))
                    v[ps] = max(v[ps], pj + 1)
                k += 1
            need_cache[key] = d
        return need_cache[key]

    out = [list(l) for l in draft]
    for s, j in order:
        ins = draft[s][j]
        reads, wr, _ = regions(prog, ins)
        need: dict[int, np.ndarray] = {}
        for r in reads:
            for c, v in need_of(*r).items():
                need[c] = np.maximum(need[c], v) if c in need else v
        base = vc[(s, j - 1)].copy() if j else np.zeros(n, np.int64)
        if j:
            base[s] = j
        cands = sorted((c for c in need if not np.all(base >= need[c])), key=lambda c: -ctr_stage[c])

        def clock(ws):
            v = base.copy()
            for c in ws:
                v = np.maximum(v, clock_of(c))
            return v

        chosen = []
        for c in cands:
            if not np.all(clock(chosen) >= need[c]):
                chosen.append(c)
        full = lambda ws: all(np.all(clock(ws) >= v) for v in need.values())
        for c in list(chosen):
            if len(chosen) > 1 and full([x for x in chosen if x != c]):
                chosen.remove(c)
        kn = known[(s, j - 1)] if j else 0
        for c in chosen:
            kn |= known_of(c)
        for c in sorted((c for c in need if n > 1 and c in gdn_bit and not kn & gdn_bit[c]),
                        key=lambda c: -ctr_stage[c]):
            chosen.append(c)  # covered by program order only: split_gdn would break that
            kn |= known_of(c)
        known[(s, j)] = kn
        assert full(chosen), f"scheduler: could not order the reads of {ins}"
        vc[(s, j)] = clock(chosen)
        waits = [(c, prog.counters[c].expected, 0) for c in chosen]
        for b, lo, hi in wr:
            bisect.insort(writes.setdefault(b, []), (lo, hi, s, j))
        if len(waits) > MAX_WAITS:
            raise ValueError(f"schedule: {prog.graph.ops[ins.op].name} needs {len(waits)} waits > MAX_WAITS={MAX_WAITS}")
        out[s][j] = Instruction(**{**ins.__dict__, "waits": tuple(waits), "nwaits": len(waits)})
    # step edge: the embed of step k+1 consumes the token the argmax of step k chose (in the persistent loop
    # it is that argmax's output), a true read-after-write across steps; it also frees every SSA buffer for
    # reuse. Program order implies it when the argmax sits on the embed's own SM.
    am = [c for c, k in enumerate(prog.counters) if prog.graph.ops[k.op].kind == "argmax"]
    for s, lst in enumerate(out):
        for j, ins in enumerate(lst):
            if ins.opcode != Opcode.EMBED:
                continue
            w = ins.waits + tuple((c, prog.counters[c].expected, -prog.counters[c].expected) for c in am
                                  if any(p[0] != s for p in bumpers[c]))
            if len(w) > MAX_WAITS:
                raise ValueError(f"schedule: embed needs {len(w)} waits > MAX_WAITS={MAX_WAITS}")
            lst[j] = Instruction(**{**ins.__dict__, "waits": w, "nwaits": len(w)})
    return out


def assemble(cfg, m: int, num_sms: int, options: ProgramOptions | None = None, layer_limit: int | None = None,
             kind: str = "decode") -> Program:
    """The ``m``-row program of ``cfg`` (a ModelConfig) for ``num_sms`` SMs in the form ``options`` gives (None:
    ``PROGRAM.for_rows(m)``, the program the GPU runs; concrete options are used as given): ``verify_graph``
    (``kind`` "decode", ``layer_limit``) or ``mtp_graph`` (``kind`` "mtp") with its ``defer_reduce`` /
    ``mlp_groups``, scheduled with its ``fuse_reduce`` / ``local_reduce``. ``gdn_split`` is applied after this by
    ``megakernel.runner.split_gdn`` (``options.gdn_parts(cfg)`` parts). Raises ValueError on a bad kind, m,
    layer_limit or SM count."""
    o = PROGRAM.for_rows(m) if options is None else options
    if kind == "decode":
        g = verify_graph(cfg, m, layer_limit, o.defer_reduce, o.mlp_groups)
    elif kind == "mtp":
        if layer_limit is not None:
            raise ValueError("assemble: layer_limit applies to decode programs only")
        g = mtp_graph(cfg, m, o.defer_reduce, o.mlp_groups)
    else:
        raise ValueError(f"assemble: kind={kind!r}; expected 'decode' or 'mtp'")
    return schedule(g, num_sms, o.fuse_reduce, local_reduce=o.local_reduce)
