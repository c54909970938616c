"""The instruction set: one source of truth for Python (assembler, CPU VM) and CUDA (megakernel).

An instruction is ``WORDS`` int32 words; the field order of :class:`Instruction` is the word layout (the wait
list occupies the last ``3 × MAX_WAITS`` words as counter / expected-per-step / offset triples). A wait is
satisfied when ``counter ≥ step × expected + offset`` (step counts from 1; counters are monotonic and never
reset, DESIGN.md). Opcode 0 is NOP. ``python3 -m assembler.isa --write`` regenerates
``megakernel/include/isa.h`` (opcodes, field offsets, word count, table layouts); a test fails when the
committed header is stale.

Opcodes (what each fuses; its waits come from the scheduler, its bump is its own completion counter):
  EMBED        rows of the embedding table for ``tokens`` → x.0 (buf0 = tokens, buf1 = out). Waits on the
               previous step's ARGMAX (offset −1): the step-end edge that orders SSA buffers across steps.
  GEMV         split ``split`` of ``nsplit`` for output rows [row_start, row_end) of weight w0; prologue per
               ``sub``: none (input buf0), RMSNorm of buf0 with weight w1, or the MTP concat
               [norm(buf0; w1), norm(buf4; w1+1)]; nsplit == 1: epilogue store / residual (buf2) / swiglu
               (gate row r, up row F + r of the fused w0) into buf1; nsplit > 1: fp32 partials into buf3.
               buf5 ≥ 0 (first slice of the head only): also store the normalised input there.
               Prologue reduce_rmsnorm (graph ``defer_reduce``): the input buf0 is the output of a split-K
               residual GEMV whose reduce was deferred to its consumers: x = fixed-order reduce of its partials
               buf4 [S, M, K] (S = sub bits 12-19) + residual buf2, the same epilogue as GEMV_REDUCE, rebuilt
               whole by every instruction of the op; each stores columns [aux0, aux1) of x into buf0 (the op's
               instructions cover [0, K) between them), then normalises x with weight w1.
               sub & FUSE_REDUCE (nsplit > 1 only): after storing a tile's partial the warp counts itself in on
               the tile's arrival counter; the last of the tile's S arrivals (swiglu: 2S, gate and up tiles)
               reduces the tile in fixed split order + epilogue into buf1 (gemv.cuh qmk_gemv_finish_tile) and
               resets the counter. The arrival counters are uint32 [rows(w0) / 16] right after the partials
               [S, M, rows(w0)] fp32 in buf3's allocation (runner-owned, zero once at allocation). No
               GEMV_REDUCE exists for such a segment; its consumers wait on the GEMV instructions' counter.
               sub & LOCAL_REDUCE (nsplit > 1; ``split`` is 0): the instruction computes ALL nsplit splits of its
               rows itself (one warp per (tile, split) task, the same per-split K ranges), keeps the fp32
               partials in shared memory and reduces them in fixed split order + epilogue into buf1 — the
               numbers of GEMV partials + GEMV_REDUCE, without the partial buffer or a reduce stage (buf3 = −1).
  GEMV_REDUCE  fixed-order reduce of the partials buf3 for rows [row_start, row_end) + epilogue into buf1.
  GDN_STEP     key heads [row_start, row_end) of layer ``layer``: in_proj_a/b (RMSNorm prologue of buf2), conv
               step, l2norm, gates, delta rule on the recurrent state, gated norm → buf3 (= o).
               buf0 = qkv, buf1 = z, buf4 = conv state, buf5 = recurrent state.
  ATTN_PREP    KV heads [row_start, row_end): q/k norm, partial RoPE of the group's query heads and the KV head,
               KV append at the rows' positions. buf0 = q|gate, buf1 = k, buf2 = v → buf3 = roped q scratch,
               buf4 = K cache, buf5 = V cache (the layer's base in the page pool).
  ATTN_SCORES  split-KV units [row_start, row_end) (unit u = KV head u // P, partition u % P, P =
               numerics.attn_partitions; one instruction never spans heads): bf16 scores of the head's query
               group over the partition's keys and the per-partition softmax stats. buf0 = roped q, buf4 = K
               cache → buf1 = scores, buf2 = stats max, buf3 = stats sum.
  ATTN_VALUES  units [row_start, row_end): the head's stats merged over all P partitions in partition order,
               p_j = bf16(exp(s_j − M) / L), fp32 partial o_p = Σ p_j v_j. buf0 = scores, buf1 = stats max,
               buf2 = stats sum, buf5 = V cache → buf3 = partials [M, NQ, P, HD].
  ATTN_REDUCE  query heads [row_start, row_end): partials summed in partition order, bf16, × bf16(sigmoid(gate)).
               buf0 = q|gate, buf1 = partials → buf3 (= o).
  ARGMAX       greedy token per row of the logits buf0 → buf1 (lowest id on ties). sub & ARGMAX_KEYS (set on
               the ARGMAX and on the GEMV instructions of the op whose output it reads): in a 1-row step each
               such GEMV also keeps the best key (logit desc, id asc; padding ids excluded) of the logits it
               wrote in a per-SM slot tagged with the step, and the ARGMAX takes the best of this step's slots
               instead of scanning the logits — the same id (one key per id), a kernel-side shortcut that the
               regions, the verifier and the CPU VM need not model (the ARGMAX still reads the whole logits).
"""
from __future__ import annotations

