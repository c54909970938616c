"""GEMV family on the GPU against the NumPy reference ops (assembler/ref/ops.py, INTERFACES §2).

Every projection shape of the tiny preset and of the 27B, M = 8 activation rows, fresh seeded random data per
check, outputs and partials NaN-poisoned before each launch. Tolerances:
* whole projection vs reference (store epilogue): one bf16 ulp per element, with an absolute floor of 2^-16 ·
  RMS(output row) for outputs near zero (the tensor core's fp32 summation order inside a 128-block differs from
  the reference's float64 sum by a few fp32 ulps of the terms; cancellation can make that more than one ulp of a
  tiny result). Negative controls: a scale with K-blocks shifted by one, and one output bumped by 2 ulps, must fail.
* reduce + epilogues on the GPU's own partials vs gemv_reduce: bit-exact for store and residual; swiglu within
  one ulp (fp32 expf vs float64 exp), except outputs below 2^-100 whose silu factor flushed to ±0 (CuPy
  compiles with -ftz=true; the reference keeps denormals).
* rows 0..M-1 of an M-row launch bit-identical (uint16) to single-row launches, M = 1..8.
"""
from __future__ import annotations

import numpy as np
import pytest

from assembler.numerics import split_k
from assembler.ref import ops as ref
from assembler.ref.numerics import BF16, FP8, f32
from loader.config import preset
from tests.gpu.helpers import MAXM, rand_bf16, seed_of
from tests.tolerance import assert_close_mask, close_mask  # close_mask: bench/bench_gemv.py's check too

cp = pytest.importorskip("cupy")

PRESETS = ("tiny", "qwen3.5-27b")
GEMV_TOL = "1 bf16 ulp, floor 2^-16 RMS(row): tensor-core fp32 order in a 128-block vs float64 (docstring)"


