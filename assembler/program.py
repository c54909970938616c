"""An assembled program: per-SM instruction lists packed as ``[num_sms, max_len, WORDS]`` int32, the counter
table, the buffer table and the weight table; text / JSON dumps and stats.

Stats: instructions and bytes per SM, byte imbalance ((max − mean) / mean), number of waits, and two estimated
critical paths, each instruction starting when its SM is free and its waits are met:
``est_critical_path_ms`` streams every instruction's bytes at the SM's share of the measured 4,468 GB/s
(``shared/spec/h200.md``: HBM read bandwidth; no latency, no counter cost); ``est_step_ms`` adds the megakernel's
measured per-instruction costs (``MK_*`` below, fitted to its H200 timing build at ba99afc): a fixed cost per
instruction, a GEMV instruction no faster than one warp's serial K-blocks, GEMV streaming at the rates measured, a
prologue cost, and the GDN / attention instructions' measured times. The streaming-only estimate cannot rank
schedules (it gave 3 % between two programs that measured 15 % apart); ``est_step_ms`` gives 11.26 ms for the
default 27B decode program (value heads split as the runner does) that measured 11.71 ms per token, and ranks
programs of the same stage structure as measured, not programs that differ in their stages (it misranks the
deferred reduce). Not modelled: the fused split-K tail, L2, other contexts (docs/megakernel.md, "Scheduling").
Both are estimates meant for comparing schedules.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from assembler.graph import Buffer, Graph
from assembler.numerics import attn_partitions
from assembler.isa import (ATTN_OPCODES, BUFFER_DTYPE, BUFFER_DTYPES, BUFFER_KINDS, COUNTER_DTYPE, FIELDS, WORDS,
                           Instruction, Opcode, fused_reduce, local_reduce, sub_parts)

STAGE_OPCODES = {"main": {Opcode.EMBED, Opcode.GEMV, Opcode.GDN_STEP, Opcode.ATTN_PREP, Opcode.ARGMAX},
                 "reduce": {Opcode.GEMV_REDUCE, Opcode.ATTN_REDUCE}, "scores": {Opcode.ATTN_SCORES},
                 "values": {Opcode.ATTN_VALUES}}
HBM_BYTES_PER_S = 4468e9  # measured, shared/spec/h200.md
# est_step_ms's instruction costs, measured on the H200 (megakernel timing build, 27B, context 1024,
# bench/results/megakernel_timings.json, docs/megakernel.md "Where the time goes"; fixed cost at 324d226 with acquire
# polls, no fence before the bump and the chunked RMSNorm; GDN and GEMV at ba99afc):
MK_FIXED_S = 1.67e-6   # any instruction: wait, barrier, bump (NOP program 0.835 ms over the longest SM's ~500;
                       # at ba99afc 0.546 ms over 321, 1.70 µs)
# GEMV: fitted to every GEMV instruction of the ba99afc timing build (the fit's script: commit 8c249e8; rms
# relative error 7 %; one rate 0.72 with a K-block of 0.75 µs made gate|up bound by one warp's serial K-blocks, so
# its 9-pair SMs ended with its 8-pair SMs — measured 65.2 vs 57.0 µs, this fit 67.5 vs 60.7)
MK_KBLOCK_S = 0.30e-6  # one warp's 16-row K-block, serially (the fit's lower bound: no class is bound by it)
MK_GEMV_EFF = 0.71     # fp8 GEMV instructions' streaming rate / the SM's share of HBM_BYTES_PER_S
MK_GEMV_EFF_BF16 = 0.99  # bf16 (the lm_head: 32.6 GB/s per SM measured, the DRAM's whole rate on 132 SMs)
MK_PRO_S = {"reduce_rmsnorm": 4.5e-6, "rmsnorm": 1.0e-6}  # the prologue: deferred-input rebuild + norm, or norm
MK_WARPS = 16          # GEMV tiles in flight per instruction (one per warp)
MK_OP_S = {Opcode.GDN_STEP: 14.8e-6,    # per value head (48 per layer, one SM each; median 13.2-14.3 µs, 17.4-19.0
                                        # in the 12 layers after an attention layer or the head: mean 14.8)
           Opcode.ATTN_PREP: 8.3e-6, Opcode.ATTN_SCORES: 12.9e-6, Opcode.ATTN_VALUES: 13.8e-6,
           Opcode.ATTN_REDUCE: 4.3e-6}  # per instruction at 1k context
ARENA_ALIGN = 256


@dataclass(frozen=True)
class Counter:
    """A monotonic completion counter: ``expected`` bumps per step from the instructions of (op, stage, group)."""
    name: str
    op: int
    stage: str
    group: int
    expected: int


@dataclass
class Program:
    """Per-SM instruction lists plus the tables they index. Built by ``assembler.scheduler.schedule``."""
    graph: Graph
    num_sms: int
    sm_lists: list[list[Instruction]]
    counters: list[Counter]
    weights: list[tuple[str, ...]]
    weight_segment: dict[int, tuple[int, int]]
    item_bytes: list[list[int]]
    buffers: list[Buffer] = field(default_factory=list)
    buffer_id: dict[str, int] = field(default_factory=dict)
    stage_of: dict = field(default_factory=dict)   # (sm, index) → assembly stage (global topological order)

    # ------------------------------------------------------------------ packed form
    def words(self) -> np.ndarray:
        """int32 [num_sms, max_len, WORDS]; lists shorter than max_len are padded with NOP (opcode 0)."""
        n = max((len(l) for l in self.sm_lists), default=0)
        out = np.zeros((self.num_sms, max(n, 1), WORDS), np.int32)
        for s, lst in enumerate(self.sm_lists):
            for j, ins in enumerate(lst):
                out[s, j] = ins.words()
        return out

    def buffer_table(self) -> np.ndarray:
        """BUFFER_DTYPE [n_buffers]: arena offsets (256-byte aligned) for act/partial/io; state buffers get
        offset −1 (they live in the session pool, placed by the host)."""
        t = np.zeros(len(self.buffers), BUFFER_DTYPE)
        off = 0
        for i, b in enumerate(self.buffers):
            rows = b.shape[0] if len(b.shape) > 1 else 1
            t[i] = (-1 if b.kind == "state" else off, b.nbytes, BUFFER_KINDS[b.kind], BUFFER_DTYPES[b.dtype],
                    rows, b.shape[-1])
            if b.kind != "state":
                off += -(-b.nbytes // ARENA_ALIGN) * ARENA_ALIGN
        return t

    def counter_table(self) -> np.ndarray:
        """COUNTER_DTYPE [n_counters]."""
        t = np.zeros(len(self.counters), COUNTER_DTYPE)
        for i, c in enumerate(self.counters):
            t[i] = (c.expected, c.expected, c.op, c.group)
        return t

    # ------------------------------------------------------------------ partition as data
    def slices(self, op_name: str, stage: str = "main") -> list[tuple[int, int, int, int, int]]:
        """The partition of an op: (sm, row_start, row_end, split_index, segment) per instruction, in SM order.

        ``stage`` is "main" (GEMV partials / direct outputs, GDN heads, attention prep per KV head), "reduce"
        (GEMV reduce, attention reduce per query-head run), "scores" or "values" (attention split-KV units
        h·P + p). Rows are local to the segment (weight w0) for GEMV ops and head / unit ranges otherwise (a
        LOCAL_REDUCE GEMV, which computes all splits of its rows, gives one slice per split). The
        discrete kernels launch one block per slice of this same list. Raises KeyError for an unknown op or stage."""
        oi = self.graph.ops.index(self.graph.op(op_name))
        want = STAGE_OPCODES[stage]
        out = []
        for s, lst in enumerate(self.sm_lists):
            for ins in lst:
                if ins.op != oi or ins.opcode not in want:
                    continue
                seg = self.weight_segment[ins.w0][1] if ins.w0 >= 0 and ins.w0 in self.weight_segment else 0
                # a local-reduce GEMV computes every split of its rows: one slice per split
                for sp in (range(ins.nsplit) if local_reduce(ins) else (ins.split,)):
                    out.append((s, ins.row_start, ins.row_end, sp, seg))
        return out

    # ------------------------------------------------------------------ stats
    def kv_bytes(self, ins: Instruction, context: int) -> int:
        """K / V bytes an attention instruction streams when the step starts at ``context`` cached keys (its
        split-KV units' share of every row's keys, at most the longest row's); 0 for other opcodes."""
        if ins.opcode not in (Opcode.ATTN_SCORES, Opcode.ATTN_VALUES) or context <= 0:
            return 0
        cfg = self.graph.cfg
        keys = -(-(context + self.graph.m) // attn_partitions(cfg))  # keys per partition, longest row
        return (ins.row_end - ins.row_start) * keys * cfg.head_dim * 2

    def stats(self, kv_context: int = 0) -> dict:
        """Instructions / bytes per SM, imbalance, waits, estimated critical path (see module docstring).
        ``kv_context`` > 0 adds the attention instructions' K / V bytes at that context to their item bytes (the
        graph's bytes are the weights'; a context is a property of the step, not of the program)."""
        item = [[b + self.kv_bytes(ins, kv_context) for b, ins in zip(bs, lst)]
                for bs, lst in zip(self.item_bytes, self.sm_lists)]
        nb = np.array([sum(b) for b in item], np.float64)
        ni = np.array([len(l) for l in self.sm_lists])
        mean = float(nb.mean()) if nb.size else 0.0
        per_sm_bw = HBM_BYTES_PER_S / self.num_sms
        order = self._global_order()
        stream = self._critical_path(order, lambda s, j: item[s][j] / per_sm_bw)
        step = self._critical_path(order, lambda s, j: self._mk_time(self.sm_lists[s][j], item[s][j], per_sm_bw))
        return {"num_sms": self.num_sms, "instructions": int(ni.sum()), "max_len": int(ni.max(initial=0)),
                "bytes_total": int(nb.sum()), "bytes_mean": mean, "bytes_max": float(nb.max(initial=0)),
                "bytes_min": float(nb.min()) if nb.size else 0.0,
                "imbalance": (float(nb.max()) - mean) / mean if mean else 0.0,
                "waits": int(sum(i.nwaits for l in self.sm_lists for i in l)), "counters": len(self.counters),
                "est_critical_path_ms": stream * 1e3, "est_step_ms": step * 1e3,
                "floor_ms": float(nb.sum()) / HBM_BYTES_PER_S * 1e3}

    def _critical_path(self, order: list[tuple[int, int]], dur) -> float:
        """Seconds until the last instruction ends: each starts when its SM is free and the counters it waits on
        (offset 0) have all their bumps; ``dur(sm, index)`` is an instruction's time."""
        sm_t = np.zeros(self.num_sms)
        done_t = np.zeros(len(self.counters))
        for s, j in order:
            ins = self.sm_lists[s][j]
            start = max([sm_t[s]] + [done_t[c] for c, _, o in ins.waits if o == 0])
            sm_t[s] = start + dur(s, j)
            if ins.bump >= 0:
                done_t[ins.bump] = max(done_t[ins.bump], sm_t[s])
        return float(sm_t.max(initial=0))

    def _mk_time(self, ins: Instruction, nbytes: float, per_sm_bw: float) -> float:
        """est_step_ms's time of one instruction (module docstring; MK_* constants)."""
        if ins.opcode == Opcode.NOP:
            return MK_FIXED_S
        if ins.opcode == Opcode.GEMV and ins.w0 in self.weight_segment:
            seg = self.graph.ops[ins.op].segments[self.weight_segment[ins.w0][1]]
            tiles = -(-(ins.row_end - ins.row_start) // 16)
            kb = (seg.k // 128) // max(1, seg.split) * (2 if seg.epilogue == "swiglu" else 1)
            # local: rounds of MK_WARPS // S tiles, a warp per (tile, split)
            per_round = max(1, MK_WARPS // ins.nsplit) if local_reduce(ins) else MK_WARPS
            serial = -(-tiles // per_round) * kb * MK_KBLOCK_S
            eff = MK_GEMV_EFF if seg.fp8 else MK_GEMV_EFF_BF16
            return max(nbytes / (per_sm_bw * eff), serial) + MK_PRO_S.get(sub_parts(ins.sub)[0], 0.0) + MK_FIXED_S
        base = MK_OP_S.get(ins.opcode, 0.0)
        if ins.opcode == Opcode.GDN_STEP:
            heads = (ins.row_end - ins.row_start) * self.graph.cfg.gdn_head_group
            base *= -(-heads // max(1, ins.nsplit))
        return max(nbytes / per_sm_bw, base) + MK_FIXED_S

    def _global_order(self) -> list[tuple[int, int]]:
        """(sm, index) of every instruction in stage order (the order the scheduler assembled them)."""
        keys = []
        for s, lst in enumerate(self.sm_lists):
            for j, ins in enumerate(lst):
                keys.append((self.stage_of[(s, j)], s, j))
        return [(s, j) for _, s, j in sorted(keys)]

    # ------------------------------------------------------------------ dumps
    def _ins_text(self, ins: Instruction) -> str:
        """One line: opcode, op, slice, buffers, bump and waits (``counter>=s*expected±offset``)."""
        op = self.graph.ops[ins.op]
        b = lambda i: self.buffers[i].name if i >= 0 else "-"
        name = Opcode(ins.opcode).name
        if ins.opcode in (Opcode.GEMV, Opcode.GEMV_REDUCE):
            pro, epi = sub_parts(ins.sub)
            partial = ins.opcode == Opcode.GEMV and ins.nsplit > 1 and not local_reduce(ins)
            out = b(ins.buf3 if partial else ins.buf1) + (f"+reduce>{b(ins.buf1)}" if fused_reduce(ins) else "")
            sp = f"splits 0-{ins.nsplit - 1}/{ins.nsplit} local" if local_reduce(ins) else f"split {ins.split}/{ins.nsplit}"
            body = (f"{op.name} seg{self.weight_segment[ins.w0][1]} rows[{ins.row_start}:{ins.row_end}] "
                    f"{sp} {pro}/{epi} in={b(ins.buf0)} out={out}")
        elif ins.opcode in (Opcode.ATTN_SCORES, Opcode.ATTN_VALUES):
            body = f"{op.name} units[{ins.row_start}:{ins.row_end}]"
        elif ins.opcode in (Opcode.GDN_STEP,) + ATTN_OPCODES:
            body = f"{op.name} heads[{ins.row_start}:{ins.row_end}]"
        else:
            body = op.name
        waits = " ".join(f"{self.counters[c].name}>=s*{e}{'%+d' % o if o else ''}" for c, e, o in ins.waits)
        bump = self.counters[ins.bump].name if ins.bump >= 0 else "-"
        return f"{name:11s} {body} | bump {bump}" + (f" | wait {waits}" if waits else "")

    def to_text(self) -> str:
        """Diffable dump: header, counters, then each SM's list (one instruction per line)."""
        g = self.graph
        L = [f"# program {g.cfg.name} kind={g.kind} m={g.m} sms={self.num_sms} ops={len(g.ops)}"]
        L += [f"counter {i} {c.name} expected={c.expected}" for i, c in enumerate(self.counters)]
        for s, lst in enumerate(self.sm_lists):
            L.append(f"sm {s}: {len(lst)} instructions, {sum(self.item_bytes[s])} bytes")
            L += [f"  {j:4d} {self._ins_text(ins)}" for j, ins in enumerate(lst)]
        return "\n".join(L) + "\n"

    def to_json(self) -> str:
        """JSON: tables, per-SM lists of field dicts, and stats."""
        return json.dumps({
            "config": self.graph.cfg.name, "kind": self.graph.kind, "m": self.graph.m, "num_sms": self.num_sms,
            "fields": FIELDS + ["waits"],
            "buffers": [{"name": b.name, "shape": list(b.shape), "dtype": b.dtype, "kind": b.kind} for b in self.buffers],
            "weights": [list(w) for w in self.weights],
            "counters": [c.__dict__ for c in self.counters],
            "sms": [[{**{f: getattr(i, f) for f in FIELDS}, "waits": [list(w) for w in i.waits]} for i in lst]
                    for lst in self.sm_lists],
            "stats": self.stats()}, indent=None)
