"""Launch code for the fused Gated DeltaNet decode step (``kernels/gdn.cu``, layouts in ``kernels/gdn.cuh``) and
converters between the GPU's state layouts and the reference layouts (docs/INTERFACES.md §3 ModelState).

Device arrays are CuPy arrays of bit patterns (bf16 as uint16) or float32. Launches go to the current stream
and allocate nothing, so they can be captured into a CUDA graph; the position is read from device memory.
"""
from __future__ import annotations

import numpy as np

from assembler.numerics import MAX_ROWS
from discrete.build import load_module
from discrete.kv_cache import check_array, need
from discrete.launch import kernels
from loader.config import ModelConfig

SOURCES = ("gdn.cu",)
THREADS = 512  # MX_GDN_THREADS
CONV_RING = 16  # slots of the conv-input ring; a power of two >= MAX_ROWS + kernel - 1
assert CONV_RING >= MAX_ROWS + 3


def extra_defines(cfg: ModelConfig) -> dict[str, int | str]:
    """The numerics macros gdn.cuh needs beyond the config defines."""
    qdiv = float(np.float32(cfg.linear_key_head_dim ** 0.5))
    return {"QMK_MAX_ROWS": MAX_ROWS, "QMK_CONV_RING": CONV_RING, "QMK_GDN_QDIV": qdiv.hex() + "f"}


def module(cfg: ModelConfig):
    """The compiled gdn.cu module for this config (cached per process)."""
    return load_module(cfg, SOURCES, extra_defines(cfg))


# ---------------------------------------------------------------- layout converters (NumPy or CuPy arrays)
def _xp(a):
    try:
        import cupy as cp
        return cp.get_array_module(a)
    except ImportError:  # pragma: no cover
        return np


def state_to_ref(state):
    """GPU state [n_v, d_v, d_k] fp32 → reference [n_v, d_k, d_v] fp32 (a transposed copy)."""
    return _xp(state).ascontiguousarray(state.transpose(0, 2, 1))


def state_from_ref(ref):
    """Reference state [n_v, d_k, d_v] fp32 → GPU layout [n_v, d_v, d_k] fp32."""
    return _xp(ref).ascontiguousarray(ref.transpose(0, 2, 1))


def ring_from_ref(conv_state, pos: int):
    """Reference conv state [conv_dim, 3] (last three inputs, oldest first, bf16 bits) at position ``pos`` (tokens
    processed) → ring [CONV_RING, conv_dim]: input of position p in slot p % CONV_RING (other slots zero)."""
    xp = _xp(conv_state)
    C, k1 = conv_state.shape
    ring = xp.zeros((CONV_RING, C), dtype=conv_state.dtype)
    for t in range(k1):
        p = pos - k1 + t
        if p >= 0:
            ring[p % CONV_RING] = conv_state[:, t]
    return ring


def ring_to_ref(ring, pos: int, kernel: int = 4):
    """Ring [CONV_RING, conv_dim] at position ``pos`` → reference conv state [conv_dim, kernel-1], oldest first
    (zeros for positions before 0)."""
    xp = _xp(ring)
    out = xp.zeros((ring.shape[1], kernel - 1), dtype=ring.dtype)
    for t in range(kernel - 1):
        p = pos - (kernel - 1) + t
        if p >= 0:
            out[:, t] = ring[p % CONV_RING]
    return out


class GdnDecode:
    """The fused GDN decode step of one layer for M ≤ MAX_ROWS rows at positions pos..pos+M-1.

    Weights (bf16 bits, uint16): ``w_a``, ``w_b`` [n_v, hidden]; ``a_log``, ``dt_bias`` [n_v];
    ``conv_w`` [conv_dim, 4] (or [conv_dim, 1, 4]); ``norm_w`` [d_v]. Kept by reference; checked here once.
    ``pdl``: launch with programmatic stream serialization (``discrete.launch``; same bits).
    """

    def __init__(self, cfg: ModelConfig, w_a, w_b, a_log, dt_bias, conv_w, norm_w, pdl: bool = False):
        self.cfg = cfg
        nv, h = cfg.linear_num_value_heads, cfg.hidden_size
        check_array(w_a, "gdn.in_proj_a", np.uint16, (nv, h))
        check_array(w_b, "gdn.in_proj_b", np.uint16, (nv, h))
        check_array(a_log, "gdn.A_log", np.uint16, (nv,), align=2)
        check_array(dt_bias, "gdn.dt_bias", np.uint16, (nv,), align=2)
        need(conv_w.size == cfg.gdn_conv_dim * 4, f"gdn.conv1d.weight: expected {cfg.gdn_conv_dim}x4 values, got {conv_w.shape}")
        check_array(conv_w, "gdn.conv1d.weight", np.uint16)
        check_array(norm_w, "gdn.norm.weight", np.uint16, (cfg.linear_value_head_dim,))
        self.w = (w_a, w_b, a_log, dt_bias, conv_w, norm_w)
        self.kernel, = kernels(module(cfg), ("qmk_gdn_decode",), pdl)

    def __call__(self, qkv, z, hn, ring, state, out, pos_dev, M: int) -> None:
        """Launch. qkv [M, conv_dim], z [M, value_dim], hn [M, hidden] (normed hidden), out [M, value_dim]: bf16
        bits; ring [CONV_RING, conv_dim] bf16 bits; state [n_v, d_v, d_k] fp32 (updated in place); pos_dev: a
        device int32 holding the position of row 0 (e.g. the control block's ``pos``). Raises ValueError."""
        cfg = self.cfg
        need(1 <= M <= MAX_ROWS, f"gdn: M={M} not in [1, {MAX_ROWS}]")
        check_array(qkv, "gdn.qkv", np.uint16)
        need(qkv.shape[-1] == cfg.gdn_conv_dim and qkv.size >= M * cfg.gdn_conv_dim, f"gdn.qkv: shape {qkv.shape}")
        check_array(z, "gdn.z", np.uint16)
        need(z.shape[-1] == cfg.gdn_value_dim and z.size >= M * cfg.gdn_value_dim, f"gdn.z: shape {z.shape}")
        check_array(hn, "gdn.hn", np.uint16)
        need(hn.shape[-1] == cfg.hidden_size and hn.size >= M * cfg.hidden_size, f"gdn.hn: shape {hn.shape}")
        check_array(out, "gdn.out", np.uint16)
        need(out.shape[-1] == cfg.gdn_value_dim and out.size >= M * cfg.gdn_value_dim, f"gdn.out: shape {out.shape}")
        check_array(ring, "gdn.conv_ring", np.uint16, (CONV_RING, cfg.gdn_conv_dim))
        check_array(state, "gdn.state", np.float32,
                    (cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim))
        check_array(pos_dev, "gdn.pos", pos_dev.dtype, align=4)
        need(pos_dev.dtype in (np.int32, np.uint32), f"gdn.pos: expected int32/uint32, got {pos_dev.dtype}")
        w_a, w_b, a_log, dt_bias, conv_w, norm_w = self.w
        self.kernel((cfg.linear_num_value_heads,), (THREADS,),
                    (qkv, z, hn, w_a, w_b, a_log, dt_bias, conv_w, norm_w, ring, state, out, pos_dev, np.int32(M)))
