"""MTP head reference ops (spec §4; vLLM/SGLang ``qwen3_5_mtp.py``).

x = mtp.fc(cat[pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)]) — embedding half first — where
h_t is the main model's final-normed hidden state; then one full-attention decoder layer ``mtp.layers.0``
(composed in ``assembler.ref.model``), ``mtp.norm`` (1+w) and the shared lm_head.
"""
from __future__ import annotations

import numpy as np

from assembler.ref.dense import gemv, rmsnorm
from assembler.ref.numerics import BF16, need, need_dtype


def mtp_input(e: np.ndarray, h: np.ndarray, norm_e_w: np.ndarray, norm_h_w: np.ndarray, fc_w: np.ndarray,
              eps: float, swap: bool = False) -> np.ndarray:
    """fc input concat and projection. e, h [M, H] bf16 (embedding of token t+1, final-normed hidden at t);
    norm weights [H] bf16; fc_w [H, 2H] bf16 → x [M, H] bf16 (GEMV store, bf16 weight, scale 1).

    ``swap=True`` concatenates [hidden, embedding] (wrong order; exists for the negative control only)."""
    need_dtype(e, BF16, "mtp_input: e")
    need_dtype(h, BF16, "mtp_input: h")
    need(fc_w.shape == (e.shape[1], 2 * e.shape[1]), f"mtp_input: fc weight must be [{e.shape[1]}, {2 * e.shape[1]}], got {fc_w.shape}")
    ne, nh = rmsnorm(e, norm_e_w, eps), rmsnorm(h, norm_h_w, eps)
    cat = np.concatenate([nh, ne] if swap else [ne, nh], axis=-1)
    return gemv(fc_w, None, cat, "store")


def mtp_step(x_layer_out: np.ndarray, mtp_norm_w: np.ndarray, lm_head: np.ndarray, eps: float):
    """Tail of the MTP head: ``lm_head(mtp.norm(x))``. x [M, H] bf16 (output of mtp.layers.0) → (logits [M, V]
    bf16, normed hidden [M, H] bf16 — the hidden the next draft step chains on)."""
    hn = rmsnorm(x_layer_out, mtp_norm_w, eps)
    return gemv(lm_head, None, hn, "store"), hn
