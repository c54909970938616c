"""The fast CPU model: the Qwen3.5 text decoder in float32 NumPy with BLAS matmuls (the ``cpu`` executor).

Same model, same rounding points as the reference (``assembler/ref``: every op output rounded to bf16 where the
reference rounds it, fp32 where it keeps fp32), but every sum is a float32 BLAS or NumPy reduction instead of the
reference's float64 sums rounded once. It is therefore not bit-identical to the reference: it agrees with it
within the tolerance of ``agreement`` (docs/tolerance.md, tests/cpu/test_cpu_fast.py: bf16-ulp-level logits,
near-tie top-1 flips only). Why not the reference ops with float32 inputs: they check bf16/fp8 input dtypes and
compute in float64 with per-128-block split-K (the engine's bit definition), which is what makes them slow.

Layout: every activation is a float32 array holding bf16 values (``rb`` rounds to the nearest bf16, RNE, in
place of a dtype change). Weights are widened ONCE at construction: fp8 e4m3 × its 128×128 block scale is exact
in float32 (4 + 8 significant bits), bf16 widens exactly; fused row blocks as the engine streams them
(GDN qkv|z|b|a, attention q|k|v, MLP gate|up). About 4 B per parameter: 0.31 GB for tiny, lm_head 254 MB of it.
Prefill: chunked gated delta rule with chunks of 64 anchored at the sequence start, one forward pass per chunk
(one causal softmax per query row). The state keeps an anchor checkpoint (``FastState.anchor``: the GDN state at
the last multiple of 64 a prefill reached); a prefill at a position past it restores it and re-runs the ids since
then (``st.toks``: earlier prefill ids and decoded tokens alike) with the new ones, so any sequence of prefill and
decode calls leaves a prefill's logits, GDN state and K/V bit-identical to one prefill of the whole history
(tests/cpu/test_cpu_anchor.py). Decode (``path="step"``, M ≥ 1 rows): the recurrent
rule per token, one softmax over the cache per row, every projection one BLAS GEMV per row and the lm_head GEMVs
over fixed blocks of HEAD_BLOCK rows (``head_gemv``): a row's bits do not depend on how many rows the call has
(OpenBLAS's GEMM gives a row different bits for different M), so an M = k + 1 verify pass of speculative decoding
(``host.speculate``) gives each row exactly the bits of plain one-token decode. ``record=True`` keeps the GDN
recurrent state after every row and the conv input rows in a replay ring allocated with the state, so
``keep_rows`` rolls a partly accepted verify pass back exactly. The MTP head (draft model): ``host.cpu_mtp``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from assembler.numerics import GDN_CHUNK
from assembler.ref.attention import rope_cos_sin
from assembler.ref.envelope import _stats, _ulp
from assembler.ref.numerics import BF16, f32
from loader.config import ModelConfig

F32 = np.float32

HEAD_BLOCK = 8192     # lm_head rows per GEMV call (measured fastest of 1k..16k on the 2-core machine, M = 1 and 8)
RING_ROWS = 8         # verify rows the replay ring holds (k ≤ 7 drafts + the pending token)

# Tolerance against the reference (``agreement``; tests/cpu/test_cpu_fast.py): the oracle's self-disagreement
# envelope of docs/tolerance.md, i.e. the fast path may differ from the reference no more than the transformers
# oracle's two paths differ from each other (``Envelope.calibrate`` over tests/golden; a test keeps these equal).
D32_BOUNDS = {"max": 0.375, "p99": 0.25, "p50": 0.125, "mean": 0.140625}   # logit units, after 1 ulp allowance
TIE_MARGIN = 0.25                                                           # margins ≤ this + 1 ulp are near-ties


def rb(x: np.ndarray) -> np.ndarray:
    """Round a float32 array to bf16 values (RNE), kept as float32: the bits of ``x.astype(bfloat16)`` widened.
    Quiet NaN and ±inf pass through; finite values past the bf16 range become ±inf."""
    x = np.ascontiguousarray(x, dtype=F32)
    u = x.view(np.uint32)
    r = u >> 16
    r &= 1
    r += 0x7FFF
    r += u
    r &= 0xFFFF0000
    return r.view(F32)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (F32(1.0) + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return F32(1.0) / (F32(1.0) + np.exp(-x))


def rmsnorm(x: np.ndarray, w1: np.ndarray, eps: float) -> np.ndarray:
    """Zero-centred RMSNorm: rb(x · rsqrt(mean x² + eps) · w1), w1 = 1 + w (precomputed). x [..., D] → same."""
    inv = F32(1.0) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F32(eps))
    return rb(x * inv * w1)


def mm_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, K] @ w.T for w [N, K] as one GEMV per row: row t's bits depend on x[t] and w only (not on T)."""
    out = np.empty((x.shape[0], w.shape[0]), F32)
    for t in range(x.shape[0]):
        np.matmul(w, x[t], out=out[t])
    return out