import dataclasses
import enum
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_WAITS = 4
WORDS = 34
HEADER = Path(__file__).resolve().parents[1] / "megakernel" / "include" / "isa.h"


class Opcode(enum.IntEnum):
    NOP = 0
    EMBED = 1
    GEMV = 2
    GEMV_REDUCE = 3
    GDN_STEP = 4
    ATTN_PREP = 5
    ARGMAX = 6
    ATTN_SCORES = 7
    ATTN_VALUES = 8
    ATTN_REDUCE = 9


ATTN_OPCODES = (Opcode.ATTN_PREP, Opcode.ATTN_SCORES, Opcode.ATTN_VALUES, Opcode.ATTN_REDUCE)


class Sub(enum.IntFlag):
    """Bits of the ``sub`` word: prologue (low 4 bits) and epilogue (next 4 bits) of GEMV / GEMV_REDUCE."""
    PRO_NONE = 0
    PRO_RMSNORM = 1
    PRO_MTP_CONCAT = 2
    PRO_REDUCE_RMSNORM = 3
    EPI_STORE = 0 << 4
    EPI_RESIDUAL = 1 << 4
    EPI_SWIGLU = 2 << 4
    FUSE_REDUCE = 1 << 8  # GEMV with nsplit > 1: the last arriving warp of a tile reduces it (see GEMV above)
    LOCAL_REDUCE = 1 << 9  # GEMV with nsplit > 1: all splits of the rows on this instruction, reduced in shared memory
    ARGMAX_KEYS = 1 << 10  # the head's GEMV / the ARGMAX: per-SM best logit keys (1-row steps; ARGMAX below)
    # bits 12-19: the producer's split count S of a reduce_rmsnorm prologue (SRC_SPLIT_SHIFT)


FUSE_REDUCE = int(Sub.FUSE_REDUCE)
LOCAL_REDUCE = int(Sub.LOCAL_REDUCE)
ARGMAX_KEYS = int(Sub.ARGMAX_KEYS)
PROLOGUES = {"none": 0, "rmsnorm": 1, "mtp_concat": 2, "reduce_rmsnorm": 3}
EPILOGUES = {"store": 0, "residual": 1, "swiglu": 2}
SRC_SPLIT_SHIFT = 12


def sub_word(prologue: str, epilogue: str, fuse_reduce: bool = False, src_split: int = 0,
             local_reduce: bool = False) -> int:
    """Pack prologue/epilogue names, the FUSE_REDUCE / LOCAL_REDUCE flags and (reduce_rmsnorm) the producer's
    split count into the ``sub`` word. Raises KeyError naming an unknown form, ValueError for a split count outside
    0..255 or both reduce flags at once."""
    if not 0 <= src_split <= 255:
        raise ValueError(f"sub_word: src_split={src_split}; expected 0..255")
    if fuse_reduce and local_reduce:
        raise ValueError("sub_word: fuse_reduce and local_reduce exclude each other")
    return (PROLOGUES[prologue] | (EPILOGUES[epilogue] << 4) | (FUSE_REDUCE if fuse_reduce else 0)
            | (LOCAL_REDUCE if local_reduce else 0) | (src_split << SRC_SPLIT_SHIFT))


