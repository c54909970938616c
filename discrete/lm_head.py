"""Launch code for the lm_head (``kernels/lm_head.cu``): the [V, H] bf16 projection fused with greedy argmax
(lowest id on ties) and optional top-k candidates, then one small merge kernel (article Part 3.8).

Device arrays are CuPy arrays of bit patterns (bf16 as uint16). Buffers are allocated once by
:meth:`LmHead.buffers`; launches allocate nothing. Candidates come back as 64-bit keys: see :func:`decode_keys`.
"""
from __future__ import annotations

import numpy as np

from assembler.numerics import MAX_ROWS
from discrete.build import load_module
from discrete.launch import kernels
from discrete.gemv import NULL, _need, check_array
from loader.config import ModelConfig

SOURCES = ("lm_head.cu",)
TOPK = 32                 # QMK_TOPK of the compiled kernel
LMH_WARPS = 8             # QMK_LMH_WARPS
THREADS = 32 * LMH_WARPS
ROWS_PER_BLOCK = 16 * LMH_WARPS
# Measured best on the H200 (bench/results/gemv.json, sweep): 2 units in flight + 256-byte L2 prefetch hint.
DEFAULT_DEFINES = {"QMK_GEMV_STAGES": 2, "QMK_LD_L2_PREFETCH": 256}
MERGE_THREADS = 1024


def decode_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split candidate keys (uint64, any shape) into (ids int64, logits as bf16 bit patterns uint16).

    Key = (order(bf16 logit) << 32) | (2^32 - 1 - id), order(h) = h | 0x8000 for h ≥ 0, ~h & 0xFFFF otherwise."""
    keys = np.asarray(keys, dtype=np.uint64)
    ids = (np.uint64(0xFFFFFFFF) - (keys & np.uint64(0xFFFFFFFF))).astype(np.int64)
    o = (keys >> np.uint64(32)).astype(np.uint32)
    h = np.where(o & 0x8000, o & 0x7FFF, ~o & 0xFFFF).astype(np.uint16)
    return ids, h


class LmHead:
    """lm_head ready to launch. ``w`` uint16 [V, H] (bf16 bits), V = cfg.vocab_size (multiple of 128),
    H = cfg.hidden_size. ``pdl``: launch with programmatic stream serialization (``discrete.launch``; same bits).
    Raises ValueError naming the argument on a contract violation."""

    def __init__(self, cfg: ModelConfig, w, name: str = "lm_head.weight", defines: dict | None = None,
                 pdl: bool = False):
        check_array(w, f"{name} (bf16 bits)", np.uint16, (cfg.vocab_size, cfg.hidden_size))
        _need(cfg.vocab_size % ROWS_PER_BLOCK == 0, f"{name}: vocab {cfg.vocab_size} not a multiple of {ROWS_PER_BLOCK}")
        self.cfg, self.w, self.V, self.K = cfg, w, cfg.vocab_size, cfg.hidden_size
        self.nblk = self.V // ROWS_PER_BLOCK
        mod = load_module(cfg, SOURCES, {"QMK_TOPK": TOPK, **DEFAULT_DEFINES, **(defines or {})})
        self._argmax, self._topk, self._merge_argmax, self._merge_topk = kernels(
            mod, ("lm_head_argmax", "lm_head_topk", "lm_head_merge_argmax", "lm_head_merge_topk"), pdl)

    @property
    def weight_bytes(self) -> int:
        return int(self.w.nbytes)

    def buffers(self, M: int = MAX_ROWS) -> dict:
        """Preallocated device buffers for up to M rows: best/cand (per-block keys), ids, vals, cand_out."""
        import cupy as cp
        return {"best": cp.empty(M * self.nblk, cp.uint64), "cand": cp.empty(M * self.nblk * TOPK, cp.uint64),
                "ids": cp.empty(M, cp.int32), "vals": cp.empty(M, cp.uint16),
                "cand_out": cp.empty(M * TOPK, cp.uint64)}

    def __call__(self, x, bufs: dict, topk: bool = False, logits=None):
        """x uint16 [M, H] → bufs["ids"][:M] (argmax), bufs["vals"][:M] (its bf16 logit) and, when ``topk``,
        bufs["cand_out"][:M·TOPK] (keys, descending). ``logits`` uint16 [M, V] (debug) receives every logit."""
        check_array(x, "lm_head: x (bf16 bits)", np.uint16)
        _need(x.ndim == 2 and x.shape[1] == self.K and 1 <= x.shape[0] <= MAX_ROWS,
              f"lm_head: x must be [M, {self.K}] with 1 ≤ M ≤ {MAX_ROWS}, got {tuple(x.shape)}")
        M = int(x.shape[0])
        for k, n in (("best", M * self.nblk), ("cand", M * self.nblk * TOPK), ("ids", M), ("vals", M),
                     ("cand_out", M * TOPK)):
            _need(k in bufs and bufs[k].size >= n, f"lm_head: buffer {k!r} missing or smaller than {n}")
        if logits is not None:
            check_array(logits, "lm_head: logits (bf16 bits)", np.uint16, (M, self.V), align=4)
        lg = logits if logits is not None else NULL
        n = np.int32
        if topk:
            self._topk((self.nblk,), (THREADS,), (self.w, x, n(M), n(self.K), bufs["best"], bufs["cand"], lg))
            self._merge_topk((M,), (MERGE_THREADS,), (bufs["best"], bufs["cand"], bufs["ids"], bufs["vals"],
                                                     bufs["cand_out"]))
        else:
            self._argmax((self.nblk,), (THREADS,), (self.w, x, n(M), n(self.K), bufs["best"], lg))
            self._merge_argmax((M,), (MERGE_THREADS,), (bufs["best"], bufs["ids"], bufs["vals"]))
        return bufs["ids"][:M]


class Embed:
    """Embedding gather (``kernels/embed.cu``): table uint16 [V, H] (bf16 bits), ids int32 [M] → out [M, H].
    ``pdl`` as for :class:`LmHead`."""

    def __init__(self, cfg: ModelConfig, table, name: str = "model.embed_tokens.weight", pdl: bool = False):
        check_array(table, f"{name} (bf16 bits)", np.uint16, (cfg.vocab_size, cfg.hidden_size))
        _need(cfg.hidden_size % 8 == 0, f"{name}: hidden size {cfg.hidden_size} must be a multiple of 8")
        self.table, self.V, self.H = table, cfg.vocab_size, cfg.hidden_size
        self._fn, = kernels(load_module(cfg, ("embed.cu",)), ("embed_gather",), pdl)

    def __call__(self, ids, out):
        check_array(ids, "embed: ids", np.int32, align=4)
        M = int(ids.size)
        _need(1 <= M <= MAX_ROWS, f"embed: 1 ≤ M ≤ {MAX_ROWS} ids expected, got {M}")
        check_array(out, "embed: out (bf16 bits)", np.uint16, (M, self.H))
        self._fn((M,), (256,), (self.table, ids, np.int32(self.H), np.int32(self.V), out))
        return out
