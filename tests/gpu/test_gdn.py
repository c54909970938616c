"""GPU tests of the fused GDN decode step (``discrete/gdn.py``, ``kernels/gdn.cuh``) against ``assembler.ref.ops``.

Tolerances (with the reason):
* output bf16: at most 1 ulp on at most 0.1 % of elements. The kernel rounds where the reference rounds and
  sums in float64 like it, so bits are expected to match; a float64 exp/log1p differing by one float64 ulp
  between CUDA and libm can flip one fp32 rounding in ~2^-29 of cases, and then one bf16 ulp downstream.
* recurrent state fp32: max |ΔS| ≤ 1e-6 · max |S| (same reason, propagated over the steps of a test).
* conv ring: exact (a copy of the inputs).
Negative control: the reference with value head j reading key head j % n_k (instead of j // group) must fail.
M-row launches are compared bit for bit with M single-row launches (outputs, state, ring).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from assembler.ref import ops
from loader.config import preset
from tests.tolerance import ulp_check

BF = ml_dtypes.bfloat16
NAN_BF16 = 0x7FC1


def out_ok(got, ref):
    """≤ 1 bf16 ulp on ≤ 0.1 % of elements: float64 exp/log1p of CUDA vs libm (module docstring)."""
    return ulp_check(got, ref, 1, 1e-3)


def state_ok(got, ref):
    err = float(np.max(np.abs(got.astype(np.float64) - ref)) / np.max(np.abs(ref)))
    return (not np.isnan(got).any()) and err <= 1e-6, f"max |dS|/max|S| = {err:.2e}"


def _bf(rng, shape, scale=1.0, mean=0.0):
    return (mean + rng.standard_normal(shape) * scale).astype(np.float32).astype(BF)


def make_layer(cfg, rng):
    """Random bf16 weights of one GDN layer (host, ml_dtypes)."""
    nv, h = cfg.linear_num_value_heads, cfg.hidden_size
    return {"w_a": _bf(rng, (nv, h), 0.02), "w_b": _bf(rng, (nv, h), 0.02),
            "A_log": np.log(rng.uniform(1, 16, nv)).astype(np.float32).astype(BF), "dt_bias": _bf(rng, (nv,), 1.0),
            "conv_w": _bf(rng, (cfg.gdn_conv_dim, 4), 0.5), "norm_w": _bf(rng, (cfg.linear_value_head_dim,), 0.1, 1.0)}


def make_inputs(cfg, rng, M):
    return (_bf(rng, (M, cfg.gdn_conv_dim), 1.5), _bf(rng, (M, cfg.gdn_value_dim)), _bf(rng, (M, cfg.hidden_size)))


def ref_step(cfg, W, qkv, z, hn, S, conv, wrong_map=False):
    """Reference for M rows: conv, in_proj_a/b (GEMV), gates, M recurrent steps, gated norm. Returns
    (out [M, value_dim] bf16, S' [n_v, d_k, d_v], conv' [conv_dim, 3])."""
    nk, nv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kd = cfg.gdn_key_dim
    y, conv = ops.gdn_conv_step(qkv, conv, W["conv_w"])
    a, b = ops.gemv(W["w_a"], None, hn), ops.gemv(W["w_b"], None, hn)
    g, beta = ops.gdn_gates(a, b, W["A_log"], W["dt_bias"])
    j = np.arange(nv)
    kmap = j % nk if wrong_map else j // cfg.gdn_head_group
    outs = []
    for i in range(qkv.shape[0]):
        q, k, v = y[i, :kd].reshape(nk, dk), y[i, kd:2 * kd].reshape(nk, dk), y[i, 2 * kd:].reshape(nv, dv)
        qn, kn = ops.gdn_qk_norm(q, k, "step")
        o, S = ops.gdn_step_head(qn[kmap], kn[kmap], v, g[i], beta[i], S)
        outs.append(ops.rmsnorm_gated(o, z[i].reshape(nv, dv), W["norm_w"], cfg.rms_norm_eps).reshape(-1))
    return np.stack(outs), S, conv


class Dev:
    """Device copy of one layer's weights and state, launched through discrete.gdn.GdnDecode."""

    def __init__(self, cfg, W, S_ref, conv_ref, pos):
        import cupy as cp
        from discrete import gdn
        self.cfg, self.cp, self.gdn = cfg, cp, gdn
        u = lambda a: cp.asarray(np.ascontiguousarray(a).view(np.uint16))  # noqa: E731
        self.op = gdn.GdnDecode(cfg, u(W["w_a"]), u(W["w_b"]), u(W["A_log"]), u(W["dt_bias"]), u(W["conv_w"]),
                                u(W["norm_w"]))
        self.state = cp.asarray(gdn.state_from_ref(S_ref))
        ring = np.full((gdn.CONV_RING, cfg.gdn_conv_dim), NAN_BF16, np.uint16)  # slots never read: NaN
        for t in range(3):
            if pos - 3 + t >= 0:
                ring[(pos - 3 + t) % gdn.CONV_RING] = conv_ref.view(np.uint16)[:, t]
        self.ring = cp.asarray(ring)
        self.pos = pos

    def step(self, qkv, z, hn):
        cp, M = self.cp, qkv.shape[0]
        out = cp.full((M, self.cfg.gdn_value_dim), NAN_BF16, np.uint16)
        u = lambda a: cp.asarray(np.ascontiguousarray(a).view(np.uint16))  # noqa: E731
        self.op(u(qkv), u(z), u(hn), self.ring, self.state, out, cp.asarray(np.array([self.pos], np.int32)), M)
        self.pos += M
        return out.get().view(BF)

    def conv_ref(self):
        return self.gdn.ring_to_ref(self.ring.get(), self.pos).view(BF)

    def state_ref(self):
        return self.gdn.state_to_ref(self.state).get()


