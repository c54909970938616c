"""Numerics of the prefill GEMM (``discrete/kernels/gemm.cuh``) for its CPU and GPU tests: the reference on a
subset of output columns, the tolerance against it, and a NumPy emulation of the kernel's tile and
accumulation order (docs/kernels-gemm.md).

The reference op is the GEMV's (``assembler.ref.ops.gemv_partial`` + ``gemv_reduce``): the GEMM computes the
same function with the same split-K order, so there is one reference for both.

Tolerance ``GEMM_TOL`` (the GEMV family's, tests/gpu/test_gemv.py): per output, one bf16 ulp of the reference,
or 2^-16 · RMS(reference row) where that is larger. Why: the reference rounds each 128-wide K-block's exact
(float64) sum to fp32; the tensor core sums the same 128 exact products in 8 chained mma steps of 16, each
rounded to fp32, so a block's d differs by a few fp32 ulps of the block's terms (≲ 8 · 2^-24 · Σ|x·w| per
block). The block folds and split-K adds are the same fp32 operations in the same order on both sides, so the
fp32 results differ by a few parts in 2^24 of Σ|x·w·s|, far below one bf16 ulp (2^-8 relative) except where the
value sits next to a bf16 rounding boundary (then one ulp) or cancels to near zero (then the RMS floor, which
for K ≤ 17408 random terms is ≳ 2^8 times the accumulation bound). The negative controls (a scale block moved,
one weight changed) must fail it.
"""
from __future__ import annotations

import numpy as np

from assembler.numerics import K_BLOCK, split_k
from assembler.ref import ops as ref
from assembler.ref.numerics import BF16, FP8, bf16, f32, f64, silu64
from discrete import gemm

RMS_FLOOR = 2.0 ** -16  # GEMM_TOL's absolute floor, relative to the RMS of the reference row


def bf16_ulp(r: np.ndarray) -> np.ndarray:
    """Spacing of bf16 numbers at |r| (float64)."""
    _, e = np.frexp(np.abs(r).astype(np.float64))
    return np.where(r == 0, 2.0 ** -133, np.ldexp(1.0, e - 8))


def close_mask(got_u16: np.ndarray, want: np.ndarray) -> np.ndarray:
    """GEMM_TOL: True where got (bf16 bits) is within one bf16 ulp of want (bf16), or within RMS_FLOOR · RMS of
    want's row. NaN is never close."""
    g = f32(np.ascontiguousarray(got_u16).view(BF16)).astype(np.float64)
    w = f32(want).astype(np.float64)
    rms = np.sqrt(np.mean(w * w, axis=-1, keepdims=True))
    return np.abs(g - w) <= np.maximum(bf16_ulp(w), RMS_FLOOR * rms)


def assert_close(got_u16, want, what: str) -> None:
    ok = close_mask(got_u16, want)
    if not ok.all():
        i = tuple(int(v) for v in np.argwhere(~ok)[0])
        raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.size} outside GEMM_TOL; first at {i}: "
                             f"got {f32(np.ascontiguousarray(got_u16).view(BF16))[i]!r}, want {f32(want)[i]!r}")


def reference(w, scale, x, epilogue: str = "store", split: int | None = None, residual=None, cols=None):
    """The reference projection (the GEMV's op) on output columns ``cols`` (default all): bf16 [M, len(cols)].
    swiglu: cols are output features f < F (gate row f, up row F + f); residual: ``residual`` [M, N] bf16."""
    N, K = w.shape
    S = split_k(N, K) if split is None else int(split)
    n_out = N // 2 if epilogue == "swiglu" else N
    cols = np.arange(n_out) if cols is None else np.asarray(cols, np.int64)
    part = lambda rows: np.stack([ref.gemv_partial(w, scale, x, rows, S, s) for s in range(S)])
    if epilogue == "swiglu":
        return ref.gemv_reduce(part(cols), "swiglu", up_partials=part(n_out + cols))
    r = None if residual is None else np.ascontiguousarray(residual[:, cols])
    return ref.gemv_reduce(part(cols), epilogue, residual=r)