def shapes(cfg):
    """(name, N, K, fp8, epilogue) of every GEMV-family projection of cfg (rows a multiple of 16)."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    out = [("gate_up", 2 * f, h, True, "swiglu"), ("down", h, f, True, "residual"),
           ("gdn_qkv", cfg.gdn_conv_dim, h, True, "store"), ("gdn_z", cfg.gdn_value_dim, h, True, "store"),
           ("gdn_out", h, cfg.gdn_value_dim, True, "residual"), ("attn_q", cfg.q_proj_rows, h, True, "store"),
           ("attn_kv", cfg.kv_rows, h, True, "store"),
           ("attn_qkv", cfg.q_proj_rows + 2 * cfg.kv_rows, h, True, "store"),
           ("attn_o", h, cfg.attn_out_dim, True, "residual"), ("mtp_fc", h, 2 * h, False, "store")]
    if cfg.linear_num_value_heads % 16 == 0:  # tiny has 6 rows: padded to 16 at load by the layout owner
        out.append(("in_proj_ab", cfg.linear_num_value_heads, h, False, "store"))
    return out


CASES = [(p, s) for p in PRESETS for s in shapes(preset(p))]


def rand_fp8(rng, n, k):
    b = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] &= 0xFE  # no NaN codes: checkpoints never hold them
    return b.view(FP8)


def make_case(cfg, name, N, K, fp8, seed):
    rng = np.random.default_rng(seed)
    if fp8:
        w = rand_fp8(rng, N, K)
        s = (rng.uniform(0.5, 2.0, size=(-(-N // 128), K // 128)) * 2.0 ** -9).astype(np.float32).astype(BF16)
    else:
        w, s = rand_bf16(rng, (N, K), 0.05), None
    x = rand_bf16(rng, (MAXM, K))
    return w, s, x, rng


def dev(a):
    return cp.asarray(np.ascontiguousarray(a).view(np.uint8 if a.dtype == FP8 else np.uint16))


def run(g, x_d, partials, M, residual_d=None):
    out = cp.full((M, g.n_out), 0x7FC0, cp.uint16)       # NaN-poisoned
    partials.fill(np.float32(np.nan))
    P = g.partial(x_d[:M], partials)
    g.reduce(P, out, residual_d[:M] if residual_d is not None else None)
    return cp.asnumpy(out), cp.asnumpy(P)


@pytest.mark.parametrize("pname,shape", CASES, ids=[f"{p}-{s[0]}" for p, s in CASES])
def test_gemv_shape(gpu, pname, shape):
    from discrete.gemv import Gemv
    cfg = preset(pname)
    name, N, K, fp8, epi = shape
    w, s, x, rng = make_case(cfg, name, N, K, fp8, seed_of(pname, name))
    w_d, s_d, x_d = dev(w), (dev(s) if fp8 else None), dev(x)
    S = split_k(N, K)

    # 1. whole projection, store epilogue, vs the reference: one bf16 ulp
    g = Gemv(cfg, w_d, s_d, epilogue="store", name=name)
    partials = cp.empty(g.partials_size(MAXM), cp.float32)
    out, P = run(g, x_d, partials, MAXM)
    want = ref.gemv(w, s, x, "store")
    assert_close_mask(f"{pname}/{name} store", out, want, GEMV_TOL)
    # negative controls: a planted error must fail the same check
    bumped = out.copy()
    bumped[MAXM // 2, N // 3] += 2
    assert not close_mask(bumped, want).all(), "2-ulp planted error passed the tolerance"
    if fp8 and K // 128 > 1 and N * K <= 64 << 20:  # (a second float64 reference: small shapes only)
        bad = ref.gemv(w, np.ascontiguousarray(np.roll(s, 1, axis=1)), x, "store")
        assert close_mask(out, bad).mean() < 0.5, "wrong scale index passed the tolerance"

    # 2. reduce + the shape's epilogue on the GPU's partials: exact (swiglu: one ulp)
    assert P.shape == (S, MAXM, N) and not np.isnan(P).any(), "partials not fully written"
    ge = Gemv(cfg, w_d, s_d, epilogue=epi, name=name)
    r = rand_bf16(rng, (MAXM, N)) if epi == "residual" else None
    r_d = dev(r) if r is not None else None
    out_e, P_e = run(ge, x_d, partials, MAXM, r_d)
    assert np.array_equal(P_e.view(np.uint32), P.view(np.uint32)), "partials differ between two launches"
    if epi == "swiglu":
        F = N // 2
        want_e = ref.gemv_reduce(P_e[:, :, :F], "swiglu", up_partials=P_e[:, :, F:])
        d = np.abs(out_e.astype(np.int32) - want_e.view(np.uint16).astype(np.int32))
        # FTZ (CuPy compiles with -ftz=true): where silu(g) < 2^-126 (g < ~-92.5) the GPU gives ±0, the
        # float64 reference a denormal; such outputs are tiny (< 2^-100) and allowed to be ±0.
        ftz = (np.abs(f32(want_e)) < 2.0 ** -100) & ((out_e & 0x7FFF) == 0)
        assert d[~ftz].max(initial=0) <= 1, f"swiglu epilogue differs by {d[~ftz].max()} ulp"
    else:
        want_e = ref.gemv_reduce(P_e, epi, residual=r)
        assert np.array_equal(out_e, want_e.view(np.uint16)), f"{epi} epilogue not bit-exact"

    # 3. M-row launches bit-identical per row to 1-row launches
    for M in range(1, MAXM):
        o_m, _ = run(ge, x_d, partials, M, r_d)
        assert np.array_equal(o_m, out_e[:M]), f"M={M} rows differ from the M={MAXM} launch"
    for m in range(1, MAXM):
        xm = cp.ascontiguousarray(x_d[m:m + 1])
        rm = cp.ascontiguousarray(r_d[m:m + 1]) if r_d is not None else None
        o1, _ = run(ge, xm, partials, 1, rm)
        assert np.array_equal(o1[0], out_e[m]), f"row {m} alone differs from row {m} of M={MAXM}"


def test_e4m3_widening_exact(gpu):
    """All 254 finite e4m3 codes through the GEMV path: a one-hot row picks each weight exactly."""
    from discrete.gemv import Gemv
    cfg = preset("tiny")
    codes = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], np.uint8)
    N, K = 256, 128
    w = np.zeros((N, K), np.uint8)
    w[:len(codes), 0] = codes
    s = np.ones((2, 1), np.float32).astype(BF16)
    x = np.zeros((1, K), np.float32)
    x[0, 0] = 1.0
    g = Gemv(cfg, cp.asarray(w), dev(s), name="e4m3_table")
    partials = cp.empty(g.partials_size(1), cp.float32)
    out, _ = run(g, dev(x.astype(BF16)), partials, 1)
    want = codes.view(FP8).astype(np.float32).astype(BF16).view(np.uint16)
    want[codes == 0x80] = 0  # acc = 0 + (-0) = +0: the GEMV never returns -0 (nor does the reference)
    assert np.array_equal(out[0, :len(codes)], want)


def test_contract_errors(gpu):
    from discrete.gemv import Gemv
    cfg = preset("tiny")
    w = cp.zeros((128, 256), cp.uint8)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        Gemv(cfg, w, cp.zeros((1, 1), cp.uint16))
    with pytest.raises(ValueError, match="multiple of 16"):
        Gemv(cfg, cp.zeros((40, 256), cp.uint16))
    g = Gemv(cfg, w, cp.zeros((1, 2), cp.uint16))
    with pytest.raises(ValueError, match="x must be"):
        g.partial(cp.zeros((9, 256), cp.uint16), cp.empty(g.partials_size(9), cp.float32))
    with pytest.raises(ValueError, match="dtype"):
        g.partial(cp.zeros((1, 256), cp.float32), cp.empty(g.partials_size(1), cp.float32))


FP8_CASES = [(p, s) for p, s in CASES if s[3]]


@pytest.mark.parametrize("pname,shape", FP8_CASES, ids=[f"{p}-{s[0]}" for p, s in FP8_CASES])
def test_m1_kernels_bit_identical(gpu, pname, shape):
    """The M = 1 kernels (M fixed at compile time: *_m1 with the cp.async ring, *_m1r with the register tile,
    *_m1t1 / *_m1t2 fed by TMA; the default picks by discrete.gemv.TMA_MIN_UNITS) give the general kernel's bits on
    every fp8 shape, each forced (QMK_GEMV_M1 = 1, 2, 3) against the general kernel (0): partials, the fused
    launch and partial + reduce, for a row taken from inside an 8-row batch. Negative control: a different row's
    output must differ."""
    from discrete.gemv import Gemv
    cfg = preset(pname)
    name, N, K, fp8, epi = shape
    w, s, x, rng = make_case(cfg, name, N, K, fp8, seed_of(pname, name, "m1"))
    w_d, s_d = dev(w), dev(s)
    r = rand_bf16(rng, (1, N)) if epi == "residual" else None
    outs = {}
    for knob in (1, 2, 3, 0):
        g = Gemv(cfg, w_d, s_d, epilogue=epi, name=name, defines={"QMK_GEMV_M1": knob})
        assert g.m1_kind == {1: "ring", 2: "reg", 3: "tma", 0: None}[knob]
        partials = cp.empty(g.partials_size(1), cp.float32)
        got = {}
        for row in (3, 5):
            x1 = dev(x[row:row + 1])
            partials.fill(np.float32(np.nan))
            got[f"P{row}"] = cp.asnumpy(g.partial(x1, partials)).view(np.uint32)
            for fused in (True, False):
                out = cp.full((1, g.n_out), 0x7FC0, cp.uint16)
                g(x1, out, partials, residual=dev(r) if r is not None else None, fused=fused)
                got[f"out{row}_{fused}"] = cp.asnumpy(out)
        outs[knob] = got
    for knob in (1, 2, 3):
        for k, v in outs[0].items():
            assert np.array_equal(outs[knob][k], v), \
                f"{pname}/{name}: {k} differs between the M=1 kernel ({knob}) and the general kernel"
    assert not np.array_equal(outs[1]["out3_True"], outs[1]["out5_True"]), "negative control: rows 3 and 5 agree"