def _init(cfg, rng, pos):
    nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    S = (rng.standard_normal((nv, dk, dv)) * 0.1).astype(np.float32)
    conv = _bf(rng, (cfg.gdn_conv_dim, 3), 1.5)
    conv.view(np.uint16)[:, : max(0, 3 - pos)] = 0  # positions before 0 hold zeros
    return S, conv


@pytest.mark.parametrize("name", ["tiny", "qwen3.5-27b"])
@pytest.mark.parametrize("pos", [0, 1, 2, 5, 1000])
def test_gdn_steps_vs_ref(gpu, name, pos):
    """Three consecutive single-row steps (state and ring carried on the device) against the reference."""
    cfg, rng = preset(name), np.random.default_rng(100 + pos)
    W = make_layer(cfg, rng)
    S, conv = _init(cfg, rng, pos)
    dev = Dev(cfg, W, S, conv, pos)
    for step in range(3):
        qkv, z, hn = make_inputs(cfg, rng, 1)
        got = dev.step(qkv, z, hn)
        ref, S_new, conv_new = ref_step(cfg, W, qkv, z, hn, S, conv)
        ok, msg = out_ok(got, ref)
        assert ok, f"{name} pos={pos} step {step}: output {msg}"
        ok, msg = state_ok(dev.state_ref(), S_new)
        assert ok, f"{name} pos={pos} step {step}: state {msg}"
        assert np.array_equal(dev.conv_ref().view(np.uint16), conv_new.view(np.uint16)), f"step {step}: conv ring"
        bad, S_bad, _ = ref_step(cfg, W, qkv, z, hn, S, conv, wrong_map=True)
        assert not out_ok(got, bad)[0], "negative control (head map j % n_k) passed: the check cannot fail"
        assert not state_ok(dev.state_ref(), S_bad)[0], "negative control on the state passed"
        S, conv = S_new, conv_new


@pytest.mark.parametrize("name", ["tiny", "qwen3.5-27b"])
def test_gdn_multirow_bit_identical(gpu, name):
    """An M-row launch equals M single-row launches bit for bit (outputs, state, ring), M = 2..8, and the
    reference within tolerance; rows start at a position that wraps the conv ring."""
    cfg = preset(name)
    for M in range(2, 9):
        rng = np.random.default_rng(200 + M)
        pos = 13 + M  # the ring slots of pos-3 .. pos+M-1 wrap around CONV_RING
        W = make_layer(cfg, rng)
        S, conv = _init(cfg, rng, pos)
        qkv, z, hn = make_inputs(cfg, rng, M)
        one, many = Dev(cfg, W, S, conv, pos), Dev(cfg, W, S, conv, pos)
        got1 = np.concatenate([one.step(qkv[i:i + 1], z[i:i + 1], hn[i:i + 1]) for i in range(M)])
        gotM = many.step(qkv, z, hn)
        assert np.array_equal(got1.view(np.uint16), gotM.view(np.uint16)), f"{name} M={M}: outputs differ"
        assert np.array_equal(one.state.get().view(np.uint32), many.state.get().view(np.uint32)), f"M={M}: state"
        assert np.array_equal(one.ring.get(), many.ring.get()), f"{name} M={M}: conv ring differs"
        ref, S_ref, conv_ref = ref_step(cfg, W, qkv, z, hn, S, conv)
        ok, msg = out_ok(gotM, ref)
        assert ok, f"{name} M={M}: output vs reference {msg}"
        ok, msg = state_ok(many.state_ref(), S_ref)
        assert ok, f"{name} M={M}: state vs reference {msg}"
        assert np.array_equal(many.conv_ref().view(np.uint16), conv_ref.view(np.uint16)), f"M={M}: conv ring"


def test_gdn_contract_errors(gpu):
    """Wrong M, dtype or shape raise ValueError naming the argument before any launch."""
    import cupy as cp
    cfg = preset("tiny")
    rng = np.random.default_rng(7)
    S, conv = _init(cfg, rng, 4)
    dev = Dev(cfg, make_layer(cfg, rng), S, conv, 4)
    qkv, z, hn = (cp.asarray(a.view(np.uint16)) for a in make_inputs(cfg, rng, 1))
    out = cp.zeros((1, cfg.gdn_value_dim), np.uint16)
    pos = cp.zeros(1, np.int32)
    with pytest.raises(ValueError, match="M=9"):
        dev.op(qkv, z, hn, dev.ring, dev.state, out, pos, 9)
    with pytest.raises(ValueError, match="gdn.state"):
        dev.op(qkv, z, hn, dev.ring, dev.state.astype(np.float64), out, pos, 1)
    with pytest.raises(ValueError, match="gdn.qkv"):
        dev.op(qkv[:, :-8], z, hn, dev.ring, dev.state, out, pos, 1)
