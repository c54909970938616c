"""Gated DeltaNet reference ops (spec §3.4; transformers 5.24 ``Qwen3_5GatedDeltaNet``,
``torch_recurrent_gated_delta_rule`` (decode) and ``torch_chunk_gated_delta_rule`` (prefill)).

Every fp32 op of the torch code is one rounding point here; reductions and matrix products are computed in
float64 and rounded to fp32 once (the torch summation order is not reproducible, float64 makes ours fixed).
State layout [n_v, d_k, d_v] fp32; value head j uses key head j // (n_v / n_k) (grouped).
"""
from __future__ import annotations

import numpy as np

from assembler.numerics import GDN_CHUNK
from assembler.ref.numerics import BF16, bf16, f32, need, need_dtype, silu64


def _conv_rows(x: np.ndarray, conv_state: np.ndarray, conv_w: np.ndarray):
    need_dtype(x, BF16, "gdn_conv: x")
    need_dtype(conv_state, BF16, "gdn_conv: conv_state")
    need_dtype(conv_w, BF16, "gdn_conv: conv_w")
    w = conv_w.reshape(conv_w.shape[0], -1)                               # [C, kernel]
    C, kw = w.shape
    need(x.ndim == 2 and x.shape[1] == C and conv_state.shape == (C, kw - 1),
         f"gdn_conv: x [T,{C}] and conv_state [{C},{kw - 1}] expected, got {x.shape}, {conv_state.shape}")
    seq = np.concatenate([conv_state.T, x], 0)                            # [kw-1+T, C] oldest first
    T = x.shape[0]
    wf = f32(w).astype(np.float64)
    sf = f32(seq).astype(np.float64)
    acc = np.zeros((T, C), np.float64)
    for j in range(kw):
        acc += sf[j:j + T] * wf[:, j]
    y = bf16(silu64(f32(bf16(acc))))
    return y, np.ascontiguousarray(seq[-(kw - 1):].T)


def gdn_conv_step(x: np.ndarray, conv_state: np.ndarray, conv_w: np.ndarray):
    """Causal depthwise conv + SiLU for M consecutive tokens (decode / verify rows, applied in order).

    x [M, C] bf16 (in_proj_qkv output), conv_state [C, kernel−1] bf16 (last inputs, oldest first), conv_w
    [C, 1, kernel] or [C, kernel] bf16. y = bf16(silu(bf16(Σ_j w_j·x_{t−kernel+1+j}))) (sum in float64 → fp32).
    Returns (y [M, C] bf16, new conv_state [C, kernel−1] bf16)."""
    return _conv_rows(x, conv_state, conv_w)


def gdn_conv_prefill(x: np.ndarray, conv_state: np.ndarray, conv_w: np.ndarray):
    """Same function as :func:`gdn_conv_step` over T prompt tokens (``causal_conv1d_fn``; a fresh state is zeros)."""
    return _conv_rows(x, conv_state, conv_w)


def gdn_gates(a: np.ndarray, b: np.ndarray, A_log: np.ndarray, dt_bias: np.ndarray):
    """Decay and write strength. a, b [M, n_v] bf16 (in_proj_a/b outputs); A_log, dt_bias [n_v] bf16.

    g = fp32(−fp32(exp(A_log)) · softplus(fp32(a + dt_bias))) (softplus(x) = x above 20, torch's threshold);
    beta = bf16(sigmoid(b)). Returns (g fp32 [M, n_v], beta bf16 [M, n_v])."""
    for t, nm in ((a, "a"), (b, "b"), (A_log, "A_log"), (dt_bias, "dt_bias")):
        need_dtype(t, BF16, f"gdn_gates: {nm}")
    xa = (f32(a) + f32(dt_bias)).astype(np.float32)
    x64 = xa.astype(np.float64)
    sp = np.where(x64 > 20.0, x64, np.log1p(np.exp(np.minimum(x64, 20.0)))).astype(np.float32)
    A = -np.exp(f32(A_log).astype(np.float64)).astype(np.float32)
    g = (A * sp).astype(np.float32)
    beta = bf16(1.0 / (1.0 + np.exp(-f32(b).astype(np.float64))))
    return g, beta


def gdn_qk_norm(q: np.ndarray, k: np.ndarray, path: str):
    """l2norm of q and k over d_k in fp32 (x · rsqrt(Σx² + 1e-6)), then q scaled by d_k^-0.5.

    q, k [..., d_k] bf16 → fp32. ``path='step'`` divides by fp32(√d_k) (recurrent rule), ``path='chunk'``
    multiplies by fp32(d_k^-0.5) (chunked rule): the two torch paths differ here."""
    def l2(x):
        xf = f32(x)
        ss = (xf.astype(np.float64) ** 2).sum(-1, keepdims=True).astype(np.float32)
        inv = (1.0 / np.sqrt((ss + np.float32(1e-6)).astype(np.float64))).astype(np.float32)
        return (xf * inv).astype(np.float32)
    dk = q.shape[-1]
    qn, kn = l2(q), l2(k)
    if path == "step":
        qn = (qn / np.float32(dk ** 0.5)).astype(np.float32)
    elif path == "chunk":
        qn = (qn * np.float32(dk ** -0.5)).astype(np.float32)
    else:
        raise ValueError(f"gdn_qk_norm: path must be 'step' or 'chunk', got {path!r}")
    return qn, kn


