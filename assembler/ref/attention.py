"""Gated full attention reference ops (spec §3.3; transformers ``Qwen3_5Attention`` + ``eager_attention_forward``).

Rounding points of the eager path: q/k norm → bf16; RoPE in bf16 (each product and the sum rounded);
scores = bf16(q·k accumulated in fp32) then × head_dim^-0.5 (exact 1/16 for head_dim 256); softmax in fp32,
probabilities rounded to bf16; o = bf16(Σ p·v accumulated in fp32); gate = bf16(sigmoid); bf16(o · gate).
Decode uses the fixed split-KV two-pass structure of INTERFACES §2 (``attn_decode_group``).
"""
from __future__ import annotations

import numpy as np

from assembler.numerics import attn_partition_range
from assembler.ref.dense import rmsnorm
from assembler.ref.numerics import BF16, bf16, f32, need, need_dtype, sigmoid64
from loader.config import ModelConfig


def rope_cos_sin(pos, cfg: ModelConfig, theta: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin for positions ``pos`` (int [M]) → two bf16 [M, rotary_dim] (``Qwen3_5TextRotaryEmbedding``).

    inv_freq[i] = fp32(1 / fp32(θ^(2i/rd))), angle = fp32(pos · inv_freq), cos/sin computed in float64, rounded
    to fp32 then bf16, laid out cat(f, f). ``theta`` overrides ``cfg.rope_theta`` (negative controls)."""
    rd = cfg.rotary_dim
    base = float(cfg.rope_theta if theta is None else theta)
    expo = (np.arange(0, rd, 2, dtype=np.float32) / np.float32(rd)).astype(np.float64)
    inv = (1.0 / (base ** expo).astype(np.float32).astype(np.float64)).astype(np.float32)
    pos = np.asarray(pos, dtype=np.int64).reshape(-1)
    ang = (pos.astype(np.float32)[:, None] * inv[None, :]).astype(np.float32)
    cos = bf16(np.cos(ang.astype(np.float64)).astype(np.float32))
    sin = bf16(np.sin(ang.astype(np.float64)).astype(np.float32))
    return np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [M, heads, hd] bf16; cos/sin [M, rd] bf16. bf16(bf16(x·cos) + bf16(rotate_half(x)·sin)) on dims < rd."""
    rd = cos.shape[-1]
    xr = f32(x[..., :rd])
    half = rd // 2
    rot = np.concatenate([-xr[..., half:], xr[..., :half]], -1)
    c, s = f32(cos)[:, None, :], f32(sin)[:, None, :]
    y = bf16(f32(bf16(xr * c)) + f32(bf16(rot * s)))
    return np.concatenate([y, x[..., rd:]], -1)


def attn_prep(qg: np.ndarray, k: np.ndarray, v: np.ndarray, q_norm_w: np.ndarray, k_norm_w: np.ndarray, pos,
              cfg: ModelConfig, theta: float | None = None):
    """Split q|gate per head, q/k RMSNorm (1+w), partial RoPE. Returns (q [M, nq, hd], gate [M, nq·hd],
    k [M, nkv, hd], v [M, nkv, hd]), all bf16.

    qg [M, 2·nq·hd] bf16 (q_proj output: head j = [query(hd) | gate(hd)]); k, v [M, nkv·hd] bf16; pos int [M]."""
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    M = qg.shape[0]
    need(qg.shape == (M, 2 * nq * hd) and k.shape == (M, nkv * hd) and v.shape == (M, nkv * hd),
         f"attn_prep: shapes qg{qg.shape} k{k.shape} v{v.shape} do not match config {nq}/{nkv}x{hd}")
    for a, nm in ((qg, "qg"), (k, "k"), (v, "v")):
        need_dtype(a, BF16, f"attn_prep: {nm}")
    qh = qg.reshape(M, nq, 2 * hd)
    q, gate = qh[..., :hd], np.ascontiguousarray(qh[..., hd:]).reshape(M, nq * hd)
    q = rmsnorm(np.ascontiguousarray(q), q_norm_w, cfg.rms_norm_eps)
    kk = rmsnorm(k.reshape(M, nkv, hd), k_norm_w, cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(pos, cfg, theta)
    return _rope(q, cos, sin), gate, _rope(kk, cos, sin), v.reshape(M, nkv, hd).copy()


def _scores(q: np.ndarray, K: np.ndarray) -> np.ndarray:
    """bf16 scores q·Kᵀ (dot in float64 → fp32 → bf16) scaled by hd^-0.5 in fp32 → bf16; returned as fp32."""
    hd = q.shape[-1]
    s = bf16(f32(q).astype(np.float64) @ f32(K).astype(np.float64).T)
    return f32(bf16(f32(s) * np.float32(hd ** -0.5)))


def attn_part_scores(q: np.ndarray, K: np.ndarray) -> np.ndarray:
    """Stage 1 of ``attn_decode_group`` for one partition: q [group, hd], K [n, hd] bf16 (the partition's keys) →
    scores [group, n] fp32 holding bf16 values. Each score depends on its own key only."""
    return _scores(q, K)


def attn_part_stats(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-partition softmax stats of scores s [group, n] (n ≥ 1): m = max s, l = fp32(Σ exp(s − m)) (float64
    sum) → (m, l) fp32 [group]."""
    m = s.max(-1)
    l = np.exp((s - m[:, None]).astype(np.float32).astype(np.float64)).astype(np.float32).astype(np.float64).sum(-1)
    return m, l.astype(np.float32)


def attn_merge_stats(ms, ls) -> tuple[np.ndarray, np.ndarray]:
    """Merge the stats of the non-empty partitions in partition order: M = max m_p, L = fp32(L + fp32(l_p ·
    exp(m_p − M))) from 0. ms, ls: sequences of fp32 [group]."""
    Mx = np.max(np.stack(ms), 0)
    Ls = np.zeros_like(Mx)
    for m, l in zip(ms, ls):
        Ls = (Ls + (l * np.exp((m - Mx).astype(np.float64)).astype(np.float32)).astype(np.float32)).astype(np.float32)
    return Mx, Ls


def attn_part_values(s: np.ndarray, Mx: np.ndarray, Ls: np.ndarray, V: np.ndarray) -> np.ndarray:
    """One partition's partial output under the merged stats: p_j = bf16(exp(s_j − M) / L), o_p = fp32(Σ p_j v_j)
    (float64 sum). s [group, n] fp32, V [n, hd] bf16 → fp32 [group, hd]."""
    e = np.exp((s - Mx[:, None]).astype(np.float32).astype(np.float64)).astype(np.float32)
    p = f32(bf16((e / Ls[:, None]).astype(np.float32))).astype(np.float64)
    return (p @ f32(V).astype(np.float64)).astype(np.float32)


def attn_merge_values(parts) -> np.ndarray:
    """o = fp32(o + o_p) over the non-empty partitions in partition order, from 0; → bf16 [group, hd]."""
    o = np.zeros_like(parts[0])
    for op in parts:
        o = (o + op).astype(np.float32)
    return bf16(o)


def attn_decode_group(q: np.ndarray, K: np.ndarray, V: np.ndarray, parts: int) -> np.ndarray:
    """One KV head's attention for its query heads over L cached keys, split-KV two-pass (INTERFACES §2).

    q [group, hd], K/V [L, hd] bf16 (keys already roped, the current token's included) → o [group, hd] bf16.
    Pass 1 per partition p: m_p = max s, l_p = fp32(Σ exp(s − m_p)) (float64 sum). Merge in partition order:
    M = max m_p, L = fp32(L + fp32(l_p · exp(m_p − M))). Pass 2: p_j = bf16(exp(s_j − M) / L); per partition
    o_p = fp32(Σ p_j v_j) (float64 sum), o = fp32(o + o_p) in partition order; bf16(o). Composed of the stage
    functions above, which the CPU VM's ATTN_SCORES / ATTN_VALUES / ATTN_REDUCE instructions call per partition."""
    for a, nm in ((q, "q"), (K, "K"), (V, "V")):
        need_dtype(a, BF16, f"attn_decode_group: {nm}")
    L = K.shape[0]
    need(L >= 1 and V.shape == K.shape and q.shape[-1] == K.shape[-1], lambda: f"attn_decode_group: q{q.shape} K{K.shape} V{V.shape}")
    rngs = [r for r in (attn_partition_range(L, parts, p) for p in range(parts)) if len(r)]
    ss = [attn_part_scores(q, K[r.start:r.stop]) for r in rngs]
    Mx, Ls = attn_merge_stats(*zip(*(attn_part_stats(s) for s in ss)))
    return attn_merge_values([attn_part_values(s, Mx, Ls, V[r.start:r.stop]) for s, r in zip(ss, rngs)])


def attn_prefill(q: np.ndarray, K: np.ndarray, V: np.ndarray, q_pos) -> np.ndarray:
    """Causal eager attention for T new queries over a cache of L keys (prefill path, one softmax per row).

    q [T, nq, hd] bf16, K/V [L, nkv, hd] bf16 (cache including the new keys), q_pos int [T] (query t sees keys
    0..q_pos[t]). Softmax fp32 (max, exp, float64 sum → fp32, divide), p rounded to bf16, o = bf16(fp32(Σ p v)).
    Returns [T, nq·hd] bf16."""
    T, nq, hd = q.shape
    L, nkv, _ = K.shape
    G = nq // nkv
    q_pos = np.asarray(q_pos, dtype=np.int64).reshape(-1)
    need(q_pos.size == T and q_pos.max() < L, lambda: f"attn_prefill: q_pos must have {T} entries < {L}")
    out = np.empty((T, nq, hd), BF16)
    mask = np.arange(L)[None, :] <= q_pos[:, None]                        # [T, L]
    for h in range(nkv):
        Kf, Vf = f32(K[:, h]).astype(np.float64), f32(V[:, h]).astype(np.float64)
        for g in range(G):
            j = h * G + g
            s = bf16(f32(q[:, j]).astype(np.float64) @ Kf.T)
            s = f32(bf16(f32(s) * np.float32(hd ** -0.5)))
            s = np.where(mask, s, -np.inf).astype(np.float32)
            m = s.max(-1, keepdims=True)
            e = np.exp((s - m).astype(np.float64)).astype(np.float32)
            den = e.astype(np.float64).sum(-1, keepdims=True).astype(np.float32)
            p = f32(bf16((e / den).astype(np.float32))).astype(np.float64)
            out[:, j] = bf16(p @ Vf)
    return out.reshape(T, nq * hd)


def attn_gate(o: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """Output gate: bf16(fp32(o) · fp32(bf16(sigmoid(gate)))). o, gate [M, nq·hd] bf16 → bf16."""
    need_dtype(o, BF16, "attn_gate: o")
    need_dtype(gate, BF16, "attn_gate: gate")
    need(o.shape == gate.shape, lambda: f"attn_gate: o{o.shape} != gate{gate.shape}")
    return bf16(f32(o) * f32(bf16(sigmoid64(f32(gate)))))