def sub_src_split(sub: int) -> int:
    """The producer's split count S packed by :func:`sub_word` (0 when none)."""
    return (sub >> SRC_SPLIT_SHIFT) & 255


def fused_reduce(ins: "Instruction") -> bool:
    """True for a split-K GEMV that reduces its tiles itself (last arrival; no GEMV_REDUCE for its segment)."""
    return ins.opcode == Opcode.GEMV and ins.nsplit > 1 and bool(ins.sub & FUSE_REDUCE)


def local_reduce(ins: "Instruction") -> bool:
    """True for a split-K GEMV that computes every split of its rows and reduces them itself (shared memory)."""
    return ins.opcode == Opcode.GEMV and ins.nsplit > 1 and bool(ins.sub & LOCAL_REDUCE)


def sub_parts(sub: int) -> tuple[str, str]:
    """Inverse of :func:`sub_word` (flag bits above the epilogue, e.g. FUSE_REDUCE, ARGMAX_KEYS, are ignored)."""
    pro = {v: k for k, v in PROLOGUES.items()}[sub & 15]
    epi = {v: k for k, v in EPILOGUES.items()}[(sub >> 4) & 15]
    return pro, epi


@dataclass(frozen=True)
class Instruction:
    """One instruction; the field order is the word order. Unused buffer/weight fields are −1.

    layer: decoder layer (num_hidden_layers for the MTP layer, −1 for none); m: activation rows (1..8);
    row_start/row_end: output rows (GEMV family, local to weight w0), key heads (GDN_STEP), KV heads
    (ATTN_PREP), split-KV units head·P + partition (ATTN_SCORES / ATTN_VALUES) or query heads (ATTN_REDUCE);
    split/nsplit: split-K index and factor; buf0..buf5: buffer-table ids; w0, w1: weight-table ids;
    bump: counter id this instruction adds ``bump_by`` to when done; aux0/aux1: the columns [aux0, aux1) of its
    input a reduce_rmsnorm GEMV stores; waits: (counter, expected, offset)."""
    opcode: int
    layer: int = -1
    sub: int = 0
    m: int = 1
    row_start: int = 0
    row_end: int = 0
    split: int = 0
    nsplit: int = 1
    buf0: int = -1
    buf1: int = -1
    buf2: int = -1
    buf3: int = -1
    buf4: int = -1
    buf5: int = -1
    w0: int = -1
    w1: int = -1
    op: int = -1
    bump: int = -1
    bump_by: int = 1
    nwaits: int = 0
    aux0: int = 0
    aux1: int = 0
    waits: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if len(self.waits) > MAX_WAITS:
            raise ValueError(f"Instruction: {len(self.waits)} waits exceed MAX_WAITS={MAX_WAITS}")
        if self.nwaits != len(self.waits):
            object.__setattr__(self, "nwaits", len(self.waits))
        Opcode(self.opcode)

    def words(self) -> np.ndarray:
        """The int32 words of this instruction (length ``WORDS``)."""
        w = np.zeros(WORDS, np.int32)
        head = [getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "waits"]
        w[:len(head)] = head
        for j, (c, e, o) in enumerate(self.waits):
            w[WAITS_OFFSET + 3 * j:WAITS_OFFSET + 3 * j + 3] = (c, e, o)
        return w

    @classmethod
    def from_words(cls, w: np.ndarray) -> "Instruction":
        """Decode ``WORDS`` int32 words. Raises ValueError for a wrong length or an unknown opcode."""
        w = np.asarray(w)
        if w.shape != (WORDS,):
            raise ValueError(f"Instruction.from_words: expected {WORDS} words, got shape {w.shape}")
        names = [f.name for f in dataclasses.fields(cls) if f.name != "waits"]
        kw = {n: int(w[i]) for i, n in enumerate(names)}
        kw["waits"] = tuple(tuple(int(v) for v in w[WAITS_OFFSET + 3 * j:WAITS_OFFSET + 3 * j + 3])
                            for j in range(kw["nwaits"]))
        return cls(**kw)


