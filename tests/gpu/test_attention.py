"""GPU tests of decode attention over the paged KV cache (``discrete/attention.py``, ``kernels/attention.cuh``)
against ``assembler.ref.ops`` (attn_prep, attn_decode_group, attn_gate).

Tolerances (with the reason): bf16 outputs (q after norm+RoPE, appended K, attention output) at most 1 ulp on at
most 0.1 % of elements: the kernels round where the reference rounds and sum in float64 like it, so bits are
expected to match; float64 exp/cos/sin may differ by one float64 ulp between CUDA and libm and flip an fp32
rounding in ~2^-29 of cases. V is appended exactly (a copy). The attention stage is checked on the device's own
q and KV (the intermediate), so a prep difference cannot hide an attention one.
Negative controls: a reference with the wrong KV head for a query head (qh % n_kv instead of qh // group), and
one with a wrong RoPE base, must fail the same checks. The pool is NaN past the valid length and the page table
is a random permutation; M-row calls are compared bit for bit with M single-row calls.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from assembler.numerics import attn_partitions
from assembler.ref import ops
from loader.config import preset
from tests.tolerance import ulp_check

BF = ml_dtypes.bfloat16
NAN_BF16 = 0x7FC1
LAYER = 1  # test the layer offset: two attention layers in the pool, use the second


def close(got, ref):
    """≤ 1 bf16 ulp on ≤ 0.1 % of elements: float64 exp/cos/sin of CUDA vs libm (module docstring)."""
    return ulp_check(got, ref, 1, 1e-3)


def _bf(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(BF)


class Setup:
    """A pool (NaN everywhere), sessions with a random page order and a valid prefix of ``pos`` random keys."""

    def __init__(self, cfg, pos, M, rng, n_sessions=1):
        import cupy as cp
        from discrete import attention
        from discrete.kv_cache import PAGE, PagedKVCache
        self.cfg, self.cp, self.pos, self.M = cfg, cp, pos, M
        nkv, hd = cfg.num_key_value_heads, cfg.head_dim
        pages = -(-(pos + M) // PAGE)
        self.cache = PagedKVCache(cfg, n_sessions * pages + 1, n_layers=2)
        self.cache.pool.fill(NAN_BF16)
        self.cache.free = [int(p) for p in rng.permutation(len(self.cache.free))]
        Kp, Vp = _bf(rng, (pos, nkv, hd), 1.0), _bf(rng, (pos, nkv, hd), 1.0)
        self.sessions = []
        for _ in range(n_sessions):
            s = self.cache.session(pos + M)
            s.reserve(pos + M)
            if pos:
                self.cache.scatter(s, LAYER, Kp.view(np.uint16), Vp.view(np.uint16))
            self.sessions.append(s)
        self.qnw, self.knw = _bf(rng, (hd,), 0.2), _bf(rng, (hd,), 0.2)
        u = lambda a: cp.asarray(a.view(np.uint16))  # noqa: E731
        self.op = attention.AttnDecode(cfg, u(self.qnw), u(self.knw), capacity=pos + M)

    def run(self, sess, qg, k, v, pos, poison=True):
        cp = self.cp
        M = qg.shape[0]
        if poison:
            self.op.poison()
        out = cp.full((M, self.cfg.num_attention_heads * self.cfg.head_dim), NAN_BF16, np.uint16)
        u = lambda a: cp.asarray(a.view(np.uint16))  # noqa: E731
        self.op(u(qg), u(k), u(v), self.cache, sess, LAYER, out, cp.asarray(np.array([pos], np.int32)), M, pos_host=pos)
        return out.get().view(BF), self.op.q[:M].get().view(BF)


def inputs(cfg, rng, M):
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return _bf(rng, (M, 2 * nq * hd), 2.0), _bf(rng, (M, nkv * hd), 2.0), _bf(rng, (M, nkv * hd), 1.0)


def ref_attention(cfg, q, gate, K, V, pos, wrong_map=False):
    """Per row i (context pos+i+1): attn_decode_group per KV head on the given q [M, nq, hd] and K/V
    [L, nkv, hd], then the gate. Returns [M, nq·hd] bf16."""
    nq, nkv, G = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.gqa_group
    P = attn_partitions(cfg)
    rows = []
    for i in range(q.shape[0]):
        L = pos + i + 1
        o = np.empty((nq, cfg.head_dim), BF)
        for qh in range(nq):
            h = qh % nkv if wrong_map else qh // G
            o[qh] = ops.attn_decode_group(q[i, qh:qh + 1], K[:L, h], V[:L, h], P)[0]
        rows.append(ops.attn_gate(o.reshape(1, -1), gate[i:i + 1])[0])
    return np.stack(rows)


@pytest.mark.parametrize("name", ["tiny", "qwen3.5-27b"])
@pytest.mark.parametrize("ctx", [1, 255, 256, 257, 1000, 4096])
def test_attention_vs_ref(gpu, name, ctx):
    cfg, rng = preset(name), np.random.default_rng(ctx)
    pos, M = ctx - 1, 1
    st = Setup(cfg, pos, M, rng)
    qg, k, v = inputs(cfg, rng, M)
    out, qdev = st.run(st.sessions[0], qg, k, v, pos)
    q, gate, kr, vr = ops.attn_prep(qg, k, v, st.qnw, st.knw, pos + np.arange(M), cfg)
    ok, msg = close(qdev, q)
    assert ok, f"{name} ctx={ctx}: q after norm+RoPE {msg}"
    K, V = (a.view(BF) for a in st.cache.gather(st.sessions[0], LAYER, pos + M))
    ok, msg = close(K[pos:], kr)
    assert ok, f"{name} ctx={ctx}: appended K {msg}"
    assert np.array_equal(V[pos:].view(np.uint16), vr.view(np.uint16)), f"{name} ctx={ctx}: appended V"
    bad_q = ops.attn_prep(qg, k, v, st.qnw, st.knw, pos + np.arange(M), cfg, theta=cfg.rope_theta / 10)[0]
    if pos > 0:  # at position 0 every rotation is the identity: no RoPE base can be told apart
        assert not close(qdev, bad_q)[0], "negative control (RoPE base / 10) passed"
    ref = ref_attention(cfg, qdev, gate, K, V, pos)
    ok, msg = close(out, ref)
    assert ok, f"{name} ctx={ctx}: attention output {msg}"
    bad = ref_attention(cfg, qdev, gate, K, V, pos, wrong_map=True)
    assert not close(out, bad)[0], "negative control (KV head qh % n_kv) passed"


@pytest.mark.parametrize("name", ["tiny", "qwen3.5-27b"])
@pytest.mark.parametrize("pos", [250, 1020])
def test_attention_multirow_bit_identical(gpu, name, pos):
    """M = 2..8 rows at positions pos..pos+M-1 (crossing a page boundary, and the partition size change) equal
    M single-row calls bit for bit: outputs, queries and the KV cache; and the reference within tolerance."""
    cfg = preset(name)
    for M in range(2, 9):
        rng = np.random.default_rng(1000 * M + pos)
        st = Setup(cfg, pos, M, rng, n_sessions=2)
        qg, k, v = inputs(cfg, rng, M)
        one = [st.run(st.sessions[0], qg[i:i + 1], k[i:i + 1], v[i:i + 1], pos + i) for i in range(M)]
        out1 = np.concatenate([o for o, _ in one])
        q1 = np.concatenate([q for _, q in one])
        outM, qM = st.run(st.sessions[1], qg, k, v, pos)
        assert np.array_equal(out1.view(np.uint16), outM.view(np.uint16)), f"{name} pos={pos} M={M}: outputs"
        assert np.array_equal(q1.view(np.uint16), qM.view(np.uint16)), f"{name} pos={pos} M={M}: queries"
        K1, V1 = st.cache.gather(st.sessions[0], LAYER, pos + M)
        KM, VM = st.cache.gather(st.sessions[1], LAYER, pos + M)
        assert np.array_equal(K1, KM) and np.array_equal(V1, VM), f"{name} pos={pos} M={M}: KV cache"
        gate = qg.reshape(M, cfg.num_attention_heads, 2, cfg.head_dim)[:, :, 1].reshape(M, -1)
        ref = ref_attention(cfg, qM, np.ascontiguousarray(gate), KM.view(BF), VM.view(BF), pos)
        ok, msg = close(outM, ref)
        assert ok, f"{name} pos={pos} M={M}: vs reference {msg}"


def test_attention_contract_errors(gpu):
    import cupy as cp
    cfg, rng = preset("tiny"), np.random.default_rng(3)
    st = Setup(cfg, 10, 1, rng)
    qg, k, v = (cp.asarray(a.view(np.uint16)) for a in inputs(cfg, rng, 1))
    out = cp.zeros((1, cfg.num_attention_heads * cfg.head_dim), np.uint16)
    pos = cp.asarray(np.array([10], np.int32))
    with pytest.raises(ValueError, match="M=0"):
        st.op(qg, k, v, st.cache, st.sessions[0], LAYER, out, pos, 0)
    with pytest.raises(ValueError, match="exceeds capacity"):
        st.op(qg, k, v, st.cache, st.sessions[0], LAYER, out, pos, 1, pos_host=11)
    with pytest.raises(ValueError, match="attn.k"):
        st.op(qg, k.astype(np.int16), v, st.cache, st.sessions[0], LAYER, out, pos, 1)
