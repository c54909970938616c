"""Dense row-wise reference ops: embedding gather, the RMSNorms, the GEMV family, residual add and argmax.

The leaf of ``assembler.ref``: attention, GDN, sampling and MTP build on these ops and import them from here;
``assembler.ref.ops`` re-exports them with the rest (the dtype and rounding conventions are stated there).
"""
from __future__ import annotations

import numpy as np

from assembler.numerics import K_BLOCK, split_blocks, split_k
from assembler.ref.numerics import BF16, FP8, bf16, f32, f64, need, need_dtype, silu64

# Temporaries of the float64 GEMV are cut into row chunks of at most this many elements (27B lm_head safe).
_CHUNK_ELEMS = 1 << 22


def embed(table: np.ndarray, ids) -> np.ndarray:
    """Embedding gather: ``table[ids]``. table [V, H] bf16, ids int [M] → [M, H] bf16 (exact copy).

    Raises ValueError for ids outside [0, V)."""
    need_dtype(table, BF16, "embed: table")
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    need(bool(np.all((ids >= 0) & (ids < table.shape[0]))), f"embed: ids must lie in [0, {table.shape[0]}), got {ids}")
    return table[ids].copy()


def _inv_rms(xf: np.ndarray, eps: float) -> np.ndarray:
    """fp32 rsqrt(mean(x²) + eps) over the last axis; the mean is summed in float64 and rounded to fp32."""
    var = np.mean(xf.astype(np.float64) ** 2, axis=-1, keepdims=True).astype(np.float32)
    return (1.0 / np.sqrt((var + np.float32(eps)).astype(np.float64))).astype(np.float32)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Zero-centred RMSNorm (``Qwen3_5RMSNorm``): ``bf16(fp32(x·rsqrt(mean x² + eps)) · (1 + fp32(w)))``.

    x [..., D] bf16, w [D] bf16 → bf16 [..., D]. Also the per-head q/k norm (x [..., heads, head_dim])."""
    need_dtype(x, BF16, "rmsnorm: x")
    need_dtype(w, BF16, "rmsnorm: w")
    need(x.shape[-1] == w.shape[-1], lambda: f"rmsnorm: x last dim {x.shape[-1]} != w {w.shape}")
    xf = f32(x)
    y = (xf * _inv_rms(xf, eps)).astype(np.float32)
    return bf16(y * (np.float32(1.0) + f32(w)))


def rmsnorm_gated(x: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """GDN output norm (``Qwen3_5RMSNormGated``, norm before gate, plain w):
    ``n = bf16(x·rsqrt(mean x² + eps)); n = bf16(w·n); out = bf16(fp32(n) · silu(fp32(z)))``.

    x, z [..., d_v] bf16, w [d_v] bf16 → bf16 [..., d_v]."""
    for a, nm in ((x, "x"), (z, "z"), (w, "w")):
        need_dtype(a, BF16, f"rmsnorm_gated: {nm}")
    need(x.shape == z.shape and x.shape[-1] == w.shape[-1], lambda: f"rmsnorm_gated: shapes x{x.shape} z{z.shape} w{w.shape}")
    xf = f32(x)
    n = bf16(xf * _inv_rms(xf, eps))
    n = bf16(f32(w) * f32(n))
    return bf16(f32(n) * silu64(f32(z)))


def _rows(rows, n: int) -> np.ndarray:
    if rows is None:
        return np.arange(n)
    if isinstance(rows, slice):
        return np.arange(n)[rows]
    r = np.asarray(rows, dtype=np.int64).reshape(-1)
    need(r.size == 0 or (r.min() >= 0 and r.max() < n), f"gemv: rows out of range [0, {n})")
    return r


def gemv_partial(w: np.ndarray, scale: np.ndarray | None, x: np.ndarray, rows, split: int, s: int) -> np.ndarray:
    """Split ``s`` of ``split`` of a block-scaled projection, for output ``rows`` (INTERFACES §2).

    w [N, K] fp8 e4m3 (scale [ceil(N/128), K/128] bf16) or bf16 (scale None, i.e. 1); x [M, K] bf16. w may also be
    float64 holding exactly the widened stored values (``widen``; the model caches these for speed).
    Per row and K-block kb of the split: ``d = fp32(Σ_128 exact products, summed in float64)``,
    ``acc = fp32(acc + fp32(fp32(scale[n//128, kb]) · d))`` in block order. Returns fp32 [M, len(rows)].
    Raises ValueError on dtype/shape mismatch or K not a multiple of 128."""
    need(w.ndim == 2 and x.ndim == 2 and w.shape[1] == x.shape[1], lambda: f"gemv: w {w.shape} and x {x.shape} must be [N,K], [M,K]")
    need_dtype(x, BF16, "gemv: x")
    N, K = w.shape
    need(K % K_BLOCK == 0, lambda: f"gemv: K={K} is not a multiple of {K_BLOCK}")
    wd = w.dtype if w.dtype != np.float64 else (FP8 if scale is not None else BF16)  # pre-widened weights
    if wd == FP8:
        need(scale is not None and scale.dtype == BF16 and scale.shape == (-(-N // 128), K // 128),
             f"gemv: fp8 weight [{N},{K}] needs a bf16 scale of shape {(-(-N // 128), K // 128)}, got "
             f"{None if scale is None else (scale.shape, scale.dtype)}")
    else:
        need(wd == BF16 and scale is None, lambda: f"gemv: weight must be fp8 with scale or bf16 without, got {w.dtype}")
    need(0 <= s < split and (K // K_BLOCK) % split == 0, lambda: f"gemv: split {s} of {split} invalid for K={K}")
    r = _rows(rows, N)
    contiguous = r.size > 0 and r[-1] - r[0] + 1 == r.size and bool(np.all(np.diff(r) == 1))
    kbs = split_blocks(K, split, s)
    nb, M, k0, k1 = len(kbs), x.shape[0], kbs.start * K_BLOCK, kbs.stop * K_BLOCK
    xs = np.ascontiguousarray(f64(x[:, k0:k1]).reshape(M, nb, K_BLOCK).transpose(1, 0, 2))  # [nb, M, 128]
    out = np.empty((M, r.size), np.float32)
    step = max(1, _CHUNK_ELEMS // max(1, nb * K_BLOCK))
    for c0 in range(0, r.size, step):
        rc = r[c0:c0 + step]
        wsel = w[rc[0]:rc[-1] + 1, k0:k1] if contiguous else w[rc, k0:k1]
        wc = f64(wsel).reshape(rc.size, nb, K_BLOCK)                      # view when w is pre-widened
        # [nb, M, R] fp32 block dots: one 2-D float64 BLAS product per 128-block
        d = np.stack([xs[b] @ wc[:, b].T for b in range(nb)]).astype(np.float32)
        if scale is not None:
            sc = f32(scale[rc // 128][:, kbs.start:kbs.stop]).T            # [nb, R]
            d = (sc[:, None, :] * d).astype(np.float32)
        acc = d[0].copy()
        for b in range(1, nb):
            acc = (acc + d[b]).astype(np.float32)
        out[:, c0:c0 + rc.size] = acc
    return out


def dequantize_bf16(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """bf16(fp32(w) · fp32(scale[n//128, k//128])): transformers' up-front fp8 dequantisation (``Fp8Dequantize``).
    w [N, K] fp8, scale bf16 → bf16 [N, K]."""
    need_dtype(w, FP8, "dequantize_bf16: w")
    s = np.repeat(np.repeat(f32(scale), 128, 0), 128, 1)[:w.shape[0], :w.shape[1]]
    return bf16(f32(w) * s)


def widen(w: np.ndarray) -> np.ndarray:
    """Exact float64 copy of a stored fp8/bf16 weight, accepted by the GEMV ops in place of ``w``."""
    return np.ascontiguousarray(f64(w))


def _reduce(p: np.ndarray) -> np.ndarray:
    y = p[0].astype(np.float32).copy()
    for s in range(1, p.shape[0]):
        y = (y + p[s]).astype(np.float32)
    return y


def gemv_reduce(partials: np.ndarray, epilogue: str = "store", residual: np.ndarray | None = None,
                up_partials: np.ndarray | None = None) -> np.ndarray:
    """Fixed-order split-K reduce ``y = P[0]; y = fp32(y + P[s])`` and epilogue → bf16 [M, R].

    partials [S, M, R] fp32. Epilogues (INTERFACES §2): ``store`` → bf16(y); ``residual`` (residual [M, R] bf16)
    → bf16(fp32(bf16(y)) + fp32(r)); ``swiglu`` (up_partials [S, M, R] for the up rows of the same outputs)
    → bf16(fp32(bf16(silu(fp32(bf16(g))))) · fp32(bf16(u))). Raises ValueError for a bad epilogue/shape."""
    partials = np.asarray(partials)
    need(partials.ndim == 3 and partials.dtype == np.float32, lambda: f"gemv_reduce: partials must be fp32 [S,M,R], got {partials.dtype} {partials.shape}")
    y = _reduce(partials)
    if epilogue == "store":
        return bf16(y)
    if epilogue == "residual":
        need(residual is not None and residual.shape == y.shape, lambda: f"gemv_reduce: residual must be bf16 {y.shape}")
        need_dtype(residual, BF16, "gemv_reduce: residual")
        return bf16(f32(bf16(y)) + f32(residual))
    if epilogue == "swiglu":
        need(up_partials is not None and np.shape(up_partials) == partials.shape,
             f"gemv_reduce: swiglu needs up_partials of shape {partials.shape}")
        u = _reduce(np.asarray(up_partials, dtype=np.float32))
        return bf16(f32(bf16(silu64(f32(bf16(y))))) * f32(bf16(u)))
    raise ValueError(f"gemv_reduce: unknown epilogue {epilogue!r}; expected 'store', 'residual' or 'swiglu'")


def gemv(w: np.ndarray, scale: np.ndarray | None, x: np.ndarray, epilogue: str = "store",
         residual: np.ndarray | None = None, split: int | None = None) -> np.ndarray:
    """Whole projection built from :func:`gemv_partial` + :func:`gemv_reduce`. x [M, K] bf16 → bf16.

    ``store``/``residual``: w [N, K] → [M, N]. ``swiglu``: w is the fused [gate; up] matrix [2F, K] (gate row n,
    up row F + n) → [M, F]. ``split`` defaults to ``split_k(N, K)`` of the matrix as given (fused rows count)."""
    N, K = w.shape
    S = split_k(N, K) if split is None else split
    if epilogue == "swiglu":
        need(N % 2 == 0, lambda: f"gemv: swiglu weight must have an even row count, got {N}")
        F = N // 2
        g = np.stack([gemv_partial(w, scale, x, np.arange(F), S, s) for s in range(S)])
        u = np.stack([gemv_partial(w, scale, x, np.arange(F, N), S, s) for s in range(S)])
        return gemv_reduce(g, "swiglu", up_partials=u)
    p = np.stack([gemv_partial(w, scale, x, None, S, s) for s in range(S)])
    return gemv_reduce(p, epilogue, residual=residual)


def residual_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """bf16 + bf16 as torch does it: bf16(fp32(a) + fp32(b))."""
    need_dtype(a, BF16, "residual_add: a")
    need_dtype(b, BF16, "residual_add: b")
    return bf16(f32(a) + f32(b))


def argmax(logits: np.ndarray, n_valid: int | None = None) -> np.ndarray:
    """Greedy token per row: the largest logit, lowest id on ties. logits [M, V] or [V] (bf16 or fp32) → int64
    [M] (or scalar for 1-D input). ``n_valid``: only ids below it compete (the engine's greedy step passes
    ``FIRST_PADDING_ID``: padding rows are never chosen, as in the lm_head kernel). NaN logits raise ValueError."""
    lf = f32(logits)
    if n_valid is not None:
        need(0 < n_valid <= lf.shape[-1], f"argmax: n_valid={n_valid} outside 1..{lf.shape[-1]}")
        lf = lf[..., :n_valid]
    need(not np.isnan(lf).any(), "argmax: logits contain NaN")
    return np.argmax(lf, axis=-1).astype(np.int64)  # numpy returns the first occurrence of the maximum
