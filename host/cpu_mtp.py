"""The MTP head on the fast CPU model: the draft model of speculative decoding (``host.speculate``).

One MTP step (spec §4, ``assembler/ref/mtp.py``, wired as ``tools/train/train.py`` trained it):
``x = fc(cat[pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)])``, one full-attention decoder layer
``mtp.layers.0`` with its own KV cache, ``mtp.norm``, then the shared lm_head → logits of token t+2. The row of
base position t sits at MTP position t (RoPE and cache row), as in training. Chaining: step k feeds the previous
step's normed output as the hidden and its draft as the token, at position t + k − 1.

The MTP cache holds the step-1 row of every position below ``st.mtp_pos``; ``catch_up`` fills it from the main
model's hidden rows and ids (``FastState.hid`` / ``toks``) before a round drafts, so chained rows written past it
in an earlier round are overwritten. Float32 as ``host.cpu_fast`` (the draft's bits only decide what is proposed,
never what is emitted).

Pruned draft head (``WorkingVocab``): the draft reads only the lm_head rows of a working vocabulary, a static core
of frequent ids plus every id the session has seen, so a draft step costs a fraction of the full head.
"""
from __future__ import annotations

import numpy as np

from assembler.ref.attention import rope_cos_sin
from assembler.ref.numerics import f32
from host.cpu_fast import F32, FastModel, FastState, mm_rows, rb, rmsnorm
from loader.config import FIRST_PADDING_ID, ENDOFTEXT_ID

CATCH_UP_PIECE = 256  # longest MTP catch-up call (bounds its [T, T] attention scores)


class FastMtp:
    """The MTP head of ``model`` (a FastModel whose weights hold ``mtp.*``). ``swap=True`` concatenates
    [hidden, embedding] (the wrong order: negative controls only). Raises KeyError when the weights hold no MTP."""

    def __init__(self, model: FastModel, swap: bool = False):
        m, c = model, model.cfg
        self.model, self.cfg, self.swap = m, c, swap
        if "mtp.fc.weight" not in set(m._src.names()):
            raise KeyError("the checkpoint holds no mtp.* tensors (no MTP head to draft with)")
        self.fc = m._lin("mtp.fc")                                           # [H, 2H] float32
        self.ne, self.nh = m._norm("mtp.pre_fc_norm_embedding.weight"), m._norm("mtp.pre_fc_norm_hidden.weight")
        self.norm = m._norm("mtp.norm.weight")
        self.layer = m._layer("mtp.layers.0.", False)

    def ensure_state(self, st: FastState) -> None:
        """Allocate the MTP cache of ``st`` once (K, V [n_kv, capacity, head_dim], NaN)."""
        if st.mtp_k is None:
            c = self.cfg
            st.mtp_k, st.mtp_v = (np.full((c.num_key_value_heads, st.capacity, c.head_dim), np.nan, F32) for _ in "kv")
            st.mtp_pos = 0

    def forward(self, st: FastState, ids: np.ndarray, hidden: np.ndarray, pos0: int) -> np.ndarray:
        """MTP rows at MTP positions pos0..: ids [T] = token t+1 of each row, hidden [T, H] = main final-normed
        hidden at t (or the previous step's output) → mtp-normed hidden [T, H] (the head input; the next step's
        hidden). Writes the rows' K/V into the MTP cache."""
        c, eps, m = self.cfg, self.cfg.rms_norm_eps, self.model
        T = ids.size
        e = rmsnorm(f32(m.embed_table[ids]), self.ne, eps)
        h = rmsnorm(hidden, self.nh, eps)
        cat = np.concatenate([h, e] if self.swap else [e, h], axis=-1)
        path = "step" if T == 1 else "chunk"
        x = rb(mm_rows(cat, self.fc) if T == 1 else cat @ self.fc.T)
        cos, sin = rope_cos_sin(np.arange(pos0, pos0 + T), c, m.theta)
        cs = (f32(cos)[:, None, :], f32(sin)[:, None, :])
        with np.errstate(over="ignore"):
            x = m.block(self.layer, x, lambda hn: m._attn(self.layer, st.mtp_k, st.mtp_v, hn, pos0, cs, path), path)
        return rmsnorm(x, self.norm, eps)

    def catch_up(self, st: FastState, upto: int) -> None:
        """Write the step-1 rows of positions st.mtp_pos .. upto − 1 (each: main hidden at t, id at t + 1; both
        below ``st.pos``) into the MTP cache, in pieces of CATCH_UP_PIECE; ``st.mtp_pos`` becomes ``upto``."""
        while st.mtp_pos < upto:
            p = st.mtp_pos
            n = min(CATCH_UP_PIECE, upto - p)
            self.forward(st, st.toks[p + 1:p + 1 + n], st.hid[p:p + n], p)
            st.mtp_pos = p + n


class WorkingVocab:
    """The pruned draft head of one session: lm_head rows of a static core of ids (``core``: ids [0, core_size)
    and the added / special tokens, BPE ids being roughly in frequency order) plus every id seen since ``reset``.
    Rows are gathered into a buffer allocated once (core + capacity rows); ``core_size`` None = the full head
    (248,077 real ids, no pruning)."""

    def __init__(self, lm_head: np.ndarray, core_size: int | None, capacity: int):
        V = FIRST_PADDING_ID
        self.lm_head, self.full = lm_head, core_size is None or core_size >= ENDOFTEXT_ID
        core = np.arange(V) if self.full else np.union1d(np.arange(core_size), np.arange(ENDOFTEXT_ID, V))
        self.n_core = core.size
        self.ids = np.empty(core.size + (0 if self.full else capacity), np.int64)
        self.ids[:core.size] = core
        self.rows = np.empty((self.ids.size, lm_head.shape[1]), F32) if not self.full else lm_head[:V]
        if not self.full:
            self.rows[:core.size] = lm_head[core]
        self.member = np.zeros(V, bool)
        self.member[core] = True
        self.n = core.size

    def reset(self) -> None:
        """Back to the static core (a new conversation)."""
        self.member[self.ids[self.n_core:self.n]] = False
        self.n = self.n_core

    def add(self, ids: np.ndarray) -> None:
        """Make ``ids`` (seen in the session) part of the working vocabulary."""
        if self.full:
            return
        ids = np.asarray(ids, np.int64).reshape(-1)
        ids = ids[ids < FIRST_PADDING_ID]
        new = np.unique(ids[~self.member[ids]])
        new = new[:self.ids.size - self.n]
        if new.size:
            self.ids[self.n:self.n + new.size] = new
            self.rows[self.n:self.n + new.size] = self.lm_head[new]
            self.member[new] = True
            self.n += new.size

    def logits(self, hn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Draft logits over the working vocabulary: (ids [n], logits [T, n] float32 of bf16 values)."""
        return self.ids[:self.n], rb(mm_rows(hn, self.rows[:self.n]))
