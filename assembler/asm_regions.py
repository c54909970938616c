"""What each instruction reads and writes, decoded from its words and the program's tables.

A region is (buffer id, lo, hi) over a per-buffer column space that covers all M rows at once:
activations [M, W] → columns [0, W); partials [S, M, N] → s·N + row; tokens / next [M] → [0, M);
state buffers → channels (conv), value heads (recurrent) or KV heads (caches); attention scratch: roped q →
columns [0, NQ·HD), scores / stats / partials → split-KV units h·P + p (whatever the memory layout). The scheduler derives waits
from these regions and the verifier checks them; both read the same decoding so the only thing the verifier
trusts is what an instruction's words say it touches.

Fused split-K reduce (isa.py FUSE_REDUCE): a tile's outputs are written by whichever of its S split
instructions arrives last, so EVERY split instruction of a fused segment lists the output rows (and the
residual rows the epilogue reads) as its own: a joint write. A consumer is then ordered after all S of them
(what the kernel guarantees: each bumps only after its own arrival, and the last arrival reduced the tile);
the verifier allows the S joint writers of a row, one per split, and nothing else. The reduce's reads of the
other splits' partials are ordered by the tile's arrival counter inside the op, not by a wait:
:func:`reduce_touches` lists them for the cross-step check only.

Split-K reads (graph.split_reads, set with mlp_groups): a split-K GEMV without prologue reads only its split's K
columns of its input (mk_gemv streams K-blocks [s·per, (s+1)·per) of weight and input alike); without the flag the
region is the whole row — a superset, so both are safe. The flag, not the words, decides, so that every program the
H200 has run keeps its words until one runs the narrow form (docs/megakernel.md, "Built, not yet measured").

GDN steps split over value heads (``megakernel.runner.split_gdn``: ``split`` / ``nsplit`` of a key head's value
heads): each part owns its value heads' state, conv channels, z and output columns; the key head's q / k conv
channels are written by the part holding its first value head and read by the others as the previous positions'
history (:func:`history_reads`, checked across steps).
"""
from __future__ import annotations

from assembler.isa import Instruction, Opcode, fused_reduce, local_reduce, sub_parts, sub_src_split
from assembler.numerics import K_BLOCK, attn_partitions, split_blocks


def _buf(prog, name: str) -> int:
    return prog.buffer_id[name]


