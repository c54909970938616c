"""The prefill GEMM (discrete/gemm.py, kernels/gemm.cuh) on the GPU, against the reference op and the decode GEMV.

Every fp8 projection shape of the tiny preset and of the 27B (fused as the decode graph fuses them, and the parts
alone), a row count that is not a multiple of the 128-row tile, fresh seeded random data per shape, outputs
NaN-poisoned before each launch.
* store epilogue vs the reference (tests/gemm_numerics.py ``reference`` = the GEMV's op) on a row subset, all
  columns: GEMM_TOL (one bf16 ulp, RMS floor; the reason is written in tests/gemm_numerics.py). Negative
  controls: moved scale blocks and one changed weight must fail the same check.
* bit identity with the decode GEMV (``Gemv``, 8-row launches, the same split-K factor and epilogue) on the
  first and last rows, compared as uint16: the GEMM reproduces the GEMV's summation order (docs/kernels-gemm.md),
  so the choice between GEMM and decode passes never changes results. Negative control: the GEMV's output for
  other rows differs. Tiny shapes also at other split factors.
* rows of an M = 16 launch bit-identical to the same rows of the large launch; residual in place (resid = out)
  bit-identical to a separate residual; every e4m3 code widened exactly.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from assembler.numerics import split_k
from assembler.ref.numerics import BF16, FP8, f32
from loader.config import preset
from tests import gemm_numerics as gn

cp = pytest.importorskip("cupy")

ROWS = {"tiny": 300, "qwen3.5-27b": 200}  # both leave a partial last 128-row tile
CASES = [(p, s) for p in ROWS for s in gn.shapes(preset(p))]
NAN = 0x7FC0


def dev(a):
    return cp.asarray(np.ascontiguousarray(a).view(np.uint8 if a.dtype == FP8 else np.uint16))


def launch(g, x_d, res_d=None):
    out = cp.full((x_d.shape[0], g.n_out), NAN, cp.uint16)
    g(x_d, out, res_d)
    return cp.asnumpy(out)


def gemv_rows(cfg, w_d, s_d, x, rows, epi, S, r=None):
    """The decode GEMV's output for ``rows`` of x, 8 rows per launch (partial + fixed-order reduce)."""
    from discrete.gemv import Gemv
    g = Gemv(cfg, w_d, s_d, epilogue=epi, split=S, name="gemv")
    partials = cp.empty(g.partials_size(8), cp.float32)
    outs = []
    for i in range(0, len(rows), 8):
        sel = rows[i:i + 8]
        out = cp.full((len(sel), g.n_out), NAN, cp.uint16)
        g(dev(x[sel]), out, partials, residual=dev(r[sel]) if r is not None else None, fused=False)
        outs.append(cp.asnumpy(out))
    return np.concatenate(outs)