# ---------------------------------------------------------------- emulation of the kernel's order
def step_columns() -> np.ndarray:
    """int [8, 16]: the K-block columns of mma step t in its k-slot order (slot 2c, 2c+1 ↔ columns b, b+1;
    slot 8+2c, 9+2c ↔ b+2, b+3 with b = 64·(t/4) + 16c + 4·(t%4)), the GEMV's permutation."""
    out = np.empty((8, 16), np.int64)
    for t in range(8):
        for c in range(4):
            b = 64 * (t // 4) + 16 * c + 4 * (t % 4)
            out[t, 2 * c:2 * c + 2] = (b, b + 1)
            out[t, 8 + 2 * c:10 + 2 * c] = (b + 2, b + 3)
    return out


WN = 32  # warp tile rows of gemm.cu's QmkGemmT (4 warps along n); the swiglu pairing depends on it


def tile_rows(p: gemm.GemmPlan, tn: int) -> np.ndarray:
    """Weight rows of tile tn's BN rows, in tile order (qmk_gemm_wrow)."""
    r = np.arange(gemm.BN)
    if p.epilogue != "swiglu":
        return tn * gemm.BN + r
    w, q, half = r // WN, r % WN, WN // 2
    feat = tn * (gemm.BN // 2) + w * half + np.where(q < half, q, q - half)
    return np.where(q < half, feat, p.N // 2 + feat)


def _block_d(xb: np.ndarray, wb: np.ndarray, mode: str) -> np.ndarray:
    """fp32 [M, R] sum of one K-block (xb [M, 128], wb [R, 128] float64): "block" = the reference's float64
    sum rounded once; "steps" = 8 chained steps of 16 products, each rounded to fp32 (the mma's granularity)."""
    if mode == "block":
        return (xb @ wb.T).astype(np.float32)
    d = np.zeros((xb.shape[0], wb.shape[0]), np.float32)
    for cols in step_columns():
        d = (d.astype(np.float64) + xb[:, cols] @ wb[:, cols].T).astype(np.float32)
    return d


def emulate(w, scale, x, epilogue: str = "store", split: int | None = None, residual=None, tiles=None,
            mode: str = "block") -> tuple[np.ndarray, np.ndarray]:
    """The kernel's computation in NumPy, tile by tile: tile rows (swiglu pairing), each 16-row sub-tile's
    scale row, rows ≥ M read as row M-1, per-K-block d (``mode``, see _block_d), the fold
    acc = fp32(acc + fp32(s · d)), split-K totals, the epilogue. ``tiles``: weight-row tiles to run (default
    all). Returns (output columns, bf16 [M, len(columns)]) for those tiles."""
    N, K = w.shape
    p = gemm.plan(N, K, epilogue, split)
    M, nkb = x.shape[0], K // K_BLOCK
    Mp = -(-M // gemm.BM) * gemm.BM
    xp = f64(x)[np.minimum(np.arange(Mp), M - 1)]  # [Mp, K]: the clamped rows of the last m-tile
    w64 = f64(w)
    cols, outs = [], []
    for tn in (range(p.n_tiles) if tiles is None else tiles):
        rows = tile_rows(p, tn)
        srow = rows[(np.arange(gemm.BN) // 16) * 16] // 128  # scale row of each row's 16-row sub-tile
        wt = w64[rows]
        acc = np.zeros((Mp, gemm.BN), np.float32)
        total = None
        for kb in range(nkb):
            k0 = kb * K_BLOCK
            d = _block_d(xp[:, k0:k0 + K_BLOCK], wt[:, k0:k0 + K_BLOCK], mode)
            sc = f32(scale[srow, kb])
            acc = (acc + (sc[None, :] * d).astype(np.float32)).astype(np.float32)
            if (kb + 1) % p.per == 0 and kb + 1 < nkb:
                total = acc if total is None else (total + acc).astype(np.float32)
                acc = np.zeros_like(acc)
        y = acc if total is None else (total + acc).astype(np.float32)
        y = y[:M]
        if epilogue == "swiglu":
            gate = (np.arange(gemm.BN) % WN) < WN // 2
            gv, uv = f32(bf16(y[:, gate])), f32(bf16(y[:, np.flatnonzero(gate) + WN // 2]))
            cols.append(rows[gate])
            outs.append(bf16(f32(bf16(silu64(gv))) * uv))
        else:
            cols.append(rows)
            outs.append(bf16(y) if epilogue == "store" else bf16(f32(bf16(y)) + f32(residual[:, rows])))
    return np.concatenate(cols), np.concatenate(outs, axis=1)


def shapes(cfg):
    """(name, N, K, epilogue) of the fp8 projections the prefill GEMM runs, fused as the decode graph fuses them
    (gdn_in = in_proj_qkv | in_proj_z, attn_in = q | k | v, gate_up = gate | up), and the parts alone."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    return [("gate_up", 2 * f, h, "swiglu"), ("down", h, f, "residual"),
            ("gdn_in", cfg.gdn_conv_dim + cfg.gdn_value_dim, h, "store"), ("gdn_qkv", cfg.gdn_conv_dim, h, "store"),
            ("gdn_z", cfg.gdn_value_dim, h, "store"), ("gdn_out", h, cfg.gdn_value_dim, "residual"),
            ("attn_in", cfg.q_proj_rows + 2 * cfg.kv_rows, h, "store"), ("attn_q", cfg.q_proj_rows, h, "store"),
            ("attn_kv", cfg.kv_rows, h, "store"), ("attn_o", h, cfg.attn_out_dim, "residual")]


def rand_fp8(rng, n: int, k: int) -> np.ndarray:
    """Random e4m3 weights (every finite code; no NaN codes: checkpoints never hold them)."""
    b = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] &= 0xFE
    return b.view(FP8)


def rand_scale(rng, n: int, k: int) -> np.ndarray:
    return (rng.uniform(0.5, 2.0, size=(n // 128, k // 128)) * 2.0 ** -9).astype(np.float32).astype(BF16)


def rand_bf16(rng, shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(BF16)