def regions(prog, ins: Instruction) -> tuple[list, list, list]:
    """(reads, writes, state) region lists of ``ins`` in program ``prog``. State regions are read and
    written by the same instruction (recurrent state, conv state, KV cache). Raises ValueError for an
    instruction whose fields do not fit its op."""
    g, cfg = prog.graph, prog.graph.cfg
    op = g.ops[ins.op]
    r0, r1 = ins.row_start, ins.row_end
    W = lambda b: prog.buffers[b].shape[-1]
    if not 0 <= r0 < r1:
        raise ValueError(f"instruction {ins}: empty or negative row range [{r0}, {r1})")
    if ins.opcode == Opcode.EMBED:
        return [(ins.buf0, 0, g.m)], [(ins.buf1, 0, W(ins.buf1))], []
    if ins.opcode == Opcode.ARGMAX:
        return [(ins.buf0, 0, W(ins.buf0))], [(ins.buf1, 0, g.m)], []
    if ins.opcode in (Opcode.GEMV, Opcode.GEMV_REDUCE):
        _, seg_i = prog.weight_segment[ins.w0]
        seg = op.segments[seg_i]
        if r1 > seg.n_out:
            raise ValueError(f"{op.name}: rows [{r0}, {r1}) exceed segment {seg_i} with {seg.n_out} rows")
        reads, writes = [], []
        pro, epi = sub_parts(ins.sub)
        R = 2 * seg.n_out if epi == "swiglu" else seg.n_out         # partial columns: rows of the fused matrix
        prow = [(r0, r1), (seg.n_out + r0, seg.n_out + r1)] if epi == "swiglu" else [(r0, r1)]
        if ins.opcode == Opcode.GEMV and pro == "reduce_rmsnorm":
            # the input rebuilt from the deferred producer's S partials + residual; columns [aux0, aux1) stored
            K, S = W(ins.buf0), sub_src_split(ins.sub)
            reads += [(ins.buf4, s * K, (s + 1) * K) for s in range(S)] + [(ins.buf2, 0, W(ins.buf2))]
            if ins.aux1 > ins.aux0:
                writes.append((ins.buf0, ins.aux0, ins.aux1))
        elif g.split_reads and ins.opcode == Opcode.GEMV and pro == "none" and ins.nsplit > 1 \
                and not local_reduce(ins):
            # split s streams K-blocks [s·per, (s+1)·per) of weight and input alike (megakernel.cu mk_gemv,
            # gemv.cuh qmk_gemv_load_x): only its split's columns of x (graph.split_reads; without it the whole
            # row, a superset: safe, and every program the H200 ran so far keeps its words)
            if seg.k != W(ins.buf0):  # the kernel splits the weight's K (W.cols), the region the buffer's width
                raise ValueError(f"{op.name}: weight K {seg.k} != input width {W(ins.buf0)}")
            kb = split_blocks(seg.k, ins.nsplit, ins.split)
            reads.append((ins.buf0, kb.start * K_BLOCK, kb.stop * K_BLOCK))
        elif ins.opcode == Opcode.GEMV:
            srcs = [b for b in (ins.buf0, ins.buf4) if b >= 0]
            reads += [(b, 0, W(b)) for b in srcs]
        if ins.opcode == Opcode.GEMV:
            if ins.buf5 >= 0:  # the normalised input, written once per step by the op's first slice
                writes.append((ins.buf5, 0, W(ins.buf5)))
            if ins.nsplit > 1 and not local_reduce(ins):  # local: the partials never leave shared memory
                writes += [(ins.buf3, ins.split * R + a, ins.split * R + b) for a, b in prow]
        else:
            reads += [(ins.buf3, s * R + a, s * R + b) for s in range(ins.nsplit) for a, b in prow]
        if ins.opcode == Opcode.GEMV_REDUCE or ins.nsplit == 1 or fused_reduce(ins) or local_reduce(ins):
            writes.append((ins.buf1, r0, r1))  # fused: a joint write of the segment's S split instructions
            if epi == "residual":
                reads.append((ins.buf2, r0, r1))
        return reads, writes, []
    if ins.opcode == Opcode.GDN_STEP:
        dk, dv, kd = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.gdn_key_dim
        j0, j1, own = _gdn_part(cfg, ins)
        qk = [(h * dk, (h + 1) * dk) for h in range(r0, r1)] + [(kd + h * dk, kd + (h + 1) * dk) for h in range(r0, r1)]
        vch, vcols = (2 * kd + j0 * dv, 2 * kd + j1 * dv), (j0 * dv, j1 * dv)
        reads = [(ins.buf0, a, b) for a, b in qk + [vch]] + [(ins.buf1, *vcols), (ins.buf2, 0, W(ins.buf2))]
        state = [(ins.buf4, h * dk, (h + 1) * dk) for h in own] + [(ins.buf4, kd + h * dk, kd + (h + 1) * dk)
                                                                   for h in own]
        state += [(ins.buf4, *vch), (ins.buf5, j0, j1)]
        return reads, [(ins.buf3, *vcols)], state
    hd, grp, P = cfg.head_dim, cfg.gqa_group, attn_partitions(cfg)
    if ins.opcode == Opcode.ATTN_PREP:  # KV heads [r0, r1); the KV append is a write of those heads' cache
        reads = [(ins.buf0, r0 * grp * 2 * hd, r1 * grp * 2 * hd), (ins.buf1, r0 * hd, r1 * hd),
                 (ins.buf2, r0 * hd, r1 * hd)]
        return reads, [(ins.buf3, r0 * grp * hd, r1 * grp * hd), (ins.buf4, r0, r1), (ins.buf5, r0, r1)], []
    if ins.opcode in (Opcode.ATTN_SCORES, Opcode.ATTN_VALUES):  # units h·P + p of one head h
        h = r0 // P
        if (r1 - 1) // P != h:
            raise ValueError(f"{op.name}: split-KV units [{r0}, {r1}) span two KV heads")
        if ins.opcode == Opcode.ATTN_SCORES:
            reads = [(ins.buf0, h * grp * hd, (h + 1) * grp * hd), (ins.buf4, h, h + 1)]
            return reads, [(ins.buf1, r0, r1), (ins.buf2, r0, r1), (ins.buf3, r0, r1)], []
        reads = [(ins.buf0, r0, r1), (ins.buf1, h * P, (h + 1) * P), (ins.buf2, h * P, (h + 1) * P),
                 (ins.buf5, h, h + 1)]
        return reads, [(ins.buf3, r0, r1)], []
    if ins.opcode == Opcode.ATTN_REDUCE:  # query heads [r0, r1): partials of their KV heads, gate halves of q|gate
        h0, h1 = r0 // grp, (r1 - 1) // grp + 1
        reads = [(ins.buf0, r0 * 2 * hd, r1 * 2 * hd), (ins.buf1, h0 * P, h1 * P)]
        return reads, [(ins.buf3, r0 * hd, r1 * hd)], []
    raise ValueError(f"regions: opcode {ins.opcode} has no regions")