@pytest.mark.parametrize("pname,shape", CASES, ids=[f"{p}-{s[0]}" for p, s in CASES])
def test_gemm_shape(gpu, pname, shape):
    from discrete.gemm import Gemm
    cfg = preset(pname)
    name, N, K, epi = shape
    M = ROWS[pname]
    rng = np.random.default_rng(zlib.crc32(f"{pname}/{name}".encode()))
    w, s, x = gn.rand_fp8(rng, N, K), gn.rand_scale(rng, N, K), gn.rand_bf16(rng, (M, K))
    r = gn.rand_bf16(rng, (M, N)) if epi == "residual" else None
    w_d, s_d, x_d = dev(w), dev(s), dev(x)
    S = split_k(N, K)
    sub = np.r_[0:8, M - 8:M]  # rows checked against the reference and the GEMV (the last in the partial tile)

    # 1. store epilogue vs the reference: GEMM_TOL; negative controls fail it
    out = launch(Gemm(cfg, w_d, s_d, epilogue="store", name=name), x_d)
    assert not (out == NAN).any(), "outputs left unwritten"
    want = gn.reference(w, s, x[sub], "store")
    gn.assert_close(out[sub], want, f"{pname}/{name} store")
    cols = np.arange(0, N, max(1, N // 256))
    if K // 128 > 1:
        moved = gn.reference(w, np.ascontiguousarray(np.roll(s, 1, axis=1)), x[sub], "store", cols=cols)
        assert gn.close_mask(out[sub][:, cols], moved).mean() < 0.5, "moved scale blocks passed GEMM_TOL"
    wb = w.view(np.uint8).copy()
    n = N // 3
    wb[n, 5] = 0xFE if wb[n, 5] < 0x80 else 0x7E  # one weight to ∓448
    bad = gn.reference(wb.view(FP8), s, x[sub], "store", cols=[n])
    assert not gn.close_mask(out[sub][:, [n]], bad).all(), "one changed weight passed GEMM_TOL"

    # 2. the shape's epilogue, bit-identical to the decode GEMV on the same rows
    g = Gemm(cfg, w_d, s_d, epilogue=epi, name=name)
    r_d = dev(r) if r is not None else None
    out_e = launch(g, x_d, r_d)
    ref_rows = gemv_rows(cfg, w_d, s_d, x, sub, epi, S, r)
    assert np.array_equal(out_e[sub], ref_rows), \
        f"{pname}/{name} {epi}: GEMM differs from the GEMV in {int((out_e[sub] != ref_rows).sum())} outputs"
    assert not np.array_equal(out_e[sub[:8]], ref_rows[8:]), "negative control: other rows' GEMV output agrees"
    if pname == "tiny":  # other split factors: still the GEMV's bits at that split
        nkb = K // 128
        for S2 in sorted({1, 2 if nkb % 2 == 0 else 1, nkb} - {S}):
            o2 = launch(Gemm(cfg, w_d, s_d, epilogue=epi, split=S2, name=name), x_d, r_d)
            assert np.array_equal(o2[sub], gemv_rows(cfg, w_d, s_d, x, sub, epi, S2, r)), f"split {S2}"

    # 3. an M = 16 launch gives the same rows; residual in place equals the separate residual
    o16 = launch(g, cp.ascontiguousarray(x_d[:16]), cp.ascontiguousarray(r_d[:16]) if r_d is not None else None)
    assert np.array_equal(o16, out_e[:16]), "M = 16 rows differ from the large launch"
    if epi == "residual":
        inplace = r_d.copy()
        g(x_d, inplace, inplace)
        assert np.array_equal(cp.asnumpy(inplace), out_e), "residual in place differs"


def test_e4m3_widening_exact(gpu):
    """All 254 finite e4m3 codes: a one-hot activation row picks each weight exactly (scale 1)."""
    from discrete.gemm import Gemm
    cfg = preset("tiny")
    codes = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], np.uint8)
    N, K, M = 256, 128, 16
    w = np.zeros((N, K), np.uint8)
    w[:len(codes), 0] = codes
    s = np.ones((2, 1), np.float32).astype(BF16)
    x = np.zeros((M, K), np.float32)
    x[:, 0] = 1.0
    out = launch(Gemm(cfg, cp.asarray(w), dev(s), name="e4m3_table"), dev(x.astype(BF16)))
    want = f32(codes.view(FP8)).astype(BF16).view(np.uint16).copy()
    want[codes == 0x80] = 0  # acc = 0 + (-0) = +0, as the GEMV
    assert (out[:, :len(codes)] == want[None, :]).all()


def test_contract_errors(gpu):
    from discrete.gemm import Gemm
    cfg = preset("tiny")
    w = cp.zeros((256, 256), cp.uint8)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        Gemm(cfg, w, cp.zeros((1, 1), cp.uint16))
    g = Gemm(cfg, w, cp.zeros((2, 2), cp.uint16))
    with pytest.raises(ValueError, match="x must be"):
        g(cp.zeros((16, 128), cp.uint16), cp.zeros((16, 256), cp.uint16))
    with pytest.raises(ValueError, match="dtype"):
        g(cp.zeros((16, 256), cp.float32), cp.zeros((16, 256), cp.uint16))
