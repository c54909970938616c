"""Model-level NumPy reference: the whole Qwen3.5 text decoder (+ MTP head) composed from ``assembler.ref.ops``.

``prefill`` is the prompt path (chunked GDN anchored at the call's first token, eager causal attention),
``decode`` the generation / verify path (sequential GDN step, split-KV two-pass attention), each with the
rounding points of the matching transformers 5.24 path (spec §3). Weights come from a WeightSource
(docs/INTERFACES.md §1) and stay in their stored dtypes.
"""
from __future__ import annotations

import numpy as np

from assembler.numerics import GDN_CHUNK, attn_partitions, split_k
from assembler.ref import ops
from assembler.ref.numerics import BF16, need
from assembler.ref.state import ModelState
from loader.config import ModelConfig


def proj_splits(cfg: ModelConfig) -> dict[str, int]:
    """Split-K factor of every projection, from the row count of the matrix the engine streams (fusions as
    DESIGN.md: gate|up, q|k|v, in_proj_qkv|z, in_proj_b|a; others unfused). Changing a fusion changes bits."""
    H, F = cfg.hidden_size, cfg.intermediate_size
    return {
        "gate_up": split_k(2 * F, H), "down": split_k(H, F),
        "qkv_attn": split_k(cfg.q_proj_rows + 2 * cfg.kv_rows, H), "o_proj": split_k(H, cfg.attn_out_dim),
        "qkvz": split_k(cfg.gdn_conv_dim + cfg.gdn_value_dim, H), "ba": split_k(2 * cfg.linear_num_value_heads, H),
        "out_proj": split_k(H, cfg.gdn_value_dim), "lm_head": split_k(cfg.vocab_size, H),
        "mtp_fc": split_k(H, 2 * H),
    }