def head_gemv(x: np.ndarray, w: np.ndarray, block: int = HEAD_BLOCK) -> np.ndarray:
    """x [M, K] @ w.T for a tall w [N, K] (the lm_head): GEMVs over fixed blocks of ``block`` rows of w, every row of
    x against a block while it is in cache. Row-invariant as ``mm_rows``; float32 [M, N]."""
    out = np.empty((x.shape[0], w.shape[0]), F32)
    for s in range(0, w.shape[0], block):
        wb = w[s:s + block]
        for m in range(x.shape[0]):
            np.matmul(wb, x[m], out=out[m, s:s + block])
    return out


def dequantize_f32(w: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """Stored weight [N, K] (fp8 e4m3 with bf16 scale [ceil(N/128), K/128], or bf16 with None) → float32 [N, K],
    exact: fp32(w) · fp32(scale[n // 128, k // 128])."""
    wf = f32(w)
    if scale is None:
        return np.ascontiguousarray(wf)
    s = np.repeat(np.repeat(f32(scale), 128, axis=0), 128, axis=1)[:wf.shape[0], :wf.shape[1]]
    return np.ascontiguousarray(wf * s)


@dataclass
class FastState:
    """One session slot: K, V per full-attention layer [n_kv, capacity, head_dim] float32 (bf16 values; NaN at
    rows ≥ the high-water mark ``hw``), conv [kernel−1, conv_dim] float32 (oldest first, bf16 values) and rec
    [n_v, d_k, d_v] float32 per GDN layer, ``pos`` tokens processed, ``hidden`` final-normed rows of the last call.
    For the MTP draft (``host.cpu_mtp``): ``toks`` [capacity] the ids run at each position, ``hid`` [capacity, H] their
    final-normed hidden rows, MTP K/V [n_kv, capacity, head_dim] and ``mtp_pos`` (positions whose step-1 MTP row is
    in the MTP cache). ``ring``: the replay ring of the last recorded step call (``FastModel.keep_rows``).
    ``anchor``: the chunk anchor (a multiple of 64, ≤ ``pos``) and ``ck_conv`` / ``ck_rec`` the GDN state there,
    allocated with the state; the ids since the anchor are ``toks[anchor:pos]`` (``FastModel.prefill``)."""

    capacity: int
    pos: int = 0
    hw: int = 0
    k: dict = field(default_factory=dict)
    v: dict = field(default_factory=dict)
    conv: dict = field(default_factory=dict)
    rec: dict = field(default_factory=dict)
    hidden: np.ndarray | None = None
    toks: np.ndarray | None = None
    hid: np.ndarray | None = None
    mtp_k: np.ndarray | None = None
    mtp_v: np.ndarray | None = None
    mtp_pos: int = 0
    ring: dict | None = None
    anchor: int = 0
    ck_conv: dict = field(default_factory=dict)
    ck_rec: dict = field(default_factory=dict)

    def clear(self) -> None:
        """Back to an empty state in place (NaN over the rows written since the last clear, zeros elsewhere)."""
        for d in (self.k, self.v):
            for a in d.values():
                a[:, :self.hw] = np.nan
        for d in (self.conv, self.rec, self.ck_conv, self.ck_rec):
            for a in d.values():
                a[...] = 0
        self.pos = self.hw = self.mtp_pos = self.anchor = 0
        self.hidden = None
        if self.ring is not None:
            self.ring["rows"] = 0


class FastModel:
    """float32 model over a WeightSource (``.config``, ``.get(name)``); ``rope_theta`` overrides the config's RoPE
    base (negative controls). ``skip_layers``: layer indices run as identity (negative controls only)."""

    def __init__(self, weights, rope_theta: float | None = None, skip_layers=()):
        c: ModelConfig = weights.config
        self.cfg, self.theta, self.skip = c, rope_theta, frozenset(skip_layers)
        self._src = weights
        self.embed_table = np.asarray(weights.get("model.embed_tokens.weight"))   # [V, H] bf16, gathered per call
        self.lm_head = self._lin("lm_head")                                       # [V, H] float32
        self.final_norm = self._norm("model.norm.weight")
        self.layers = [self._layer(f"model.layers.{i}.", i in c.linear_layers) for i in range(c.num_hidden_layers)]

    # ------------------------------------------------------------------ weights (widened once)
    def _get(self, name: str) -> np.ndarray:
        return np.asarray(self._src.get(name))

    def _lin(self, *names: str) -> np.ndarray:
        """Fused rows of the named projections, float32 [ΣN, K]."""
        ws = []
        for n in names:
            w = self._get(n + ".weight")
            ws.append(dequantize_f32(w, None if w.dtype == BF16 else self._get(n + ".weight_scale_inv")))
        return ws[0] if len(ws) == 1 else np.ascontiguousarray(np.concatenate(ws))

    def _norm(self, name: str) -> np.ndarray:
        return F32(1.0) + f32(self._get(name))                                   # (1 + w) of Qwen3_5RMSNorm

    def _layer(self, p: str, linear: bool) -> dict:
        c = self.cfg
        L = {"in_norm": self._norm(p + "input_layernorm.weight"),
             "post_norm": self._norm(p + "post_attention_layernorm.weight"),
             "gate_up": self._lin(p + "mlp.gate_proj", p + "mlp.up_proj"), "down": self._lin(p + "mlp.down_proj")}
        if linear:
            a = p + "linear_attn."
            L["in"] = self._lin(*(a + n for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")))
            L["out"] = self._lin(a + "out_proj")
            L["conv_w"] = np.ascontiguousarray(f32(self._get(a + "conv1d.weight")).reshape(c.gdn_conv_dim, -1).T)  # [kw, C]
            L["A"] = -np.exp(f32(self._get(a + "A_log")))
            L["dt_bias"] = f32(self._get(a + "dt_bias"))
            L["gnorm"] = f32(self._get(a + "norm.weight"))                       # plain w (RMSNormGated)
        else:
            a = p + "self_attn."
            L["in"] = self._lin(a + "q_proj", a + "k_proj", a + "v_proj")
            L["out"] = self._lin(a + "o_proj")
            L["q_norm"], L["k_norm"] = self._norm(a + "q_norm.weight"), self._norm(a + "k_norm.weight")
        return L

    # ------------------------------------------------------------------ state
    def new_state(self, capacity: int) -> FastState:
        """Empty state for up to ``capacity`` tokens. Raises ValueError for capacity < 1, MemoryError from NumPy."""
        c = self.cfg
        if capacity < 1:
            raise ValueError(f"FastModel.new_state: capacity must be >= 1, got {capacity}")
        st = FastState(int(capacity))
        for i in c.full_layers:
            st.k[i], st.v[i] = (np.full((c.num_key_value_heads, capacity, c.head_dim), np.nan, F32) for _ in "kv")
        for i in c.linear_layers:
            st.conv[i] = np.zeros((c.linear_conv_kernel_dim - 1, c.gdn_conv_dim), F32)
            st.rec[i] = np.zeros((c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim), F32)
            st.ck_conv[i], st.ck_rec[i] = np.zeros_like(st.conv[i]), np.zeros_like(st.rec[i])
        st.toks = np.zeros(capacity, np.int64)
        st.hid = np.zeros((capacity, c.hidden_size), F32)
        kw = c.linear_conv_kernel_dim
        st.ring = {"rows": 0, "base": 0,
                   "rec": {i: np.empty((RING_ROWS,) + a.shape, F32) for i, a in st.rec.items()},
                   "seq": {i: np.empty((kw - 1 + RING_ROWS, c.gdn_conv_dim), F32) for i in c.linear_layers}}
        return st

    def keep_rows(self, st: FastState, n: int) -> None:
        """Roll the state back to the first ``n`` rows of the last recorded step call (``forward(..., record=True)``):
        GDN recurrent and conv state from the replay ring (the bits they had after row n − 1), ``pos`` = its first
        position + n, K/V rows past it poisoned with NaN again (as a state that never saw them), ``hidden`` its
        first n rows. No allocation. Raises ValueError when n is outside [1, rows recorded]."""
        r = st.ring
        if not 1 <= n <= r["rows"]:
            raise ValueError(f"keep_rows: {n} rows asked, the ring holds {r['rows']}")
        kw = self.cfg.linear_conv_kernel_dim
        for i in st.rec:
            st.rec[i][...] = r["rec"][i][n - 1]
            st.conv[i][...] = r["seq"][i][n:n + kw - 1]
        end = r["base"] + r["rows"]
        st.pos = r["base"] + n
        for d in (st.k, st.v):
            for a in d.values():
                a[:, st.pos:end] = np.nan
        st.hidden = st.hidden[:n]
        st.mtp_pos = min(st.mtp_pos, max(st.pos - 1, 0))
        r["rows"] = 0

    # ------------------------------------------------------------------ mixers
    def _gdn(self, L: dict, st: FastState, li: int, h: np.ndarray, path: str, record: bool = False) -> np.ndarray:
        c = self.cfg
        T = h.shape[0]
        kd, vd, nv = c.gdn_key_dim, c.gdn_value_dim, c.linear_num_value_heads
        nk, dk = c.linear_num_key_heads, c.linear_key_head_dim
        C = c.gdn_conv_dim
        y = rb(mm_rows(h, L["in"]) if path == "step" else h @ L["in"].T)        # [T, C | vd | nv | nv]
        qkv, z, b, a = y[:, :C], y[:, C:C + vd], y[:, C + vd:C + vd + nv], y[:, C + vd + nv:]
        w, kw = L["conv_w"], L["conv_w"].shape[0]
        if record:                                                               # the ring keeps the conv inputs
            seq = st.ring["seq"][li][:kw - 1 + T]
            seq[:kw - 1], seq[kw - 1:] = st.conv[li], qkv
        else:
            seq = np.concatenate([st.conv[li], qkv])                             # [kw-1+T, C] oldest first
        acc = seq[0:T] * w[0]
        for j in range(1, kw):
            acc += seq[j:j + T] * w[j]
        st.conv[li][...] = seq[-(kw - 1):]
        y = rb(silu(rb(acc)))
        xa = a + L["dt_bias"]
        g = L["A"] * np.where(xa > 20.0, xa, np.log1p(np.exp(np.minimum(xa, F32(20.0)))))   # [T, nv] fp32
        beta = rb(sigmoid(b))

        def l2(x):
            return x * (F32(1.0) / np.sqrt((x * x).sum(-1, keepdims=True) + F32(1e-6)))
        q, k = l2(y[:, :kd].reshape(T, nk, dk)), l2(y[:, kd:2 * kd].reshape(T, nk, dk))
        q = q / F32(dk ** 0.5) if path == "step" else q * F32(dk ** -0.5)        # the two torch rules differ here
        rep = c.gdn_head_group
        q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)              # value head j <- key head j // rep
        v = y[:, 2 * kd:].reshape(T, nv, c.linear_value_head_dim)
        if path == "chunk":
            o, S = gdn_chunked(q, k, v, g, beta, st.rec[li], GDN_CHUNK)
            st.rec[li][...] = S                                                  # in place: the slot's own array
        else:
            S, outs = st.rec[li], []
            for t in range(T):
                S *= np.exp(g[t])[:, None, None]
                kv = np.matmul(k[t][:, None, :], S)[:, 0]                        # [nv, dv]
                delta = (v[t] - kv) * beta[t][:, None]
                S += k[t][:, :, None] * delta[:, None, :]
                outs.append(np.matmul(q[t][:, None, :], S)[:, 0])
                if record:
                    st.ring["rec"][li][t] = S
            o = rb(np.stack(outs))
        n = rb(o * (F32(1.0) / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + F32(c.rms_norm_eps))))
        n = rb(L["gnorm"] * n)
        return rb(n * silu(z.reshape(T, nv, -1))).reshape(T, vd)

    def _attn(self, L: dict, K: np.ndarray, V: np.ndarray, h: np.ndarray, pos0: int, cs, path: str) -> np.ndarray:
        """Gated attention of rows at positions pos0.. over K, V [n_kv, capacity, hd] (their K/V written there).
        ``step``: each row alone over keys [0, its position] (the bits of a one-row call); ``chunk``: all rows in
        one masked softmax per KV head."""
        c = self.cfg
        T = h.shape[0]
        nq, nkv, hd, G = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.gqa_group
        y = rb(mm_rows(h, L["in"]) if path == "step" else h @ L["in"].T)        # [T, 2·nq·hd | nkv·hd | nkv·hd]
        qh = y[:, :2 * nq * hd].reshape(T, nq, 2 * hd)
        gate = qh[..., hd:].reshape(T, nq * hd)
        kv0 = 2 * nq * hd
        q = _rope(rmsnorm(qh[..., :hd], L["q_norm"], c.rms_norm_eps), *cs)
        k = _rope(rmsnorm(y[:, kv0:kv0 + nkv * hd].reshape(T, nkv, hd), L["k_norm"], c.rms_norm_eps), *cs)
        end = pos0 + T
        K[:, pos0:end] = k.transpose(1, 0, 2)
        V[:, pos0:end] = y[:, kv0 + nkv * hd:].reshape(T, nkv, hd).transpose(1, 0, 2)
        o = np.empty((T, nq, hd), F32)
        if path == "step":
            for t in range(T):
                o[t] = self._attn_rows(q[t:t + 1], K, V, pos0 + t + 1, None)[0]
        else:
            future = (np.arange(end)[None, :] > (pos0 + np.arange(T))[:, None])[:, None, :]  # [T, 1, L] keys after t
            o[...] = self._attn_rows(q, K, V, end, future if T > 1 else None)
        return rb(o.reshape(T, nq * hd) * rb(sigmoid(gate)))

    def _attn_rows(self, q: np.ndarray, K: np.ndarray, V: np.ndarray, end: int, future) -> np.ndarray:
        """Softmax attention of q [T, nq, hd] over keys [0, end), ``future`` [T, 1, end] masking keys after a row."""
        c = self.cfg
        T, nq, hd = q.shape
        G = c.gqa_group
        scale = F32(hd ** -0.5)
        o = np.empty((T, nq, hd), F32)
        for kh in range(c.num_key_value_heads):
            qg = q[:, kh * G:(kh + 1) * G].reshape(T * G, hd)                    # rows (t, g)
            s = rb(rb(qg @ K[kh, :end].T) * scale).reshape(T, G, end)
            if future is not None:
                s = np.where(future, -np.inf, s).astype(F32)
            e = np.exp(s - s.max(-1, keepdims=True))
            p = rb(e / e.sum(-1, keepdims=True)).reshape(T * G, end)
            o[:, kh * G:(kh + 1) * G] = rb(p @ V[kh, :end]).reshape(T, G, hd)
        return o

    # ------------------------------------------------------------------ the model
    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """lm_head on final-normed rows [M, H] float32 → logits [M, V] bf16 (``head_gemv``: row-invariant)."""
        return head_gemv(np.ascontiguousarray(hidden), self.lm_head).astype(BF16)

    def block(self, L: dict, x: np.ndarray, mix, path: str) -> np.ndarray:
        """One decoder layer on x [T, H]: ``mix(normed x)`` is the token mixer (GDN or attention), then o-proj +
        residual, SwiGLU MLP + residual, at the reference's bf16 rounding points."""
        eps = self.cfg.rms_norm_eps
        mul = mm_rows if path == "step" else (lambda a, w: a @ w.T)
        o = mix(rmsnorm(x, L["in_norm"], eps))
        x = rb(rb(mul(o, L["out"])) + x)
        gu = mul(rmsnorm(x, L["post_norm"], eps), L["gate_up"])
        F = gu.shape[1] // 2
        h = rb(rb(silu(rb(gu[:, :F]))) * rb(gu[:, F:]))
        return rb(rb(mul(h, L["down"])) + x)

    def forward(self, st: FastState, ids, path: str, logit_rows=None, record: bool = False) -> np.ndarray | None:
        """Run ids [T] at positions st.pos.. through every layer; ``path`` 'chunk' (prefill) or 'step' (recurrent
        GDN per token, row-invariant bits). Returns logits [len(logit_rows) or T, V] bf16, or None for
        ``logit_rows="none"``; the final-normed rows stay in ``st.hidden`` (and ``st.hid``, the ids in ``st.toks``).
        ``record`` (step path, T ≤ RING_ROWS): keep the replay ring for ``keep_rows``. Raises ValueError for no ids,
        ids outside [0, V), or a position past the capacity."""
        c = self.cfg
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size < 1 or ids.min() < 0 or ids.max() >= self.embed_table.shape[0]:
            raise ValueError(f"forward: need 1+ ids in [0, {self.embed_table.shape[0]}), got {ids[:8]}...")
        pos0, T, eps = st.pos, ids.size, c.rms_norm_eps
        if pos0 + T > st.capacity:
            raise ValueError(f"forward: capacity {st.capacity} exceeded at position {pos0 + T}")
        if record and (path != "step" or T > RING_ROWS):
            raise ValueError(f"forward: record needs the step path and at most {RING_ROWS} rows, got {path} × {T}")
        cos, sin = rope_cos_sin(np.arange(pos0, pos0 + T), c, self.theta)
        cs = (f32(cos)[:, None, :], f32(sin)[:, None, :])
        x = f32(self.embed_table[ids])
        with np.errstate(over="ignore"):                                         # exp(-x) → inf in silu/sigmoid is fine
            for li, L in enumerate(self.layers):
                if li in self.skip:
                    continue
                if li in c.linear_layers:
                    mix = lambda hn, L=L, li=li: self._gdn(L, st, li, hn, path, record)  # noqa: E731
                else:
                    mix = lambda hn, L=L, li=li: self._attn(L, st.k[li], st.v[li], hn, pos0, cs, path)  # noqa: E731
                x = self.block(L, x, mix, path)
        st.hw = max(st.hw, pos0 + T)
        st.pos = pos0 + T
        st.hidden = rmsnorm(x, self.final_norm, eps)
        st.hid[pos0:pos0 + T], st.toks[pos0:pos0 + T] = st.hidden, ids
        if record:
            st.ring["rows"], st.ring["base"] = T, pos0
        if isinstance(logit_rows, str) and logit_rows == "none":
            return None
        return self.logits(st.hidden if logit_rows is None else st.hidden[np.asarray(logit_rows)])

    def prefill(self, st: FastState, ids, logit_rows=None, anchored: bool = True) -> np.ndarray | None:
        """Prompt path over T tokens at positions st.pos.. (chunked GDN) → logits [T, V] bf16 of this call's rows
        (``logit_rows`` only when given; None for ``"none"``); ``st.hidden`` their final-normed rows.

        Chunks of 64 anchored at the sequence start: when st.pos is past ``st.anchor`` the GDN state there is
        restored and ``st.toks[anchor:pos]`` (the ids run since: prefill rows and decoded tokens) re-run before
        ``ids``, one forward pass per 64-aligned chunk, the last one partial; K/V, ``toks`` and ``hid`` of the
        re-run rows are rewritten and ``mtp_pos`` drops to the anchor (MTP rows past it used the old hidden
        rows). The anchor then moves to the last multiple of 64 reached, its state copied into the slot's
        checkpoint arrays. Every pass therefore has the shape and inputs it has in one prefill of the whole
        history, and so its bits. ``anchored=False`` runs ``ids`` alone in chunks anchored at st.pos (negative
        controls and cost measurements only; the anchor is left alone, so later calls are not exact).
        Raises ValueError (state untouched) for no ids, ids outside [0, V) or a position past the capacity."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size < 1 or ids.min() < 0 or ids.max() >= self.embed_table.shape[0]:
            raise ValueError(f"prefill: need 1+ ids in [0, {self.embed_table.shape[0]}), got {ids[:8]}...")
        p = st.pos
        if p + ids.size > st.capacity:
            raise ValueError(f"prefill: capacity {st.capacity} exceeded at position {p + ids.size}")
        if not anchored:
            for s in range(0, ids.size, GDN_CHUNK):
                self.forward(st, ids[s:s + GDN_CHUNK], "chunk", "none")
        else:
            a = st.anchor
            run = ids
            if a < p:                                                        # back to the anchor, re-run since
                run = np.concatenate([st.toks[a:p], ids])
                self._restore_anchor(st)
                st.mtp_pos = min(st.mtp_pos, a)
            end = a + run.size
            cut = end // GDN_CHUNK * GDN_CHUNK
            for s in range(a, end, GDN_CHUNK):
                self.forward(st, run[s - a:s - a + GDN_CHUNK], "chunk", "none")
                if st.pos == cut > a:
                    self._save_anchor(st)
        st.hidden = st.hid[p:st.pos].copy()
        if isinstance(logit_rows, str) and logit_rows == "none":
            return None
        return self.logits(st.hidden if logit_rows is None else st.hidden[np.asarray(logit_rows)])

    @staticmethod
    def _save_anchor(st: FastState) -> None:
        """The current position (a multiple of 64) becomes the anchor: GDN state copied into the checkpoint arrays."""
        for i in st.rec:
            st.ck_conv[i][...] = st.conv[i]
            st.ck_rec[i][...] = st.rec[i]
        st.anchor = st.pos

    @staticmethod
    def _restore_anchor(st: FastState) -> None:
        """Back to the anchor: position and GDN state (K/V past it are rewritten by the re-run)."""
        for i in st.rec:
            st.conv[i][...] = st.ck_conv[i]
            st.rec[i][...] = st.ck_rec[i]
        st.pos = st.anchor

    def snapshot(self, st: FastState) -> dict:
        """Copies of what a later call may change below ``st.pos``: position, GDN state, anchor and its state,
        and the rows since the anchor (``toks``, ``hid``, K/V: a re-run rewrites them). Rows below the anchor
        are never rewritten, so they are not copied."""
        a, p = st.anchor, st.pos
        return {"pos": p, "anchor": a, "conv": {i: x.copy() for i, x in st.conv.items()},
                "rec": {i: x.copy() for i, x in st.rec.items()},
                "ck_conv": {i: x.copy() for i, x in st.ck_conv.items()},
                "ck_rec": {i: x.copy() for i, x in st.ck_rec.items()},
                "toks": st.toks[a:p].copy(), "hid": st.hid[a:p].copy(),
                "k": {i: x[:, a:p].copy() for i, x in st.k.items()},
                "v": {i: x[:, a:p].copy() for i, x in st.v.items()}}

    def restore(self, st: FastState, snap: dict) -> None:
        """Put a ``snapshot`` of this slot's history back, in place (no allocation): the state equals the one
        the snapshot was taken of, for decode and for the next prefill's re-run. ``hidden`` is dropped,
        ``mtp_pos`` drops to the snapshot's anchor, the replay ring is emptied."""
        a, p = snap["anchor"], snap["pos"]
        for i in st.rec:
            st.conv[i][...], st.rec[i][...] = snap["conv"][i], snap["rec"][i]
            st.ck_conv[i][...], st.ck_rec[i][...] = snap["ck_conv"][i], snap["ck_rec"][i]
        for i in st.k:
            st.k[i][:, a:p], st.v[i][:, a:p] = snap["k"][i], snap["v"][i]
        st.toks[a:p], st.hid[a:p] = snap["toks"], snap["hid"]
        st.pos, st.anchor = p, a
        st.hw = max(st.hw, p)
        st.hidden = None
        st.mtp_pos = min(st.mtp_pos, a, max(p - 1, 0))      # MTP row t needs the id at t + 1
        if st.ring is not None:
            st.ring["rows"] = 0

    def park(self, st: FastState, copy: bool = True) -> dict:
        """Copies of everything ``st`` holds for its ``pos`` tokens (for a move to another slot): K/V, ``toks``
        and ``hid`` rows below ``pos``, GDN conv + recurrent state, the anchor and its GDN state, ``hidden``, and
        the MTP cache rows below ``mtp_pos`` (None when it was never allocated). The replay ring is not kept: it
        is only live inside a speculative round (between ``decode(record=True)`` and ``keep_rows``).
        ``copy=False``: views of the same arrays instead (their sizes, without copying)."""
        p, m = st.pos, st.mtp_pos
        c = (lambda x: x.copy()) if copy else (lambda x: x)  # noqa: E731
        cd = lambda d: {i: c(x) for i, x in d.items()}  # noqa: E731
        return {"pos": p, "anchor": st.anchor, "mtp_pos": m,
                "k": {i: c(x[:, :p]) for i, x in st.k.items()},
                "v": {i: c(x[:, :p]) for i, x in st.v.items()},
                "conv": cd(st.conv), "rec": cd(st.rec), "ck_conv": cd(st.ck_conv), "ck_rec": cd(st.ck_rec),
                "toks": c(st.toks[:p]), "hid": c(st.hid[:p]),
                "hidden": None if st.hidden is None else c(st.hidden),
                "mtp_k": None if st.mtp_k is None else c(st.mtp_k[:, :m]),
                "mtp_v": None if st.mtp_v is None else c(st.mtp_v[:, :m])}

    def unpark(self, st: FastState, data: dict) -> None:
        """Put a ``park`` result into ``st`` (of the same capacity, cleared): afterwards it decodes and prefills
        bit-identically to the state parked. Raises ValueError when ``data`` holds more positions than ``st``."""
        p, m = data["pos"], data["mtp_pos"]
        if p > st.capacity:
            raise ValueError(f"FastModel.unpark: {p} positions parked, the state holds {st.capacity}")
        for i in st.k:
            st.k[i][:, :p], st.v[i][:, :p] = data["k"][i], data["v"][i]
        for i in st.rec:
            st.conv[i][...], st.rec[i][...] = data["conv"][i], data["rec"][i]
            st.ck_conv[i][...], st.ck_rec[i][...] = data["ck_conv"][i], data["ck_rec"][i]
        st.toks[:p], st.hid[:p] = data["toks"], data["hid"]
        st.pos, st.anchor, st.hw = p, data["anchor"], max(st.hw, p)
        st.hidden = None if data["hidden"] is None else data["hidden"].copy()
        if data["mtp_k"] is not None:
            if st.mtp_k is None:
                c = self.cfg
                st.mtp_k, st.mtp_v = (np.full((c.num_key_value_heads, st.capacity, c.head_dim), np.nan, F32)
                                      for _ in "kv")
            st.mtp_k[:, :m], st.mtp_v[:, :m] = data["mtp_k"], data["mtp_v"]
        st.mtp_pos = m if data["mtp_k"] is not None else 0
        if st.ring is not None:
            st.ring["rows"] = 0

    def decode(self, st: FastState, ids, record: bool = False) -> np.ndarray:
        """Generation / verify path: ids [M] (a scalar is M = 1) at positions st.pos.. → logits [M, V] bf16, each
        row bit-identical to decoding its token alone after the rows before it; ``record`` keeps the replay ring."""
        return self.forward(st, ids, "step", record=record)


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, hd] (bf16 values); cos/sin [T, 1, rd]. rb(rb(x·cos) + rb(rotate_half(x)·sin)) on dims < rd."""
    rd = cos.shape[-1]
    half = rd // 2
    xr = x[..., :rd]
    rot = np.concatenate([-xr[..., half:], xr[..., :half]], -1)
    return np.concatenate([rb(rb(xr * cos) + rb(rot * sin)), x[..., rd:]], -1)


def gdn_chunked(q, k, v, g, beta, S0, chunk: int = GDN_CHUNK):
    """Chunked gated delta rule in float32 (WY/UT form of ``assembler.ref.gdn.gdn_prefill_chunked``; chunks anchored
    at the first token, T zero-padded to a multiple of ``chunk``). q, k [T, H, d_k] (l2-normed, q scaled), v
    [T, H, d_v] (bf16 values), g [T, H], beta [T, H] float32; S0 [H, d_k, d_v] float32 (not modified).
    Returns (o [T, H, d_v] float32 bf16 values, S [H, d_k, d_v] float32)."""
    T, H, dk = k.shape
    pad = (-T) % chunk
    n = (T + pad) // chunk

    def blocks(x):                                                               # [T, H, ...] → [H, n, chunk, ...]
        x = np.moveaxis(x, 0, 1)
        x = np.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return np.ascontiguousarray(x.reshape(H, n, chunk, *x.shape[2:]))
    qf, kf, vf, bf, gf = (blocks(a) for a in (q, k, v, beta, g))
    kb = kf * bf[..., None]
    cum = np.cumsum(gf, axis=-1, dtype=F32)                                      # [H, n, chunk]
    lower = np.tril(np.ones((chunk, chunk), bool))
    D = np.where(lower, np.exp(np.where(lower, cum[..., :, None] - cum[..., None, :], F32(0))), F32(0))
    kT = np.swapaxes(kf, -1, -2)
    A = (kb @ kT) * D                                                            # only its strict lower part is used
    intra = (qf @ kT) * D
    ecum = np.exp(cum)
    UW = np.concatenate([vf * bf[..., None], kb * ecum[..., None]], -1)         # solve (I + strict_lower A) X = B
    for i in range(1, chunk):                                                    # forward substitution, as the reference
        UW[..., i, :] -= (A[..., i:i + 1, :i] @ UW[..., :i, :])[..., 0, :]
    dv = vf.shape[-1]
    U, W = UW[..., :dv], UW[..., dv:]
    qd = qf * ecum[..., None]
    kdT = np.swapaxes(kf * np.exp(cum[..., -1:] - cum)[..., None], -1, -2)       # [H, n, d_k, chunk]
    cdec = ecum[..., -1]                                                         # [H, n]
    S = S0.copy()
    out = np.empty_like(U)
    for i in range(n):
        vn = U[:, i] - W[:, i] @ S
        out[:, i] = qd[:, i] @ S + intra[:, i] @ vn
        S = S * cdec[:, i, None, None] + kdT[:, i] @ vn
    o = out.reshape(H, n * chunk, dv)[:, :T]
    return rb(np.moveaxis(o, 0, 1)), S


def agreement(cand: np.ndarray, ref: np.ndarray) -> tuple[dict, list[str]]:
    """Score candidate logits against reference logits, both [T, V] (any float dtype; bf16 values), per position:
    d32 = max |cand − ref| over the reference's top-32 ids, reduced by one bf16 ulp of the reference's top-1 logit
    (docs/tolerance.md); top-1 = full-vocabulary argmax equal (lowest id on ties). Fails when a d32 statistic
    (max, p99, p50, mean) exceeds D32_BOUNDS or the argmax differs at a position whose reference top-1/top-2
    margin exceeds TIE_MARGIN + 1 ulp (near-ties may flip). Returns (stats, failure messages): stats has the
    d32 statistics, ``top1`` (agreement rate), ``max_abs`` (full-vocabulary max |cand − ref|), ``positions``,
    ``flip_margins`` (reference margins where the argmax differs)."""
    c, r = f32(cand).reshape(-1, cand.shape[-1]), f32(ref).reshape(-1, ref.shape[-1])
    if c.shape != r.shape:
        raise ValueError(f"agreement: candidate logits {c.shape} and reference logits {r.shape} differ in shape")
    top = np.argsort(-r, axis=-1, kind="stable")[:, :32]
    tv = np.take_along_axis(r, top, -1)
    ulp = _ulp(tv[:, 0])
    d32 = np.maximum(np.abs(np.take_along_axis(c, top, -1) - tv).max(-1) - ulp, 0)
    st = _stats(d32)
    margin = tv[:, 0] - tv[:, 1]
    agree = c.argmax(-1) == r.argmax(-1)
    stats = {**{f"d32_{k}": v for k, v in st.items()}, "top1": float(agree.mean()),
             "max_abs": float(np.abs(c - r).max()), "positions": int(agree.size),
             "flip_margins": [float(m) for m in margin[~agree]]}
    fails = [f"d32 {k} (less 1 ulp) {st[k]:.4g} > bound {D32_BOUNDS[k]:.4g}" for k in D32_BOUNDS if st[k] > D32_BOUNDS[k]]
    bad = np.flatnonzero(~agree & (margin > TIE_MARGIN + ulp))
    if bad.size:
        fails.append(f"top-1 differs at {bad.size} clear positions (reference margin > tie bound), first t="
                     f"{bad[:5].tolist()} margins {margin[bad[:5]].tolist()}")
    return stats, fails
