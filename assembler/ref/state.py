"""Session state of the reference model (docs/INTERFACES.md §3 ``ModelState``)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from assembler.ref.numerics import BF16
from loader.config import ModelConfig


@dataclass
class ModelState:
    """Explicit state: per full-attention layer K, V [capacity, n_kv, head_dim] bf16 (NaN past ``pos``); per GDN
    layer ``conv`` [conv_dim, kernel−1] bf16 (oldest first) and ``rec`` [n_v, d_k, d_v] fp32; ``pos`` tokens
    processed; ``hidden`` final-normed hidden rows of the last call; MTP K/V and ``mtp_pos``; ``ckpt`` the GDN
    state at the last 64-aligned position a prefill reached."""

    cfg: ModelConfig
    capacity: int
    pos: int = 0
    k: dict = field(default_factory=dict)
    v: dict = field(default_factory=dict)
    conv: dict = field(default_factory=dict)
    rec: dict = field(default_factory=dict)
    mtp_k: np.ndarray | None = None
    mtp_v: np.ndarray | None = None
    mtp_pos: int = 0
    hidden: np.ndarray | None = None
    ckpt: dict | None = None

    @classmethod
    def empty(cls, cfg: ModelConfig, capacity: int) -> "ModelState":
        if capacity < 1:
            raise ValueError(f"ModelState: capacity must be >= 1, got {capacity}")
        nan = lambda: np.full((capacity, cfg.num_key_value_heads, cfg.head_dim), np.nan, np.float32).astype(BF16)
        st = cls(cfg, capacity)
        for i in cfg.full_layers:
            st.k[i], st.v[i] = nan(), nan()
        for i in cfg.linear_layers:
            st.conv[i] = np.zeros((cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1), BF16)
            st.rec[i] = np.zeros((cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), np.float32)
        st.mtp_k, st.mtp_v = nan(), nan()
        return st

    def save_checkpoint(self) -> None:
        """Remember the GDN state at ``pos`` (a multiple of 64) for re-running appends from it."""
        self.ckpt = {"pos": self.pos, "conv": {i: a.copy() for i, a in self.conv.items()},
                     "rec": {i: a.copy() for i, a in self.rec.items()}}

    def restore_checkpoint(self) -> int:
        """Roll the GDN state back to the checkpoint and set ``pos`` to it (KV past it is rewritten by the
        re-run). Returns the checkpoint position. Raises ValueError when there is none."""
        if self.ckpt is None:
            raise ValueError("ModelState.restore_checkpoint: no checkpoint saved")
        self.pos = self.ckpt["pos"]
        self.conv = {i: a.copy() for i, a in self.ckpt["conv"].items()}
        self.rec = {i: a.copy() for i, a in self.ckpt["rec"].items()}
        return self.pos

    def copy(self) -> "ModelState":
        """Deep copy (verify passes roll back by keeping a copy)."""
        return copy.deepcopy(self)