def gdn_step_head(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, S: np.ndarray):
    """One token of the gated delta rule for H value heads (``torch_recurrent_gated_delta_rule``).

    q, k [H, d_k] fp32 (from gdn_qk_norm, path 'step', already mapped to value heads); v [H, d_v] bf16;
    g [H] fp32; beta [H] bf16; S [H, d_k, d_v] fp32. S ← fp32(S·exp g); kv = Σ_k S k; δ = (v − kv)·β;
    S ← S + k ⊗ δ; o = Σ_k S q. Returns (o [H, d_v] bf16, S' fp32). S is not modified."""
    need(S.dtype == np.float32 and S.ndim == 3, lambda: f"gdn_step_head: S must be fp32 [H,d_k,d_v], got {S.dtype} {S.shape}")
    need_dtype(v, BF16, "gdn_step_head: v")
    need_dtype(beta, BF16, "gdn_step_head: beta")
    dec = np.exp(np.asarray(g, np.float64)).astype(np.float32)
    S = (S * dec[:, None, None]).astype(np.float32)
    kv = np.einsum("hkv,hk->hv", S.astype(np.float64), k.astype(np.float64)).astype(np.float32)
    delta = ((f32(v) - kv).astype(np.float32) * f32(beta)[:, None]).astype(np.float32)
    S = (S + (k[:, :, None] * delta[:, None, :]).astype(np.float32)).astype(np.float32)
    o = np.einsum("hkv,hk->hv", S.astype(np.float64), q.astype(np.float64)).astype(np.float32)
    return bf16(o), S


def _mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(np.float32)


def _solve_unit_lower(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Solve (I + strict_lower(A)) X = B by forward substitution in float64, rounded to fp32 once."""
    A64, X = A.astype(np.float64), B.astype(np.float64).copy()
    for i in range(1, A.shape[-1]):
        X[..., i, :] -= np.einsum("...j,...jd->...d", A64[..., i, :i], X[..., :i, :])
    return X.astype(np.float32)


def gdn_prefill_chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                        S0: np.ndarray, chunk: int = GDN_CHUNK):
    """Chunked gated delta rule over T tokens, chunks anchored at the first token (``torch_chunk_gated_delta_rule``,
    WY/UT form; T padded with zeros to a multiple of ``chunk``).

    q, k [T, H, d_k] fp32 (gdn_qk_norm path 'chunk', mapped to value heads); v [T, H, d_v] bf16; g [T, H] fp32;
    beta [T, H] bf16; S0 [H, d_k, d_v] fp32. Returns (o [T, H, d_v] bf16, S fp32 [H, d_k, d_v])."""
    T, H, dk = k.shape
    need(S0.dtype == np.float32 and S0.shape == (H, dk, v.shape[-1]), lambda: f"gdn_prefill_chunked: S0 must be fp32 {(H, dk, v.shape[-1])}")
    need_dtype(v, BF16, "gdn_prefill_chunked: v")
    need_dtype(beta, BF16, "gdn_prefill_chunked: beta")
    pad = (-T) % chunk
    tr = lambda x: np.ascontiguousarray(np.moveaxis(x, 0, 1))            # [T,H,...] -> [H,T,...]
    qf, kf, vf = (np.pad(tr(x.astype(np.float32)), ((0, 0), (0, pad), (0, 0))) for x in (q, k, f32(v)))
    bf, gf = (np.pad(tr(x.astype(np.float32)), ((0, 0), (0, pad))) for x in (f32(beta), g))
    n = (T + pad) // chunk
    vb = (vf * bf[..., None]).astype(np.float32).reshape(H, n, chunk, -1)
    kb = (kf * bf[..., None]).astype(np.float32).reshape(H, n, chunk, dk)
    qf, kf = qf.reshape(H, n, chunk, dk), kf.reshape(H, n, chunk, dk)
    cum = np.cumsum(gf.reshape(H, n, chunk), axis=-1, dtype=np.float32)
    diff = (cum[..., :, None] - cum[..., None, :]).astype(np.float32)
    lower = np.tril(np.ones((chunk, chunk), bool))
    D = np.where(lower, np.exp(np.where(lower, diff, 0).astype(np.float64)).astype(np.float32), np.float32(0))
    kT = np.swapaxes(kf, -1, -2)
    ut = (_mm(kb, kT) * D).astype(np.float32)
    intra = (_mm(qf, kT) * D).astype(np.float32)
    ecum = np.exp(cum.astype(np.float64)).astype(np.float32)
    dkb = (kb * ecum[..., None]).astype(np.float32)
    U = _solve_unit_lower(ut, vb)
    W = _solve_unit_lower(ut, dkb)
    qd = (qf * ecum[..., None]).astype(np.float32)
    kd = (kf * np.exp((cum[..., -1:] - cum).astype(np.float32).astype(np.float64)).astype(np.float32)[..., None]).astype(np.float32)
    cdec = ecum[..., -1]                                                  # [H, n]
    S = S0.astype(np.float32).copy()
    out = np.empty_like(U)
    for i in range(n):
        vn = (U[:, i] - _mm(W[:, i], S)).astype(np.float32)
        out[:, i] = (_mm(qd[:, i], S) + _mm(intra[:, i], vn)).astype(np.float32)
        S = ((S * cdec[:, i, None, None]).astype(np.float32) + _mm(np.swapaxes(kd[:, i], -1, -2), vn)).astype(np.float32)
    o = out.reshape(H, n * chunk, -1)[:, :T]
    return bf16(np.moveaxis(o, 0, 1)), S
