"""Launch code for the prefill projection GEMM (``kernels/gemm.cu``): fp8 block-scaled weights in the checkpoint
layout times M bf16 activation rows, with the GEMV family's epilogues (store, residual, swiglu), bit-identical
per row to :class:`discrete.gemv.Gemv` at the same split-K factor (docs/kernels-gemm.md).

Device arrays are CuPy arrays holding bit patterns (bf16 as ``uint16``, fp8 e4m3 as ``uint8``), the layout
``discrete.weights_gpu`` uploads (no second copy of the weights). A launch goes to the current CuPy stream and
allocates nothing, so it can be captured into a CUDA graph.

The contract (:func:`plan`, :func:`check_operands`) is plain Python over shapes, dtypes, strides and addresses,
so it is checked the same way with or without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from assembler.numerics import K_BLOCK, split_k
from discrete.build import load_module
from discrete.launch import Kernel
from loader.config import ModelConfig

SOURCES = ("gemm.cu",)
EPILOGUES = ("store", "residual", "swiglu")
BN = 128        # weight rows per tile (gemm.cu QmkGemmT); swiglu: BN/2 gate rows + the matching BN/2 up rows
BM = 128        # activation rows per tile
THREADS = 256   # 8 warps as 4 (n) x 2 (m), warp tile 32 x 64
STAGES = 3      # QMK_GEMM_STAGES of kernels/gemm.cuh
STAGE_BYTES = BN * K_BLOCK + BM * K_BLOCK * 2  # one K-block of W (fp8) and X (bf16)
TOTAL_BYTES = BN * BM * 4                      # split-K running totals (fp32, one per output of the tile)
INT32_MAX = 2**31 - 1                          # the kernel's row offsets are int · K (size_t only where needed)
NULL = np.uint64(0)                            # a null pointer argument


@dataclass(frozen=True)
class GemmPlan:
    """The launch geometry of one projection: ``N`` weight rows, ``K`` columns, ``split`` = the GEMV's split-K
    factor S, ``per`` = K-blocks per split as the kernel runs it (S = 1 and S = K/128 give the same bits and
    run as one split), ``n_out`` output columns, ``n_tiles`` weight-row tiles, ``smem`` dynamic shared bytes."""
    N: int
    K: int
    epilogue: str
    split: int
    per: int
    n_out: int
    n_tiles: int
    smem: int

    def grid(self, M: int) -> int:
        """Blocks of a launch over M rows: one per (weight-row tile, activation-row tile)."""
        return self.n_tiles * (-(-M // BM))

    def flops(self, M: int) -> int:
        return 2 * M * self.N * self.K


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def plan(N: int, K: int, epilogue: str = "store", split: int | None = None, name: str = "gemm") -> GemmPlan:
    """Check a projection's shape against the kernel's contract and return its :class:`GemmPlan`.

    N (rows of the weight as stored, gate|up fused for swiglu) a multiple of 128 (swiglu: N = 2F, F a multiple
    of 64, so a tile holds 64 gate rows and their 64 up rows); K a multiple of 128; ``split`` (default
    ``split_k(N, K)``, the GEMV's rule) must divide K/128. Raises ValueError naming ``name``."""
    N, K = int(N), int(K)
    _need(epilogue in EPILOGUES, f"{name}: epilogue {epilogue!r} not one of {list(EPILOGUES)}")
    _need(K > 0 and K % K_BLOCK == 0, f"{name}: K={K} must be a positive multiple of {K_BLOCK}")
    if epilogue == "swiglu":
        _need(N > 0 and N % BN == 0, f"{name}: swiglu needs N = 2F rows with F a multiple of {BN // 2}, got N={N}")
    else:
        _need(N > 0 and N % BN == 0, f"{name}: N={N} must be a positive multiple of {BN}")
    _need(N * K <= INT32_MAX, f"{name}: N·K = {N * K} exceeds the kernel's 32-bit offsets")
    nkb = K // K_BLOCK
    S = split_k(N, K) if split is None else int(split)
    _need(S > 0 and nkb % S == 0, f"{name}: split={S} does not divide the {nkb} K-blocks")
    per = nkb // S
    if per == 1:  # one K-block per split: fp32(0 + t) = t up to the sign of zero, which no sum keeps: S = 1
        per = nkb
    n_out = N // 2 if epilogue == "swiglu" else N
    smem = STAGES * STAGE_BYTES + (TOTAL_BYTES if per < nkb else 0)
    return GemmPlan(N, K, epilogue, S, per, n_out, N // BN, smem)


def _addr(a) -> int:
    ptr = getattr(getattr(a, "data", None), "ptr", None)  # cupy.ndarray
    if ptr is None:
        ptr = getattr(getattr(a, "ctypes", None), "data", 0)  # numpy.ndarray
    return int(ptr)


def check_array(a, name: str, dtype, shape=None, align: int = 16) -> None:
    """Assert an array's dtype, C-contiguity, alignment and (optional) shape; ValueError names it. Accepts CuPy
    arrays (and NumPy arrays, for the contract tests); the launch itself needs CuPy arrays."""
    _need(hasattr(a, "dtype") and hasattr(a, "shape"), f"{name}: expected an array, got {type(a).__name__}")
    _need(a.dtype == np.dtype(dtype), f"{name}: expected dtype {np.dtype(dtype)}, got {a.dtype}")
    if shape is not None:
        _need(tuple(a.shape) == tuple(shape), f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")
    _need(a.flags.c_contiguous, f"{name}: must be C-contiguous")
    _need(_addr(a) % align == 0, f"{name}: must be {align}-byte aligned (address {_addr(a):#x})")


def check_weights(p: GemmPlan, w, scale, name: str = "gemm") -> None:
    """w uint8 [N, K] (fp8 bits), scale uint16 [N/128, K/128] (bf16 bits), both as weights_gpu stores them."""
    check_array(w, f"{name}.weight (fp8 bits)", np.uint8, (p.N, p.K))
    check_array(scale, f"{name}.weight_scale_inv (bf16 bits)", np.uint16, (p.N // 128, p.K // K_BLOCK), align=2)


def check_operands(p: GemmPlan, x, out, residual=None, name: str = "gemm") -> int:
    """Check one call's operands; returns M. x uint16 [M, K], M ≥ 1 (any M: rows past the last full tile are
    predicated); out uint16 [M, n_out]; residual uint16 [M, N] for the residual epilogue only (may be ``out``).
    Every row start is 16-byte aligned (K, N and n_out are multiples of 64)."""
    check_array(x, f"{name}: x (bf16 bits)", np.uint16)
    _need(x.ndim == 2 and x.shape[1] == p.K and x.shape[0] >= 1,
          f"{name}: x must be [M, {p.K}] with M ≥ 1, got {tuple(x.shape)}")
    M = int(x.shape[0])
    _need(M * p.K <= INT32_MAX, f"{name}: M·K = {M * p.K} exceeds the kernel's 32-bit offsets")
    check_array(out, f"{name}: out (bf16 bits)", np.uint16, (M, p.n_out))
    if p.epilogue == "residual":
        _need(residual is not None, f"{name}: the residual epilogue needs residual=")
        check_array(residual, f"{name}: residual (bf16 bits)", np.uint16, (M, p.N))
    else:
        _need(residual is None, f"{name}: residual given for epilogue {p.epilogue!r}")
    return M


def module(cfg: ModelConfig, defines: dict | None = None):
    """The compiled gemm.cu module for this config (cached per process)."""
    return load_module(cfg, SOURCES, defines)


class Gemm:
    """One projection ready to launch over any number of rows: ``out = epilogue(x · Wᵀ)``.

    ``w`` uint8 [N, K] fp8 bits and ``scale`` uint16 [N/128, K/128] bf16 bits (the device layout of
    ``discrete.weights_gpu.Proj``); ``epilogue`` "store" / "residual" (out [M, N]) or "swiglu" (fused
    [gate; up] of 2F rows, out [M, F]); ``split``: the split-K factor whose bits to reproduce (default
    ``split_k(N, K)``, the GEMV's; the decode graph passes its op's ``seg.split``). ``pdl``: launch with
    programmatic stream serialization (same bits). Raises ValueError naming the argument on any contract
    violation."""

    def __init__(self, cfg: ModelConfig, w, scale, *, epilogue: str = "store", split: int | None = None,
                 name: str = "gemm", pdl: bool = False):
        _need(getattr(w, "ndim", 0) == 2, f"{name}.weight: expected a 2-D array [N, K]")
        self.plan = plan(int(w.shape[0]), int(w.shape[1]), epilogue, split, name)
        check_weights(self.plan, w, scale, name)
        self.name, self.w, self.scale = name, w, scale
        raw = module(cfg).get_function(f"gemm_fp8_{epilogue}")
        if raw.max_dynamic_shared_size_bytes < self.plan.smem:
            raw.max_dynamic_shared_size_bytes = self.plan.smem
        self._kernel = Kernel(raw, bool(pdl), f"{name}.gemm")

    @property
    def split(self) -> int:
        return self.plan.split

    @property
    def n_out(self) -> int:
        return self.plan.n_out

    def __call__(self, x, out, residual=None):
        """x uint16 [M, K] → out uint16 [M, n_out] (``residual`` uint16 [M, N] for the residual epilogue, may be
        ``out`` itself). Returns ``out``."""
        p = self.plan
        M = check_operands(p, x, out, residual, self.name)
        n = np.int32
        self._kernel((p.grid(M),), (THREADS,),
                     (self.w, self.scale, x, n(M), n(p.N), n(p.K), n(p.per),
                      residual if residual is not None else NULL, out), shared_mem=p.smem)
        return out
