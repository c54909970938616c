"""Building the megakernel module: the host structs it reads (``MkParams``, weight and layer tables, as NumPy
dtypes whose sizes the kernel's ``mk_layout`` probe confirms), the ``QMK_*`` defines of its translation unit, the
shared-memory budget that sets the GEMV ring depth, and the compile (NVRTC through ``discrete.build``, cached on
disk by CuPy). The runner's default build choices are applied by ``megakernel.runner.mk_defines``; here every
choice is an argument.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

from assembler.numerics import MAX_ROWS
from discrete import attention, gdn
from discrete.build import load_module, nvrtc_options, translation_unit
from loader.config import ModelConfig

MK_DIR = Path(__file__).resolve().parent
SOURCE = MK_DIR / "megakernel.cu"
COUNTER_SEED = 0xFFFFFF00  # counters start near the uint32 wrap: the wait arithmetic must be wrap-safe
SMEM_LIMIT = 232448  # dynamic shared memory per block on sm_90 (227 KB)
RING_MAX = 3         # GEMV ring slots per warp at most (gemv.cuh supports ≤ 8; 6 measured 2 ms slower)
PREFETCH = 1         # QMK_MK_PREFETCH: a GEMV issues its first RING - 1 ring units before waiting for its input

_P = [(n, "<u8") for n in ("prog", "lens", "counters", "bufs", "weights", "layers", "embed", "ctrl", "page_table",
                           "inv_freq", "host", "mirror", "timing", "keys")]
PARAMS_DTYPE = np.dtype(_P + [("page_stride", "<i8"), ("max_len", "<i4"), ("att_cap", "<i4"), ("n_steps", "<i4"),
                              ("persistent", "<i4"), ("seed", "<u4"), ("step_base", "<u4"), ("delay_op", "<i4"),
                              ("delay_ns", "<i4")], align=True)
WEIGHT_DTYPE = np.dtype([("ptr", "<u8"), ("scale", "<u8"), ("rows", "<i4"), ("cols", "<i4"), ("fp8", "<i4"),
                         ("pad", "<i4")], align=True)
LAYER_DTYPE = np.dtype([("t", "<u8", (8,))])


def _mk_sources_hash() -> str:
    h = hashlib.sha256()
    for p in sorted(MK_DIR.rglob("*.cu*")) + sorted((MK_DIR / "include").glob("*.h")):
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def kernel_defines(cfg: ModelConfig, *, timing: bool, extra: dict | None, fuse_reduce: bool, m1: bool) -> dict:
    """Extra ``QMK_*`` defines of megakernel.cu: the numerics macros of gdn.cuh / attention.cuh (from their
    launchers, so both paths compile the same code), the MkParams layout offsets (checked by static_assert),
    and a hash of the megakernel sources (so an edited header never reuses a stale cached module). Build
    knobs that never change a result: ``fuse_reduce`` (whether the fused split-K tail is compiled into the
    GEMV instruction; a program that uses it needs it), ``m1`` (tiles built for M = 1; a program of more rows
    traps with error 5), ``timing`` (``QMK_MK_TIMING``: globaltimer stamps per instruction), ring depth and GEMV
    prefetch (``extra`` overrides)."""
    d = {**gdn.extra_defines(cfg), **attention.extra_defines(cfg)}
    d.update({"QMK_MKP_SIZE": PARAMS_DTYPE.itemsize, "QMK_MKP_OFF_PAGE_STRIDE": PARAMS_DTYPE.fields["page_stride"][1],
              "QMK_MKP_OFF_SEED": PARAMS_DTYPE.fields["seed"][1], "QMK_MKP_OFF_DELAY_NS": PARAMS_DTYPE.fields["delay_ns"][1],
              "QMK_MKW_SIZE": WEIGHT_DTYPE.itemsize, "QMK_MKL_SIZE": LAYER_DTYPE.itemsize,
              "QMK_MK_SRC": "0x" + _mk_sources_hash()})
    d["QMK_MK_SMEM_LIMIT"] = SMEM_LIMIT
    d["QMK_MK_RING"] = ring_slots(cfg)
    d["QMK_MK_FUSE_REDUCE"] = int(bool(fuse_reduce))
    d["QMK_MK_PREFETCH"] = PREFETCH
    d["QMK_MK_M1"] = int(bool(m1))  # GEMV tiles built for M = 1 (1-row programs; measured faster)
    if timing:
        d["QMK_MK_TIMING"] = 1
    d.update(extra or {})  # build knobs (e.g. QMK_MK_RING); results never depend on them
    if d.get("QMK_MK_RING", 0) < 2:
        d["QMK_MK_PREFETCH"] = 0  # the prefetch fills the shared-memory ring
    return d


def ring_slots(cfg: ModelConfig) -> int:
    """GEMV weight-ring slots per warp (2 KB each, 16 warps), at most RING_MAX, that fit beside the normed-input
    buffer and the union scratch in SMEM_LIMIT (an upper estimate of the scratch, the GDN's silu(z) rows included;
    the kernel static_asserts the total)."""
    nkb = cfg.hidden_size // 128
    gdn_b = 2 * MAX_ROWS * 128 * 4 * 2 + MAX_ROWS * 2 * nkb * 4 + 64 + MAX_ROWS * 128 * 4 + (MAX_ROWS + 1) * 32 * 16
    att = MAX_ROWS * cfg.gqa_group * 4 * 2 + cfg.gqa_group * cfg.head_dim * 8 + 2 * cfg.gqa_group * 256 * 2
    base = MAX_ROWS * cfg.hidden_size * 2 + max(gdn_b, att, MAX_ROWS * 2 * 256 * 4) + 1024
    return int(min(RING_MAX, max(0, (SMEM_LIMIT - base) // (16 * 2048))))


def load(cfg: ModelConfig, defines: dict):
    """The cooperative megakernel module of ``defines`` (:func:`kernel_defines`), compiled
    (``discrete.build.load_module``). The generated isa.h / control.h include <cuda/std/cstdint>; should this
    NVRTC not find it on its own, compile once more with CuPy's bundled CCCL include directories added (same
    source text, so the same code). Raises what the compiler raises."""
    try:
        mod = load_module(cfg, [str(SOURCE)], defines, cooperative=True)
        mod.compile()
        return mod
    except Exception as e:
        if "cuda/std" not in str(e):
            raise
        import cupy  # deferred: CuPy loads only where a module is compiled
        from cupy._core.core import _get_cccl_include_options
        print(f"megakernel: NVRTC did not find <cuda/std/...>; retrying with CuPy's CCCL includes", file=sys.stderr)
        code = translation_unit(cfg, [str(SOURCE)], defines)
        mod = cupy.RawModule(code=code, options=nvrtc_options() + tuple(_get_cccl_include_options()),
                             backend="nvrtc", enable_cooperative_groups=True)
        mod.compile()
        return mod
