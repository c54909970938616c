"""CPU VM: executes an assembled program with the NumPy reference ops (``assembler/ref/ops.py``); the living
spec of the instruction set (STYLE.md habit 3).

Every SSA buffer is poisoned (NaN, token ids −1) at the start of a step, so an instruction that runs before
its producer reads poison and the step's result shows it. Before each instruction the VM asserts that every
counter it waits on has reached ``step × expected + offset``; after it, it bumps its counter and asserts the
counter did not pass ``step × expected`` (no overshoot). SMs run in a deterministic round-robin or in a
seeded random interleaving (random per-SM speeds; the earliest ready SM runs next). The model state is the reference's
``ModelState``, so a VM step can be compared with ``ReferenceModel.decode`` / ``mtp_draft`` bit for bit.
The VM holds no op math of its own: it slices buffers and calls the reference ops.

Fused split-K reduce (isa.py FUSE_REDUCE): after a fused GEMV stores its partials, the VM counts it in on each
16-row tile of its rows (per partial buffer, like the kernel's arrival counters) and the instruction that
brings a tile to S arrivals reduces it right away (the same ``gemv_reduce`` as GEMV_REDUCE) and resets the
count; so the reduce happens inside whichever split instruction the interleaving runs last.
"""
from __future__ import annotations

import dataclasses
import heapq
from functools import lru_cache

import numpy as np

from assembler.asm_regions import _gdn_part
from assembler.graph import ab_split, layer_prefix
from assembler.isa import Instruction, Opcode, fused_reduce, local_reduce, sub_parts, sub_src_split
from assembler.numerics import ROW_TILE, attn_partition_range, attn_partitions
from assembler.program import Program
from assembler.ref import ops
from assembler.ref.numerics import BF16
from loader.config import FIRST_PADDING_ID
from assembler.ref.state import ModelState
from loader.config import ModelConfig


class VMError(AssertionError):
    """A dependency violation (wait not met, overshoot) or a deadlock, naming the instruction."""


@lru_cache(maxsize=None)
def _group_cfg(cfg: ModelConfig, n_kv: int) -> ModelConfig:
    """The config seen by one attention slice: ``n_kv`` KV heads with their query heads (per-head math only)."""
    return cfg.replace(num_attention_heads=cfg.gqa_group * n_kv, num_key_value_heads=n_kv)