def _gdn_part(cfg, ins: Instruction) -> tuple[int, int, list]:
    """Value heads [j0, j1) of a GDN_STEP (part ``split`` of ``nsplit`` of key heads [row_start, row_end), as
    megakernel.cu mk_gdn picks them) and the key heads whose q / k conv-ring channels it writes: those whose first
    value head is in the part (gdn.cuh ``writes_qk``)."""
    grp, r0, r1 = cfg.gdn_head_group, ins.row_start, ins.row_end
    nv, ns = (r1 - r0) * grp, max(1, ins.nsplit)
    j0, j1 = r0 * grp + ins.split * nv // ns, r0 * grp + (ins.split + 1) * nv // ns
    return j0, j1, [h for h in range(r0, r1) if j0 <= h * grp < j1]


def history_reads(prog, ins: Instruction) -> list:
    """Conv-ring channels a GDN_STEP part reads but another part of its key head writes: the q / k channels of
    its key heads that it does not own (``_gdn_part``). It reads the ring slots of the previous positions, which
    that owner wrote in an EARLIER step; this step's owner writes the slot of the current position, which the
    reader does not touch. So the verifier checks these as cross-step reads (the previous step's writer known
    done), not as same-step reads. [] for any other instruction, and for whole-key-head GDN steps."""
    if ins.opcode != Opcode.GDN_STEP:
        return []
    cfg = prog.graph.cfg
    dk, kd = cfg.linear_key_head_dim, cfg.gdn_key_dim
    own = set(_gdn_part(cfg, ins)[2])
    return [(ins.buf4, off + h * dk, off + (h + 1) * dk) for off in (0, kd)
            for h in range(ins.row_start, ins.row_end) if h not in own]


def reduce_touches(prog, ins: Instruction) -> list:
    """Partial regions of every split for the rows of a fused-reduce GEMV (its tiles' last arrival reads them
    back, whichever instruction that is); [] for any other instruction."""
    if not fused_reduce(ins):
        return []
    seg = prog.graph.ops[ins.op].segments[prog.weight_segment[ins.w0][1]]
    swiglu = sub_parts(ins.sub)[1] == "swiglu"
    R = 2 * seg.n_out if swiglu else seg.n_out
    prow = [(ins.row_start, ins.row_end)] + ([(seg.n_out + ins.row_start, seg.n_out + ins.row_end)] if swiglu else [])
    return [(ins.buf3, s * R + a, s * R + b) for s in range(ins.nsplit) for a, b in prow]
