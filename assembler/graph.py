"""The decode step as an ordered list of ops over named buffers (article Part 3.9; DESIGN.md "Data flow").

Three graphs share one vocabulary: ``decode_graph`` (M = 1 row), ``verify_graph`` (M ≤ 8 rows: the current
token plus drafts, one weight pass) and ``mtp_graph`` (one MTP draft step, spec §4). Buffers are SSA within a
step: every activation buffer has exactly one producing op, so the only hazards across steps are the ones the
step-end counter orders (see ``assembler/scheduler.py``). Fusions (DESIGN.md): gate|up rows with the SwiGLU
epilogue; q|k|v for attention and in_proj_qkv|z for GDN as one op whose output rows are grouped per KV head /
key head (each group its own counter); residual adds in the out/o/down epilogues; in_proj_a/b inside the GDN
step; lm_head followed by argmax. Every RMSNorm is a prologue recomputed by each consumer slice.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from assembler.numerics import MAX_ROWS, ROW_TILE, attn_partitions, split_k
from assembler.options import PROGRAM
from loader.config import FULL, ModelConfig

DTYPE_BYTES = {"bf16": 2, "f32": 4, "i32": 4}


@dataclass(frozen=True)
class Buffer:
    """A named buffer. ``shape`` in elements; kind: ``act`` (SSA activation, NaN-poisoned each step),
    ``partial`` (fp32 split-K partials [S, M, N]), ``io`` (tokens in / out), ``state`` (persists across steps),
    ``scratch`` (intermediates between the stages of one op, SSA and poisoned like ``act``; a 0 in the shape is
    the KV capacity; the device keeps one copy for all layers, see ``_attn_layer``)."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Segment:
    """One weight matrix of a GEMV op: ``parts`` (canonical names) concatenated row-wise, ``n_out`` outputs of
    width ``k``; ``split`` = split-K factor; epilogue store | residual | swiglu (parts = (gate, up), n_out = F)."""
    parts: tuple[str, ...]
    n_out: int
    k: int
    split: int
    epilogue: str
    out: str
    fp8: bool
    residual: str | None = None
    partials: str | None = None
    deferred: bool = False  # split-K reduce left to the consumer's prologue (defer_reduces): no GEMV_REDUCE

    @property
    def row_bytes(self) -> float:
        """Weight bytes streamed per output row (fp8 payload + bf16 block scales amortised, or bf16)."""
        per = self.k + 2 * (self.k // 128) / 128 if self.fp8 else 2 * self.k
        return per * (2 if self.epilogue == "swiglu" else 1)

    @property
    def nbytes(self) -> int:
        """Exact weight bytes of the segment as stored (payload + scales)."""
        rows = self.n_out * (2 if self.epilogue == "swiglu" else 1)
        if not self.fp8:
            return rows * self.k * 2
        return rows * self.k + (-(-rows // 128)) * (self.k // 128) * 2


@dataclass(frozen=True)
class Op:
    """One op of the step. kind: embed | gemv | gdn_step | attn | argmax. ``groups``: output row groups, each a
    tuple of (segment index, row_start, row_end) for gemv or a (head_start, head_end) unit for gdn/attn; every
    group has its own completion counter. ``norm``: (input buffer, norm weight name) prologue, or for the MTP
    input a pair of them (concatenated). ``norm_out``: buffer the op's first slice also writes the normalised
    input to (the head's final-normed hidden, the MTP head's input). ``scratch``: buffers only the op's own
    stages write and read (attention: roped q, scores, stats max / sum, partials). ``reduce_in``: (partials,
    split, residual) of the deferred split-K residual segment whose output is this op's norm input: every slice
    rebuilds that input from them and stores its share of it (``defer_reduces``)."""
    name: str
    kind: str
    layer: int
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    bytes: int
    flops: int
    segments: tuple[Segment, ...] = ()
    norm: tuple = ()
    groups: tuple = ()
    state: tuple[str, ...] = ()
    norm_out: str | None = None
    scratch: tuple[str, ...] = ()
    reduce_in: tuple = ()


@dataclass
class Graph:
    """Ordered ops + buffer table for one step kind of a config with ``m`` rows."""
    cfg: ModelConfig
    m: int
    kind: str
    ops: list[Op] = field(default_factory=list)
    buffers: dict[str, Buffer] = field(default_factory=dict)
    # a split-K GEMV without prologue reads only its split's K columns (asm_regions), so its waits name only the
    # producers of those columns; set with mlp_groups, whose down splits need it (False: the whole row)
    split_reads: bool = False

    def buf(self, name: str, shape, dtype: str, kind: str = "act") -> str:
        if name in self.buffers:
            raise ValueError(f"graph: buffer {name!r} defined twice")
        self.buffers[name] = Buffer(name, tuple(int(s) for s in shape), dtype, kind)
        return name

    def op(self, name: str) -> Op:
        for o in self.ops:
            if o.name == name:
                return o
        raise KeyError(f"graph: no op named {name!r}")

    @property
    def total_bytes(self) -> int:
        return sum(o.bytes for o in self.ops)


def layer_prefix(cfg: ModelConfig, layer: int) -> str:
    """Canonical tensor-name prefix of decoder layer ``layer`` (num_hidden_layers = the MTP layer)."""
    return "mtp.layers.0." if layer == cfg.num_hidden_layers else f"model.layers.{layer}."


def _gemv(g: Graph, name, layer, x, norm, segs: list[Segment], groups=None) -> None:
    """Append a GEMV op; partial buffers are declared for segments with split > 1."""
    m = g.m
    out_segs = []
    for i, s in enumerate(segs):
        if s.n_out % ROW_TILE:
            raise ValueError(f"graph: {name} segment {i} has {s.n_out} rows, not a multiple of {ROW_TILE}")
        rows = 2 * s.n_out if s.epilogue == "swiglu" else s.n_out  # partial columns = rows of the fused matrix
        p = g.buf(f"{name}.p{i}", (s.split, m, rows), "f32", "partial") if s.split > 1 else None
        out_segs.append(Segment(**{**s.__dict__, "partials": p}))
    if groups is None:
        groups = (tuple((i, 0, s.n_out) for i, s in enumerate(segs)),)
    reads = tuple(dict.fromkeys([x] if isinstance(x, str) else list(x)))
    reads += tuple(s.residual for s in segs if s.residual)
    nb = sum(s.nbytes for s in segs)
    fl = sum(2 * m * s.n_out * s.k * (2 if s.epilogue == "swiglu" else 1) for s in segs)
    g.ops.append(Op(name, "gemv", layer, reads, tuple(s.out for s in segs), nb, fl, tuple(out_segs), norm,
                    tuple(groups)))


def _seg(cfg, parts, n_out, k, epilogue, out, residual=None, fp8=None, fused_rows=None) -> Segment:
    """``fused_rows``: row count of the whole fused matrix the op streams; split-K derives from it (the
    reference's ``proj_splits`` makes the same choice, so per-row numerics agree)."""
    fp8 = cfg.quant_method is not None if fp8 is None else fp8
    n = fused_rows or (2 * n_out if epilogue == "swiglu" else n_out)
    return Segment(tuple(parts), n_out, k, split_k(n, k), epilogue, out, fp8, residual)


def _attn_layer(g: Graph, i: int, x: str, x_mid: str) -> None:
    cfg, m, p = g.cfg, g.m, layer_prefix(g.cfg, i)
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qg = g.buf(f"qg.{i}", (m, cfg.q_proj_rows), "bf16")
    k = g.buf(f"k.{i}", (m, cfg.kv_rows), "bf16")
    v = g.buf(f"v.{i}", (m, cfg.kv_rows), "bf16")
    fr = cfg.q_proj_rows + 2 * cfg.kv_rows
    segs = [_seg(cfg, [p + "self_attn.q_proj.weight"], cfg.q_proj_rows, cfg.hidden_size, "store", qg, fused_rows=fr),
            _seg(cfg, [p + "self_attn.k_proj.weight"], cfg.kv_rows, cfg.hidden_size, "store", k, fused_rows=fr),
            _seg(cfg, [p + "self_attn.v_proj.weight"], cfg.kv_rows, cfg.hidden_size, "store", v, fused_rows=fr)]
    # one output group: per-KV-head groups cut the projection into runs of 16-192 tiles and instructions of
    # 1-28 tiles that SMs ran one after another (docs/megakernel.md, "Scheduling"); the attention prep waits for
    # the whole projection
    _gemv(g, f"L{i}.in", i, x, (x, p + "input_layernorm.weight"), segs)
    o = g.buf(f"o.{i}", (m, cfg.attn_out_dim), "bf16")
    kc = g.buf(f"kcache.{i}", (0, nkv, hd), "bf16", "state")
    vc = g.buf(f"vcache.{i}", (0, nkv, hd), "bf16", "state")
    # stage intermediates (discrete/attention.py's scratch; one device copy serves every layer, safe because a
    # layer's attention completes before the next layer's starts: its o projection waits on the reduce)
    P = attn_partitions(cfg)
    scratch = (g.buf(f"attq.{i}", (m, nq * hd), "bf16", "scratch"),          # roped queries [M, NQ, HD]
               g.buf(f"atts.{i}", (m, nq, 0), "bf16", "scratch"),            # scores [M, NQ, capacity]
               g.buf(f"attm.{i}", (m, nq, P), "f32", "scratch"),             # per-partition max
               g.buf(f"attl.{i}", (m, nq, P), "f32", "scratch"),             # per-partition exp-sum
               g.buf(f"attp.{i}", (m, nq, P, hd), "f32", "scratch"))         # per-partition partial o
    kv = 2 * nkv * hd * 2 * m  # K/V rows appended and read back at context length m; + 2·nkv·hd·2 per token of context
    g.ops.append(Op(f"L{i}.attn", "attn", i, (qg, k, v), (o,), 2 * kv,
                    4 * m * nq * hd, groups=tuple((h, h + 1) for h in range(nkv)), state=(kc, vc), scratch=scratch))
    segs = [_seg(cfg, [p + "self_attn.o_proj.weight"], cfg.hidden_size, cfg.attn_out_dim, "residual", x_mid, x)]
    _gemv(g, f"L{i}.out", i, o, (), segs)


def _gdn_layer(g: Graph, i: int, x: str, x_mid: str) -> None:
    cfg, m, p = g.cfg, g.m, layer_prefix(g.cfg, i) + "linear_attn."
    nk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    qkv = g.buf(f"qkv.{i}", (m, cfg.gdn_conv_dim), "bf16")
    z = g.buf(f"z.{i}", (m, cfg.gdn_value_dim), "bf16")
    fr = cfg.gdn_conv_dim + cfg.gdn_value_dim
    segs = [_seg(cfg, [p + "in_proj_qkv.weight"], cfg.gdn_conv_dim, cfg.hidden_size, "store", qkv, fused_rows=fr),
            _seg(cfg, [p + "in_proj_z.weight"], cfg.gdn_value_dim, cfg.hidden_size, "store", z, fused_rows=fr)]
    # one output group (one per key head gave runs of 8-24 tiles that SMs ran one after another,
    # docs/megakernel.md, "Scheduling"): every GDN step waits for the whole projection
    _gemv(g, f"L{i}.in", i, x, (x, layer_prefix(cfg, i) + "input_layernorm.weight"), segs)
    o = g.buf(f"o.{i}", (m, cfg.gdn_value_dim), "bf16")
    conv = g.buf(f"conv.{i}", (cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1), "bf16", "state")
    rec = g.buf(f"rec.{i}", (cfg.linear_num_value_heads, dk, dv), "f32", "state")
    nv, h = cfg.linear_num_value_heads, cfg.hidden_size
    nbytes = (2 * cfg.gdn_state_bytes_per_layer + 2 * cfg.conv_state_bytes_per_layer  # state read + written
              + 2 * nv * h * 2 + cfg.gdn_conv_dim * cfg.linear_conv_kernel_dim * 2)  # in_proj_a/b, conv1d
    flops = m * (2 * 2 * nv * h + 6 * nv * dk * dv)
    g.ops.append(Op(f"L{i}.gdn", "gdn_step", i, (qkv, z, x), (o,), nbytes, flops,
                    norm=(x, layer_prefix(cfg, i) + "input_layernorm.weight"),
                    groups=tuple((hh, hh + 1) for hh in range(nk)), state=(conv, rec)))
    segs = [_seg(cfg, [p + "out_proj.weight"], cfg.hidden_size, cfg.gdn_value_dim, "residual", x_mid, x)]
    _gemv(g, f"L{i}.out", i, o, (), segs)


DEFAULT_MLP_GROUPS = PROGRAM.mlp_groups  # verify_graph's mlp_groups when not given (assembler/options.py)


def mlp_group_rows(cfg: ModelConfig) -> list[tuple[int, int]] | None:
    """gate|up output rows per down-projection split — [(j·F/S, (j+1)·F/S)] for the down's split-K S: the act
    columns split j of the down reads — or None when the down is not split-K or F/S is not a whole number of
    16-row tiles."""
    F = cfg.intermediate_size
    S = split_k(cfg.hidden_size, F)
    if S < 2 or F % (S * ROW_TILE):
        return None
    return [(j * F // S, (j + 1) * F // S) for j in range(S)]


def _mlp(g: Graph, i: int, x_mid: str, x_next: str, mlp_groups: bool = False) -> None:
    """gate|up (SwiGLU epilogue) then down (residual). ``mlp_groups``: gate|up's output rows in one group per down
    split (``mlp_group_rows``), each its own counter, so down split j waits only for the gate|up instructions
    that wrote its K columns (a split-K GEMV reads only its split's columns: asm_regions) and the splits whose
    group ends first start first (the scheduler's ready-time cut, docs/megakernel.md "Scheduling")."""
    cfg, m, p = g.cfg, g.m, layer_prefix(g.cfg, i)
    act = g.buf(f"act.{i}", (m, cfg.intermediate_size), "bf16")
    segs = [_seg(cfg, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], cfg.intermediate_size,
                 cfg.hidden_size, "swiglu", act)]
    rows = mlp_group_rows(cfg) if mlp_groups else None
    groups = tuple(((0, a, b),) for a, b in rows) if rows else None
    _gemv(g, f"L{i}.gateup", i, x_mid, (x_mid, p + "post_attention_layernorm.weight"), segs, groups)
    segs = [_seg(cfg, [p + "mlp.down_proj.weight"], cfg.hidden_size, cfg.intermediate_size, "residual", x_next, x_mid)]
    if rows and segs[0].split != len(rows):
        raise ValueError(f"graph: L{i}.down has split {segs[0].split}, mlp_group_rows gives {len(rows)} groups")
    _gemv(g, f"L{i}.down", i, act, (), segs)


def _layer(g: Graph, i: int, x: str, mlp_groups: bool = False) -> str:
    cfg = g.cfg
    x_mid = g.buf(f"x.{i}.mid", (g.m, cfg.hidden_size), "bf16")
    x_next = g.buf(f"x.{i + 1}" if i < cfg.num_hidden_layers else "x.mtp.out", (g.m, cfg.hidden_size), "bf16")
    if i == cfg.num_hidden_layers or cfg.layer_types[i] == FULL:
        _attn_layer(g, i, x, x_mid)
    else:
        _gdn_layer(g, i, x, x_mid)
    _mlp(g, i, x_mid, x_next, mlp_groups)
    return x_next


def _head(g: Graph, x: str, norm_w: str) -> None:
    cfg = g.cfg
    logits = g.buf("logits", (g.m, cfg.vocab_size), "bf16")
    segs = [_seg(cfg, ["lm_head.weight"], cfg.vocab_size, cfg.hidden_size, "store", logits, fp8=False)]
    _gemv(g, "head", -1, x, (x, norm_w), segs)
    hid = g.buf("hidden.out", (g.m, cfg.hidden_size), "bf16", "io")
    g.ops[-1] = Op(**{**g.ops[-1].__dict__, "writes": g.ops[-1].writes + (hid,), "norm_out": hid})
    nxt = g.buf("next", (g.m,), "i32", "io")
    g.ops.append(Op("argmax", "argmax", -1, (logits,), (nxt,), g.m * cfg.vocab_size * 2, g.m * cfg.vocab_size))


def defer_reduces(g: Graph) -> Graph:
    """Move the split-K reduce of every residual GEMV (out / o / down projections) into its consumer: the next
    op, a GEMV whose RMSNorm prologue reads that output (gate|up, the next layer's in-projection, the head).
    The producer's segment becomes ``deferred`` (partials only); the consumer gets ``reduce_in`` and becomes the
    writer of the hidden row (each of its slices stores a share), so every later reader of it (the GDN step's
    norm, the next residual) orders after the consumer. Numerics unchanged: the consumer applies the same
    fixed-order reduce + residual epilogue. Returns ``g`` (modified in place). Raises ValueError when an op reads
    the producer's output before the consumer does (nothing in the decode / verify / MTP graphs)."""
    for ci, c in enumerate(g.ops):
        if c.kind != "gemv" or not c.norm or not isinstance(c.norm[0], str) or ci == 0:
            continue
        xb = c.norm[0]
        pi = next((i for i in range(ci - 1, -1, -1) if xb in g.ops[i].writes), None)
        if pi is None:
            continue
        prod = g.ops[pi]
        segs = [s for s in prod.segments if s.out == xb]
        if prod.kind != "gemv" or len(prod.segments) != 1 or not segs or segs[0].epilogue != "residual" \
                or segs[0].split == 1:
            continue
        seg = segs[0]
        if any(xb in o.reads for o in g.ops[pi + 1:ci]):
            raise ValueError(f"defer_reduces: {xb} is read between {prod.name} and {c.name}")
        if any(s.residual for s in c.segments):
            raise ValueError(f"defer_reduces: {c.name} has a residual epilogue of its own")
        g.ops[pi] = Op(**{**prod.__dict__, "segments": (Segment(**{**seg.__dict__, "deferred": True}),),
                          "writes": tuple(w for w in prod.writes if w != xb)})
        g.ops[ci] = Op(**{**c.__dict__, "reduce_in": (seg.partials, seg.split, seg.residual),
                          "reads": tuple(dict.fromkeys(c.reads + (seg.partials, seg.residual))),
                          "writes": c.writes + (xb,)})
    return g


def ab_split(cfg: ModelConfig) -> int:
    """Split-K of in_proj_b|a (computed inside the GDN step; fused row count 2·n_v)."""
    return split_k(2 * cfg.linear_num_value_heads, cfg.hidden_size)


def _check_m(m: int) -> None:
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"graph: m={m} rows; expected 1..{MAX_ROWS}")


def verify_graph(cfg: ModelConfig, m: int, layer_limit: int | None = None, defer_reduce: bool | None = None,
                 mlp_groups: bool | None = None) -> Graph:
    """The target model over ``m`` rows (the current token + m−1 drafts, positions pos..pos+m−1).

    ``layer_limit`` keeps the first L layers (bisect knob; the head still runs); ``defer_reduce``: residual
    split-K reduces in the consumers' prologues (:func:`defer_reduces`; None: ``PROGRAM.for_rows(m)``, the GPU's
    program: deferred for m = 1 only); ``mlp_groups``: gate|up rows grouped per down split (``_mlp``; None:
    DEFAULT_MLP_GROUPS, read at call time). Raises ValueError on bad m/L."""
    _check_m(m)
    if defer_reduce is None:
        defer_reduce = PROGRAM.for_rows(m).defer_reduce
    n = cfg.num_hidden_layers if layer_limit is None else layer_limit
    if not 0 <= n <= cfg.num_hidden_layers:
        raise ValueError(f"graph: layer_limit={layer_limit}; expected 0..{cfg.num_hidden_layers}")
    g = Graph(cfg, m, "decode" if m == 1 else "verify")
    tok = g.buf("tokens", (m,), "i32", "io")
    x = g.buf("x.0", (m, cfg.hidden_size), "bf16")
    g.ops.append(Op("embed", "embed", -1, (tok,), (x,), m * cfg.hidden_size * 2, 0))
    grp = DEFAULT_MLP_GROUPS if mlp_groups is None else mlp_groups
    g.split_reads = grp
    for i in range(n):
        x = _layer(g, i, x, grp)
    _head(g, x, "model.norm.weight")
    return defer_reduces(g) if defer_reduce else g


def decode_graph(cfg: ModelConfig, layer_limit: int | None = None, defer_reduce: bool | None = None,
                 mlp_groups: bool | None = None) -> Graph:
    """One decode step (M = 1)."""
    return verify_graph(cfg, 1, layer_limit, defer_reduce, mlp_groups)


def mtp_graph(cfg: ModelConfig, m: int = 1, defer_reduce: bool | None = None, mlp_groups: bool | None = None) -> Graph:
    """One MTP draft step (spec §4): x = mtp.fc(cat[norm_e(embed(tok)), norm_h(hidden)]) → the MTP full-attention
    layer (own KV cache, layer index num_hidden_layers) → mtp.norm → lm_head → argmax. ``hidden`` is the
    final-normed hidden state of the row before (io input); ``defer_reduce``, ``mlp_groups`` as ``verify_graph``.
    Raises ValueError when the config has no MTP layer."""
    _check_m(m)
    if defer_reduce is None:
        defer_reduce = PROGRAM.for_rows(m).defer_reduce
    if cfg.mtp_num_hidden_layers != 1:
        raise ValueError("mtp_graph: the config has no MTP layer (mtp_num_hidden_layers=0)")
    g = Graph(cfg, m, "mtp")
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    tok = g.buf("tokens", (m,), "i32", "io")
    hid = g.buf("hidden", (m, H), "bf16", "io")
    e = g.buf("e.mtp", (m, H), "bf16")
    g.ops.append(Op("embed", "embed", -1, (tok,), (e,), m * H * 2, 0))
    x = g.buf(f"x.{L}", (m, H), "bf16")
    segs = [_seg(cfg, ["mtp.fc.weight"], H, 2 * H, "store", x, fp8=False)]
    _gemv(g, "mtp.fc", L, (e, hid), ((e, "mtp.pre_fc_norm_embedding.weight"), (hid, "mtp.pre_fc_norm_hidden.weight")), segs)
    g.split_reads = DEFAULT_MLP_GROUPS if mlp_groups is None else mlp_groups
    x = _layer(g, L, x, g.split_reads)
    _head(g, x, "mtp.norm.weight")
    return defer_reduces(g) if defer_reduce else g