class VM:
    """Executes ``program`` against ``weights`` (a WeightSource; ``cache`` an optional dict shared by VMs over
    the same source). Counters persist across steps (monotonic), so one VM runs consecutive steps."""

    def __init__(self, program: Program, weights, cache: dict | None = None):
        self.p, self.g, self.cfg = program, program.graph, program.graph.cfg
        if weights.config.replace(name=self.cfg.name) != self.cfg:
            raise ValueError(f"VM: weights are for config {weights.config.name!r}, program for {self.cfg.name!r}")
        self.src = weights
        self._w: dict = {} if cache is None else cache  # weights by name; share between VMs of one source
        self.ctr = np.zeros(len(program.counters), np.int64)
        self.expected = np.array([c.expected for c in program.counters], np.int64)
        self.step_no = 0
        self.parts = attn_partitions(self.cfg)
        self.arrive: dict[int, np.ndarray] = {}  # partial buffer id → arrivals per output tile (fused reduce)

    # ------------------------------------------------------------------ weights (cached, stored dtypes)
    def _get(self, name: str) -> np.ndarray:
        if name not in self._w:
            self._w[name] = np.asarray(self.src.get(name))
        return self._w[name]

    def _matrix(self, wid: int):
        """(float64 fused rows, fused bf16 scales or None) of weight-table entry ``wid`` (widened once)."""
        names = self.p.weights[wid]
        key = ("mat", names)
        if key not in self._w:
            ws = [self._get(n) for n in names]
            sc = None if ws[0].dtype == BF16 else np.concatenate([self._get(n + "_scale_inv") for n in names])
            self._w[key] = (ops.widen(np.concatenate(ws)), sc)
        return self._w[key]

    # ------------------------------------------------------------------ a step
    def run_step(self, state: ModelState, tokens, hidden: np.ndarray | None = None, order: str = "rr",
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """One step over ``tokens`` (M ids) at positions state.pos.. (state.mtp_pos.. for an MTP program;
        ``hidden`` [M, H] bf16 is then the final-normed hidden input). ``order``: "rr" or "random" (seeded).
        Returns (logits [M, V] bf16, next ids [M] int32); advances the state. ``self.hidden`` is the head's
        normalised input (final-normed hidden; MTP-normed for an MTP program, the next draft's input), also
        stored as ``state.hidden`` for decode / verify as the reference does. Raises VMError on a violation."""
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        if tokens.size != self.g.m:
            raise ValueError(f"VM.run_step: program has m={self.g.m} rows, got {tokens.size} tokens")
        self.step_no += 1
        self.state, self.buf = state, {}
        for name, b in self.g.buffers.items():
            if b.kind == "state":
                continue
            shape = tuple(d or state.capacity for d in b.shape)  # a 0 extent (attention scores) = KV capacity
            if b.dtype == "i32":
                self.buf[name] = np.full(shape, -1, np.int32)
            else:
                self.buf[name] = np.full(shape, np.nan, np.float32).astype(BF16 if b.dtype == "bf16" else np.float32)
        self.buf["tokens"][:] = tokens
        if "hidden" in self.buf:
            if hidden is None or hidden.shape != self.buf["hidden"].shape or hidden.dtype != BF16:
                raise ValueError(f"VM.run_step: MTP program needs hidden bf16 {self.buf['hidden'].shape}")
            self.buf["hidden"][:] = hidden
        self.pos0 = state.mtp_pos if self.g.kind == "mtp" else state.pos
        self.conv0 = {}  # per GDN layer: the conv state as this step found it (split GDN parts read its history)
        self._interleave(order, seed)
        for b, cnt in self.arrive.items():
            if cnt.any():
                raise VMError(f"step {self.step_no}: {self.p.buffers[b].name} tiles left with arrivals {cnt[cnt > 0]}")
        if self.g.kind == "mtp":
            state.mtp_pos += self.g.m
        else:
            state.pos += self.g.m
            state.hidden = self.buf["hidden.out"].copy()
        self.hidden = self.buf["hidden.out"].copy()
        return self.buf["logits"].copy(), self.buf["next"].copy()

    def _ready(self, ins: Instruction) -> bool:
        return all(self.ctr[c] >= self.step_no * e + o for c, e, o in ins.waits)

    def _interleave(self, order: str, seed: int) -> None:
        """rr: SMs in index order, each running its head if ready. random: every SM gets a random speed
        (heavy-tailed, so some race ahead as far as their waits allow) and a random time per instruction; the
        SM with the earliest clock whose head is ready runs next."""
        if order not in ("rr", "random"):
            raise ValueError(f"VM: order must be 'rr' or 'random', got {order!r}")
        lists = self.p.sm_lists
        pos = [0] * len(lists)
        live = [s for s in range(len(lists)) if lists[s]]
        if order == "rr":
            while live:
                ran = False
                for s in list(live):
                    if self._ready(lists[s][pos[s]]):
                        self._exec(s, pos[s], lists[s][pos[s]])
                        pos[s] += 1
                        ran = True
                        if pos[s] == len(lists[s]):
                            live.remove(s)
                if not ran:
                    self._deadlock(live, pos)
            return
        rng = np.random.default_rng(seed)
        speed = rng.pareto(1.0, len(lists)) + 0.05
        heap = [(float(rng.exponential()), s) for s in live]
        heapq.heapify(heap)
        blocked: list = []
        while heap:
            t, s = heapq.heappop(heap)
            if not self._ready(lists[s][pos[s]]):
                blocked.append((t, s))
                if not heap and blocked:
                    self._deadlock([b for _, b in blocked], pos)
                continue
            self._exec(s, pos[s], lists[s][pos[s]])
            pos[s] += 1
            for item in blocked:
                heapq.heappush(heap, item)
            blocked = []
            if pos[s] < len(lists[s]):
                heapq.heappush(heap, (t + float(rng.exponential()) / speed[s], s))

    def _deadlock(self, live: list, pos: list) -> None:
        s = live[0]
        raise VMError(f"VM deadlock in step {self.step_no}: {len(live)} SMs blocked, first sm {s} "
                      f"#{pos[s]}: {self.p._ins_text(self.p.sm_lists[s][pos[s]])}")

    def _exec(self, sm: int, j: int, ins: Instruction) -> None:
        for c, e, o in ins.waits:
            if self.ctr[c] < self.step_no * e + o:
                raise VMError(f"sm {sm} #{j} started before {self.p.counters[c].name} reached its target")
        getattr(self, "_op_" + Opcode(ins.opcode).name.lower())(ins)
        self.ctr[ins.bump] += ins.bump_by
        if self.ctr[ins.bump] > self.step_no * self.expected[ins.bump]:
            raise VMError(f"sm {sm} #{j}: counter {self.p.counters[ins.bump].name} overshot step {self.step_no}")

    # ------------------------------------------------------------------ opcodes
    def _b(self, i: int) -> np.ndarray:
        return self.buf[self.p.buffers[i].name]

    def _op_nop(self, ins) -> None:
        pass

    def _op_embed(self, ins) -> None:
        self._b(ins.buf1)[:] = ops.embed(self._get("model.embed_tokens.weight"), self._b(ins.buf0))

    def _op_argmax(self, ins) -> None:
        # the device's greedy choice: padding ids (>= FIRST_PADDING_ID) never compete (lm_head.cuh, megakernel)
        self._b(ins.buf1)[:] = ops.argmax(self._b(ins.buf0), n_valid=min(FIRST_PADDING_ID, self._b(ins.buf0).shape[-1]))

    def _gemv_input(self, ins) -> np.ndarray:
        pro, _ = sub_parts(ins.sub)
        eps = self.cfg.rms_norm_eps
        if pro == "none":
            return self._b(ins.buf0)
        if pro == "rmsnorm":
            return ops.rmsnorm(self._b(ins.buf0), self._get(self.p.weights[ins.w1][0]), eps)
        if pro == "reduce_rmsnorm":  # the deferred producer's reduce (as GEMV_REDUCE), this slice's share stored
            P = self._b(ins.buf4)
            if P.shape[0] != sub_src_split(ins.sub):
                raise VMError(f"{self.g.ops[ins.op].name}: sub says S={sub_src_split(ins.sub)}, partials have "
                              f"{P.shape[0]}")
            x = ops.gemv_reduce(np.ascontiguousarray(P), "residual", residual=self._b(ins.buf2))
            self._b(ins.buf0)[:, ins.aux0:ins.aux1] = x[:, ins.aux0:ins.aux1]
            return ops.rmsnorm(x, self._get(self.p.weights[ins.w1][0]), eps)
        we, wh = self._get(self.p.weights[ins.w1][0]), self._get(self.p.weights[ins.w1 + 1][0])
        return np.concatenate([ops.rmsnorm(self._b(ins.buf0), we, eps), ops.rmsnorm(self._b(ins.buf4), wh, eps)], -1)

    def _op_gemv(self, ins) -> None:
        _, epi = sub_parts(ins.sub)
        w, sc = self._matrix(ins.w0)
        x = self._gemv_input(ins)
        if ins.buf5 >= 0:
            self._b(ins.buf5)[:] = x
        F, r0, r1 = w.shape[0] // 2, ins.row_start, ins.row_end
        if local_reduce(ins):  # every split of the rows here, reduced at once (as GEMV partials + GEMV_REDUCE)
            if epi != "store" or not 2 <= ins.nsplit <= 16:  # what the kernel runs (else its error 6)
                raise VMError(f"{self.g.ops[ins.op].name}: a local-reduce GEMV needs a store epilogue and 2..16 "
                              f"splits, got {epi} and {ins.nsplit}")
            P = np.stack([ops.gemv_partial(w, sc, x, slice(r0, r1), ins.nsplit, s) for s in range(ins.nsplit)])
            self._epilogue(ins, P, None)
            return
        p = ops.gemv_partial(w, sc, x, slice(r0, r1), ins.nsplit, ins.split)
        up = ops.gemv_partial(w, sc, x, slice(F + r0, F + r1), ins.nsplit, ins.split) if epi == "swiglu" else None
        if ins.nsplit > 1:
            P = self._b(ins.buf3)
            P[ins.split, :, r0:r1] = p
            if up is not None:
                P[ins.split, :, F + r0:F + r1] = up
            if fused_reduce(ins):
                self._arrive(ins, P, F if up is not None else P.shape[2])
            return
        self._epilogue(ins, p[None], None if up is None else up[None])

    def _arrive(self, ins, P: np.ndarray, n_out: int) -> None:
        """Count a fused GEMV in on the tiles of its rows; reduce (fixed split order + epilogue) every tile whose
        S partials are now all present, and reset its count (as qmk_gemv_finish_tile)."""
        cnt = self.arrive.setdefault(ins.buf3, np.zeros(-(-n_out // ROW_TILE), np.int64))
        _, epi = sub_parts(ins.sub)
        for t in range(ins.row_start // ROW_TILE, -(-ins.row_end // ROW_TILE)):
            cnt[t] += 1
            if cnt[t] > ins.nsplit:
                raise VMError(f"{self.g.ops[ins.op].name}: tile {t} got {cnt[t]} arrivals for {ins.nsplit} splits")
            if cnt[t] == ins.nsplit:
                cnt[t] = 0
                a, b = t * ROW_TILE, min((t + 1) * ROW_TILE, n_out)
                self._epilogue(dataclasses.replace(ins, row_start=a, row_end=b), P[:, :, a:b],
                               P[:, :, n_out + a:n_out + b] if epi == "swiglu" else None)

    def _op_gemv_reduce(self, ins) -> None:
        _, epi = sub_parts(ins.sub)
        P = self._b(ins.buf3)
        r0, r1 = ins.row_start, ins.row_end
        F = P.shape[2] // 2
        self._epilogue(ins, P[:, :, r0:r1], P[:, :, F + r0:F + r1] if epi == "swiglu" else None)

    def _epilogue(self, ins, p: np.ndarray, up: np.ndarray | None) -> None:
        _, epi = sub_parts(ins.sub)
        r0, r1 = ins.row_start, ins.row_end
        res = self._b(ins.buf2)[:, r0:r1] if epi == "residual" else None
        self._b(ins.buf1)[:, r0:r1] = ops.gemv_reduce(np.ascontiguousarray(p), epi, residual=res,
                                                       up_partials=None if up is None else np.ascontiguousarray(up))

    def _op_gdn_step(self, ins) -> None:
        """Key heads [row_start, row_end), value heads [j0, j1) of part ``split`` of ``nsplit`` (asm_regions
        ``_gdn_part``, the runner's split_gdn): each part runs its value heads and writes their state, z columns and
        output, and the q / k conv channels of the key heads it owns; the conv history of the others comes from
        the state as the step found it (the kernel's ring: the owner writes only the current position's slot)."""
        c, li, (h0, h1) = self.cfg, ins.layer, (ins.row_start, ins.row_end)
        pre = layer_prefix(c, li) + "linear_attn."
        dk, dv, grp, kd, M = c.linear_key_head_dim, c.linear_value_head_dim, c.gdn_head_group, c.gdn_key_dim, self.g.m
        j0, j1, own = _gdn_part(c, ins)
        nh, vh = h1 - h0, np.arange(j0, j1)
        xn = ops.rmsnorm(self._b(ins.buf2), self._get(self.p.weights[ins.w1][0]), c.rms_norm_eps)
        S = ab_split(c)
        ab = [ops.gemv_reduce(np.stack([ops.gemv_partial(self._get(pre + n), None, xn, vh, S, s) for s in range(S)]))
              for n in ("in_proj_a.weight", "in_proj_b.weight")]
        ch = np.concatenate([np.arange(h0 * dk, h1 * dk), np.arange(kd + h0 * dk, kd + h1 * dk),
                             np.arange(2 * kd + j0 * dv, 2 * kd + j1 * dv)])
        conv = self.state.conv[li]
        if li not in self.conv0:  # the first part of the layer in this step takes it
            self.conv0[li] = conv.copy()
        hist = self.conv0[li]
        y, new = ops.gdn_conv_step(self._b(ins.buf0)[:, ch], hist[ch], self._get(pre + "conv1d.weight")[ch])
        mine = np.concatenate([np.isin(np.arange(h0, h1), own)] * 2).repeat(dk)
        wr = np.concatenate([mine, np.ones(ch.size - mine.size, bool)])
        conv[ch[wr]] = new[wr]
        kh = vh // grp - h0  # each value head's key head, within the instruction's
        q = y[:, :nh * dk].reshape(M, nh, dk)[:, kh]
        k = y[:, nh * dk:2 * nh * dk].reshape(M, nh, dk)[:, kh]
        v = np.ascontiguousarray(y[:, 2 * nh * dk:].reshape(M, vh.size, dv))
        g, beta = ops.gdn_gates(ab[0], ab[1], self._get(pre + "A_log")[vh], self._get(pre + "dt_bias")[vh])
        qn, kn = ops.gdn_qk_norm(q, k, "step")
        St, outs = self.state.rec[li][vh], []
        for t in range(M):
            o_t, St = ops.gdn_step_head(qn[t], kn[t], v[t], g[t], beta[t], St)
            outs.append(o_t)
        self.state.rec[li][vh] = St
        cols = slice(j0 * dv, j1 * dv)
        z = self._b(ins.buf1)[:, cols].reshape(M, vh.size, dv)
        o = ops.rmsnorm_gated(np.stack(outs), z, self._get(pre + "norm.weight"), c.rms_norm_eps)
        self._b(ins.buf3)[:, cols] = o.reshape(M, -1)

    # attention: four stages over the scratch buffers (roped q [M, NQ·HD], scores [M, NQ, cap], stats max / sum
    # [M, NQ, P], partials [M, NQ, P, HD]); row t has context pos0 + t + 1 and its own partition ranges
    def _kv(self, li: int):
        mtp = li == self.cfg.num_hidden_layers
        return (self.state.mtp_k, self.state.mtp_v) if mtp else (self.state.k[li], self.state.v[li])

    def _units(self, ins):
        """(row t, KV head h, query heads slice, key range) of every non-empty (row, partition) of the units."""
        G = self.cfg.gqa_group
        for u in range(ins.row_start, ins.row_end):
            h, p = divmod(u, self.parts)
            for t in range(self.g.m):
                r = attn_partition_range(self.pos0 + t + 1, self.parts, p)
                if len(r):
                    yield t, h, p, slice(h * G, (h + 1) * G), slice(r.start, r.stop)

    def _op_attn_prep(self, ins) -> None:
        c, li, (g0, g1), M = self.cfg, ins.layer, (ins.row_start, ins.row_end), self.g.m
        pre = layer_prefix(c, li) + "self_attn."
        hd, grp, n = c.head_dim, c.gqa_group, ins.row_end - ins.row_start
        pos = self.pos0 + np.arange(M)
        q, _, k, v = ops.attn_prep(self._b(ins.buf0)[:, g0 * grp * 2 * hd:g1 * grp * 2 * hd],
                                   self._b(ins.buf1)[:, g0 * hd:g1 * hd], self._b(ins.buf2)[:, g0 * hd:g1 * hd],
                                   self._get(pre + "q_norm.weight"), self._get(pre + "k_norm.weight"), pos,
                                   _group_cfg(c, n))
        K, V = self._kv(li)
        if self.pos0 + M > K.shape[0]:
            raise ValueError(f"VM: KV capacity {K.shape[0]} exceeded at position {self.pos0 + M}")
        K[pos, g0:g1], V[pos, g0:g1] = k, v
        self._b(ins.buf3)[:, g0 * grp * hd:g1 * grp * hd] = q.reshape(M, -1)

    def _op_attn_scores(self, ins) -> None:
        K, _ = self._kv(ins.layer)
        q = self._b(ins.buf0).reshape(self.g.m, -1, self.cfg.head_dim)
        S, Sm, Sl = self._b(ins.buf1), self._b(ins.buf2), self._b(ins.buf3)
        for t, h, p, qh, r in self._units(ins):
            s = ops.attn_part_scores(q[t, qh], K[r, h])
            S[t, qh, r] = s  # bf16 values: exact
            Sm[t, qh, p], Sl[t, qh, p] = ops.attn_part_stats(s)

    def _op_attn_values(self, ins) -> None:
        _, V = self._kv(ins.layer)
        S, Sm, Sl, O = self._b(ins.buf0), self._b(ins.buf1), self._b(ins.buf2), self._b(ins.buf3)
        for t, h, p, qh, r in self._units(ins):
            full = [q for q in range(self.parts) if len(attn_partition_range(self.pos0 + t + 1, self.parts, q))]
            Mx, Ls = ops.attn_merge_stats([Sm[t, qh, q] for q in full], [Sl[t, qh, q] for q in full])
            O[t, qh, p] = ops.attn_part_values(S[t, qh, r].astype(np.float32), Mx, Ls, V[r, h])

    def _op_attn_reduce(self, ins) -> None:
        hd, M, (q0, q1) = self.cfg.head_dim, self.g.m, (ins.row_start, ins.row_end)
        O = self._b(ins.buf1)
        gate = self._b(ins.buf0).reshape(M, -1, 2 * hd)[:, q0:q1, hd:]
        for t in range(M):
            full = [q for q in range(self.parts) if len(attn_partition_range(self.pos0 + t + 1, self.parts, q))]
            o = ops.attn_merge_values([O[t, q0:q1, q] for q in full])
            self._b(ins.buf3)[t, q0 * hd:q1 * hd] = ops.attn_gate(o.reshape(1, -1), np.ascontiguousarray(gate[t]).reshape(1, -1))[0]