class ReferenceModel:
    """The reference model. ``weights``: a WeightSource (``.config``, ``.get(name)``); ``rope_theta`` overrides
    the config's RoPE base (negative controls only). ``oracle_weights=True`` replaces every fp8 weight by the
    oracle's bf16(fp32(w)·fp32(scale)) (transformers dequantises up front), isolating the op math from the
    weight rounding in oracle comparisons; the engine's definition is the default (exact fp8 × scale in fp32).
    Tensors are read once at construction."""

    def __init__(self, weights, rope_theta: float | None = None, oracle_weights: bool = False):
        self.cfg: ModelConfig = weights.config
        self.theta = rope_theta
        self.oracle_weights = oracle_weights
        self.sp = proj_splits(self.cfg)
        self._w: dict[str, np.ndarray | None] = {}
        self._src = weights
        self.parts = attn_partitions(self.cfg)
        c = self.cfg
        self.embed_table = self._get("model.embed_tokens.weight")
        self.lm_head = ops.widen(self._get("lm_head.weight"))             # float64 cache: 8 B per element
        self.final_norm = self._get("model.norm.weight")
        self.layers = [self._layer(f"model.layers.{i}.", i in c.linear_layers) for i in range(c.num_hidden_layers)]
        self.mtp = None
        if c.mtp_num_hidden_layers and "mtp.fc.weight" in set(weights.names()):
            self.mtp = {"fc": ops.widen(self._get("mtp.fc.weight")), "ne": self._get("mtp.pre_fc_norm_embedding.weight"),
                        "nh": self._get("mtp.pre_fc_norm_hidden.weight"), "norm": self._get("mtp.norm.weight"),
                        "layer": self._layer("mtp.layers.0.", False)}

    # ------------------------------------------------------------------ weights
    def _get(self, name: str) -> np.ndarray:
        return np.asarray(self._src.get(name))

    def _lin(self, name: str):
        w = self._get(name + ".weight")
        s = self._get(name + ".weight_scale_inv") if w.dtype != BF16 else None
        if s is not None and self.oracle_weights:                          # the oracle's bf16(w·s) weights
            w, s = ops.dequantize_bf16(w, s), None
        return ops.widen(w), s

    def _layer(self, p: str, linear: bool) -> dict:
        L = {"in_norm": self._get(p + "input_layernorm.weight"), "post_norm": self._get(p + "post_attention_layernorm.weight")}
        (g, gs), (u, us) = self._lin(p + "mlp.gate_proj"), self._lin(p + "mlp.up_proj")
        L["gate_up"] = (np.concatenate([g, u]), None if gs is None else np.concatenate([gs, us]))  # fused rows
        L["down"] = self._lin(p + "mlp.down_proj")
        if linear:
            a = p + "linear_attn."
            for n in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"):
                L[n] = self._lin(a + n)
            for n in ("conv1d.weight", "A_log", "dt_bias", "norm.weight"):
                L[n] = self._get(a + n)
        else:
            a = p + "self_attn."
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                L[n] = self._lin(a + n)
            L["q_norm"], L["k_norm"] = self._get(a + "q_norm.weight"), self._get(a + "k_norm.weight")
        return L

    # ------------------------------------------------------------------ state
    def new_state(self, capacity: int) -> ModelState:
        """Fresh session state for up to ``capacity`` tokens (KV past the valid length is NaN)."""
        return ModelState.empty(self.cfg, capacity)

    # ------------------------------------------------------------------ layers
    def _gdn(self, L: dict, st: ModelState, li: int, h: np.ndarray, path: str) -> tuple[np.ndarray, dict]:
        c = self.cfg
        T = h.shape[0]
        qkv = ops.gemv(*L["in_proj_qkv"], h, split=self.sp["qkvz"])
        z = ops.gemv(*L["in_proj_z"], h, split=self.sp["qkvz"])
        b = ops.gemv(*L["in_proj_b"], h, split=self.sp["ba"])
        a = ops.gemv(*L["in_proj_a"], h, split=self.sp["ba"])
        y, conv = ops.gdn_conv_step(qkv, st.conv[li], L["conv1d.weight"])
        kd, vd, nk, nv, dk = c.gdn_key_dim, c.gdn_value_dim, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim
        rep = c.gdn_head_group
        q = np.repeat(y[:, :kd].reshape(T, nk, dk), rep, axis=1)         # value head j <- key head j // rep
        k = np.repeat(y[:, kd:2 * kd].reshape(T, nk, dk), rep, axis=1)
        v = np.ascontiguousarray(y[:, 2 * kd:].reshape(T, nv, c.linear_value_head_dim))
        g, beta = ops.gdn_gates(a, b, L["A_log"], L["dt_bias"])
        qn, kn = ops.gdn_qk_norm(q, k, path)
        if path == "chunk":
            o, S = ops.gdn_prefill_chunked(qn, kn, v, g, beta, st.rec[li], GDN_CHUNK)
        else:
            S, outs = st.rec[li], []
            for t in range(T):
                ot, S = ops.gdn_step_head(qn[t], kn[t], v[t], g[t], beta[t], S)
                outs.append(ot)
            o = np.stack(outs)
        o = ops.rmsnorm_gated(o, z.reshape(T, nv, -1), L["norm.weight"], c.rms_norm_eps).reshape(T, vd)
        return o, {"conv": conv, "rec": S}

    def _attn(self, L: dict, K: np.ndarray, V: np.ndarray, h: np.ndarray, pos0: int, path: str) -> np.ndarray:
        """Gated attention for rows at positions pos0.. ; writes their K/V into K, V [capacity, nkv, hd]."""
        c = self.cfg
        T = h.shape[0]
        qg = ops.gemv(*L["q_proj"], h, split=self.sp["qkv_attn"])
        k = ops.gemv(*L["k_proj"], h, split=self.sp["qkv_attn"])
        v = ops.gemv(*L["v_proj"], h, split=self.sp["qkv_attn"])
        pos = np.arange(pos0, pos0 + T)
        q, gate, k, v = ops.attn_prep(qg, k, v, L["q_norm"], L["k_norm"], pos, c, self.theta)
        need(pos0 + T <= K.shape[0], f"attention: capacity {K.shape[0]} exceeded at position {pos0 + T}")
        K[pos0:pos0 + T], V[pos0:pos0 + T] = k, v
        if path == "chunk":
            o = ops.attn_prefill(q, K[:pos0 + T], V[:pos0 + T], pos)
        else:
            G, hd = c.gqa_group, c.head_dim
            o = np.empty((T, c.num_attention_heads, hd), BF16)
            for t in range(T):
                for kh in range(c.num_key_value_heads):
                    o[t, kh * G:(kh + 1) * G] = ops.attn_decode_group(
                        q[t, kh * G:(kh + 1) * G], K[:pos0 + t + 1, kh], V[:pos0 + t + 1, kh], self.parts)
            o = o.reshape(T, -1)
        return ops.attn_gate(o, gate)

    def _block(self, L: dict, x: np.ndarray, mix) -> np.ndarray:
        eps = self.cfg.rms_norm_eps
        o, proj = mix(ops.rmsnorm(x, L["in_norm"], eps))
        x = ops.gemv(*L[proj], o, "residual", residual=x, split=self.sp[proj])
        a = ops.gemv(*L["gate_up"], ops.rmsnorm(x, L["post_norm"], eps), "swiglu", split=self.sp["gate_up"])
        return ops.gemv(*L["down"], a, "residual", residual=x, split=self.sp["down"])

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """lm_head GEMV on final-normed hidden rows [M, H] bf16 → [M, V] bf16 (row-independent)."""
        return ops.gemv(self.lm_head, None, hidden, "store", split=self.sp["lm_head"])

    def _forward(self, st: ModelState, ids, path: str, logit_rows=None) -> np.ndarray | None:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        need(ids.size >= 1, "forward: need at least one token")
        pos0 = st.pos
        x = ops.embed(self.embed_table, ids)
        for li, L in enumerate(self.layers):
            if li in self.cfg.linear_layers:
                def mix(h, L=L, li=li):
                    o, new = self._gdn(L, st, li, h, path)
                    st.conv[li], st.rec[li] = new["conv"], new["rec"]
                    return o, "out_proj"
            else:
                def mix(h, L=L, li=li):
                    return self._attn(L, st.k[li], st.v[li], h, pos0, path), "o_proj"
            x = self._block(L, x, mix)
        hn = ops.rmsnorm(x, self.final_norm, self.cfg.rms_norm_eps)
        st.pos = pos0 + ids.size
        st.hidden = hn
        if isinstance(logit_rows, str) and logit_rows == "none":
            return None
        return self.logits(hn if logit_rows is None else hn[np.asarray(logit_rows)])

    # ------------------------------------------------------------------ public paths
    def prefill(self, st: ModelState, ids, logit_rows=None) -> np.ndarray | None:
        """Prompt path over T tokens at positions st.pos.. → logits [T, V] bf16 (only ``logit_rows`` when given;
        None for ``logit_rows="none"``; the final-normed hidden rows stay in ``st.hidden``).

        GDN chunks are anchored at st.pos; when st.pos is a multiple of 64 the call is cut at the last 64-aligned
        position it reaches, whose GDN state is kept as ``st.ckpt`` (bit-identical to an uncut pass: the chunks
        are the same). Re-running an append from ``st.restore_checkpoint()`` therefore equals one pass."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        hs = []
        if st.pos % GDN_CHUNK == 0:
            st.save_checkpoint()
            cut = ((st.pos + ids.size) // GDN_CHUNK) * GDN_CHUNK - st.pos
            if 0 < cut < ids.size:
                self._forward(st, ids[:cut], "chunk", "none")
                hs.append(st.hidden)
                st.save_checkpoint()
                ids = ids[cut:]
        self._forward(st, ids, "chunk", "none")
        hs.append(st.hidden)
        if st.pos % GDN_CHUNK == 0:
            st.save_checkpoint()
        st.hidden = np.concatenate(hs)
        if isinstance(logit_rows, str) and logit_rows == "none":
            return None
        return self.logits(st.hidden if logit_rows is None else st.hidden[np.asarray(logit_rows)])

    def decode(self, st: ModelState, ids, logits: bool = True) -> np.ndarray | None:
        """Generation / verify path: M ≤ 8 tokens at positions st.pos.. → logits [M, V] bf16 (row t sees the
        cache and rows < t). A scalar id is M = 1. ``logits=False`` skips the lm_head (the final-normed hidden
        rows stay in ``st.hidden``; ``self.logits(st.hidden)`` gives the same bits later)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        need(1 <= ids.size <= 8, f"decode: expected 1..8 tokens, got {ids.size}")
        return self._forward(st, ids, "step", None if logits else "none")

    def mtp_draft(self, st: ModelState, next_ids, hidden: np.ndarray, swap: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """MTP head for rows at MTP positions st.mtp_pos.. (spec §4): next_ids [M] = token t+1 of each row, hidden
        [M, H] bf16 = final-normed main hidden at t (or the previous draft's normed output when chaining).
        Returns (logits [M, V] bf16 for token t+2, mtp-normed hidden [M, H]). ``swap`` = negative control."""
        need(self.mtp is not None, "mtp_draft: the weights hold no mtp.* tensors")
        c, m = self.cfg, self.mtp
        ids = np.asarray(next_ids, dtype=np.int64).reshape(-1)
        x = ops.mtp_input(ops.embed(self.embed_table, ids), hidden, m["ne"], m["nh"], m["fc"], c.rms_norm_eps, swap)
        pos0 = st.mtp_pos
        x = self._block(m["layer"], x, lambda h: (self._attn(m["layer"], st.mtp_k, st.mtp_v, h, pos0, "step"), "o_proj"))
        st.mtp_pos = pos0 + ids.size
        logits, hn = ops.mtp_step(x, m["norm"], self.lm_head, c.rms_norm_eps)
        return logits, hn