FIELDS = [f.name for f in dataclasses.fields(Instruction) if f.name != "waits"]
WAITS_OFFSET = WORDS - 3 * MAX_WAITS
assert len(FIELDS) <= WAITS_OFFSET, "instruction header overlaps the wait list"

# Tables the megakernel reads besides the instruction words.
BUFFER_DTYPE = np.dtype([("offset", "<i8"), ("nbytes", "<i8"), ("kind", "<i4"), ("dtype", "<i4"),
                         ("rows", "<i4"), ("cols", "<i4")], align=True)
COUNTER_DTYPE = np.dtype([("expected", "<i4"), ("bumpers", "<i4"), ("op", "<i4"), ("group", "<i4")], align=True)
BUFFER_KINDS = {"act": 0, "partial": 1, "io": 2, "state": 3, "scratch": 4}
BUFFER_DTYPES = {"bf16": 0, "f32": 1, "i32": 2}


def _struct(name: str, dt: np.dtype) -> list[str]:
    ct = {"<i4": "int32_t", "<i8": "int64_t"}
    out = [f"struct {name} {{"] + [f"  {ct[dt.fields[n][0].str]} {n};" for n in dt.names] + ["};"]
    out.append(f"static_assert(sizeof({name}) == {dt.itemsize}, \"{name} size\");")
    # NVRTC cannot evaluate offsetof in a constant expression; nvcc (the CI compile check) verifies these
    out += ["#ifndef __CUDACC_RTC__"]
    out += [f"static_assert(__builtin_offsetof({name}, {n}) == {dt.fields[n][1]}, \"{name} layout\");" for n in dt.names]
    out += ["#endif"]
    return out


def c_header() -> str:
    """The generated C header text."""
    L = ["// generated by `python3 -m assembler.isa --write` from assembler/isa.py; do not edit", "#pragma once",
         "#include <cuda/std/cstdint>", "",
         "// An instruction is QMK_ISA_WORDS int32 words: fields at QMK_F_* offsets, then QMK_ISA_MAX_WAITS",
         "// (counter, expected, offset) triples from QMK_ISA_WAITS_OFFSET; wait until counter >= step*expected+offset.",
         f"#define QMK_ISA_WORDS {WORDS}", f"#define QMK_ISA_MAX_WAITS {MAX_WAITS}",
         f"#define QMK_ISA_WAITS_OFFSET {WAITS_OFFSET}", ""]
    L += [f"#define QMK_OP_{op.name} {int(op)}" for op in Opcode] + [""]
    L += [f"#define QMK_F_{n.upper()} {i}" for i, n in enumerate(FIELDS)] + [""]
    L += [f"#define QMK_PRO_{k.upper()} {v}" for k, v in PROLOGUES.items()]
    L += [f"#define QMK_EPI_{k.upper()} {v}" for k, v in EPILOGUES.items()]
    L += [f"#define QMK_SUB_FUSE_REDUCE {FUSE_REDUCE}", f"#define QMK_SUB_LOCAL_REDUCE {LOCAL_REDUCE}",
          f"#define QMK_SUB_ARGMAX_KEYS {ARGMAX_KEYS}",
          f"#define QMK_SUB_SRC_SPLIT_SHIFT {SRC_SPLIT_SHIFT}"] + [""]
    L += [f"#define QMK_BUF_{k.upper()} {v}" for k, v in BUFFER_KINDS.items()]
    L += [f"#define QMK_DT_{k.upper()} {v}" for k, v in BUFFER_DTYPES.items()] + [""]
    L += _struct("QmkBuffer", BUFFER_DTYPE) + [""] + _struct("QmkCounter", COUNTER_DTYPE)
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    if "--write" in sys.argv:
        HEADER.parent.mkdir(parents=True, exist_ok=True)
        HEADER.write_text(c_header())
        print(f"wrote {HEADER}")
    else:
        print(c_header(), end="")
