"""Launch code for gated decode attention over the paged KV cache (``kernels/attention.cu``; stages and rounding
points in ``kernels/attention.cuh``): prep (q|gate split, q/k norm, partial RoPE, KV append), scores + per-partition
softmax statistics, values under the merged statistics, partition reduce + sigmoid gate.

The scratch (queries, scores, statistics, partial outputs) is allocated once in the constructor for a context
capacity; launches allocate nothing and read the position from device memory (graph capture friendly).
"""
from __future__ import annotations

import numpy as np

from assembler.numerics import MAX_ROWS, attn_partitions
from discrete.build import load_module
from discrete.kv_cache import PAGE, KVSession, PagedKVCache, check_array, need
from discrete.launch import kernels
from loader.config import ModelConfig

SOURCES = ("attention.cu",)
THREADS = 512  # MX_ATT_THREADS (values)
SCORE_THREADS = 256  # MX_ATT_SC_THREADS


def extra_defines(cfg: ModelConfig) -> dict[str, int | str]:
    """Numerics macros attention.cuh needs beyond the config defines."""
    scale = float(np.float32(cfg.head_dim ** -0.5))
    return {"QMK_PAGE": PAGE, "QMK_MAX_ROWS": MAX_ROWS, "QMK_ATTN_PARTS": attn_partitions(cfg),
            "QMK_ATTN_SCALE": scale.hex() + "f"}


def module(cfg: ModelConfig):
    """The compiled attention.cu module for this config (cached per process)."""
    return load_module(cfg, SOURCES, extra_defines(cfg))


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None) -> np.ndarray:
    """inv_freq [rotary_dim/2] fp32 with the rounding of ``assembler.ref.attention.rope_cos_sin``:
    fp32(1 / fp32(θ^fp32(2i/rd)))."""
    rd = cfg.rotary_dim
    base = float(cfg.rope_theta if theta is None else theta)
    expo = (np.arange(0, rd, 2, dtype=np.float32) / np.float32(rd)).astype(np.float64)
    return (1.0 / (base ** expo).astype(np.float32).astype(np.float64)).astype(np.float32)


class AttnDecode:
    """Decode attention of one full-attention layer for M ≤ MAX_ROWS rows at positions pos..pos+M-1 (row i sees
    keys 0..pos+i). ``q_norm_w``, ``k_norm_w``: bf16 bits [head_dim]. ``capacity``: the largest context (keys)
    any call will see; sizes the score scratch. ``theta`` overrides the RoPE base (negative controls only).
    ``pdl``: launch the four stages with programmatic stream serialization (``discrete.launch``; same bits)."""

    def __init__(self, cfg: ModelConfig, q_norm_w, k_norm_w, capacity: int, theta: float | None = None,
                 pdl: bool = False):
        import cupy as cp
        self.cfg = cfg
        hd, nq = cfg.head_dim, cfg.num_attention_heads
        check_array(q_norm_w, "attn.q_norm.weight", np.uint16, (hd,))
        check_array(k_norm_w, "attn.k_norm.weight", np.uint16, (hd,))
        need(capacity > 0, f"AttnDecode: capacity must be positive, got {capacity}")
        self.q_norm_w, self.k_norm_w, self.capacity = q_norm_w, k_norm_w, int(capacity)
        self.parts = attn_partitions(cfg)
        self.inv_freq = cp.asarray(rope_inv_freq(cfg, theta))
        self.q = cp.zeros((MAX_ROWS, nq, hd), np.uint16)                       # roped queries
        self.scores = cp.zeros((MAX_ROWS, nq, self.capacity), np.uint16)      # bf16 scores
        self.stats_m = cp.zeros((MAX_ROWS, nq, self.parts), np.float32)
        self.stats_l = cp.zeros((MAX_ROWS, nq, self.parts), np.float32)
        self.partial = cp.zeros((MAX_ROWS, nq, self.parts, hd), np.float32)
        mod = module(cfg)
        self.k_prep, self.k_scores, self.k_values, self.k_reduce = kernels(
            mod, ("qmk_attn_prep", "qmk_attn_scores", "qmk_attn_values", "qmk_attn_reduce"), pdl)

    def poison(self) -> None:
        """Fill the scratch with NaN patterns (tests: every element read must have been written this call)."""
        for a in (self.q, self.scores):
            a.fill(0x7FC1)
        for a in (self.stats_m, self.stats_l, self.partial):
            a.fill(np.nan)

    def __call__(self, qg, k, v, cache: PagedKVCache, sess: KVSession, layer: int, out, pos_dev, M: int,
                 pos_host: int | None = None) -> None:
        """Launch the four stages. qg [M, 2·nq·hd], k, v [M, nkv·hd], out [M, nq·hd]: bf16 bits. The session must
        hold pages for positions < pos+M (``sess.reserve``). ``pos_host``, when given, is checked against the
        capacity and the session's pages (the kernels read the device copy). Raises ValueError."""
        cfg = self.cfg
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        need(1 <= M <= MAX_ROWS, f"attn: M={M} not in [1, {MAX_ROWS}]")
        check_array(qg, "attn.qg", np.uint16)
        need(qg.shape[-1] == 2 * nq * hd and qg.size >= M * 2 * nq * hd, f"attn.qg: shape {qg.shape}")
        for a, nm in ((k, "attn.k"), (v, "attn.v")):
            check_array(a, nm, np.uint16)
            need(a.shape[-1] == nkv * hd and a.size >= M * nkv * hd, f"{nm}: shape {a.shape}")
        check_array(out, "attn.out", np.uint16)
        need(out.shape[-1] == nq * hd and out.size >= M * nq * hd, f"attn.out: shape {out.shape}")
        need(cache.cfg == cfg, "attn: the KV cache was built for another config")
        need(pos_dev.dtype in (np.int32, np.uint32), f"attn.pos: expected int32/uint32, got {pos_dev.dtype}")
        if pos_host is not None:
            need(pos_host + M <= self.capacity, f"attn: context {pos_host + M} exceeds capacity {self.capacity}")
            need(pos_host + M <= sess.capacity, f"attn: positions up to {pos_host + M - 1} need pages; session holds {sess.capacity}")
        base = cache.layer_base(layer)
        ps = np.int64(cache.page_stride)
        self.k_prep((M, nq + nkv), (32,), (qg, k, v, self.q_norm_w, self.k_norm_w, self.inv_freq, sess.table, ps,
                                          np.uint64(base), self.q, pos_dev))
        grid = (self.parts, nkv)
        cap = np.int32(self.capacity)
        self.k_scores(grid, (SCORE_THREADS,), (self.q, np.uint64(base), sess.table, ps, self.scores, cap, self.stats_m,
                                         self.stats_l, pos_dev, np.int32(M)))
        self.k_values(grid, (THREADS,), (np.uint64(base), sess.table, ps, self.scores, cap, self.stats_m,
                                         self.stats_l, self.partial, pos_dev, np.int32(M)))
        self.k_reduce((M, nq), (hd,), (self.partial, qg, out, pos_dev))
