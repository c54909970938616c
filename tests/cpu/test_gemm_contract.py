"""The prefill GEMM without a GPU: the host wrapper's contract (discrete/gemm.py) and the kernel's tile and
accumulation order emulated in NumPy (tests/gemm_numerics.py) against the reference op.

* ``plan`` / ``check_operands`` reject bad shapes, dtypes, layouts and splits with errors naming the operand.
* The emulation with the reference's per-block rounding equals the reference bit for bit (tile rows, the
  swiglu pairing, each sub-tile's scale row, rows past M, split-K totals, epilogues), on every projection shape
  of the tiny preset at several row counts and splits, and on two tiles of each 27B shape.
* With the mma's rounding granularity (8 chained steps of 16 per K-block) it stays within GEMM_TOL, and the
  tolerance rejects a moved scale block and one changed weight (negative controls).
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from assembler.numerics import split_k
from discrete import gemm
from loader.config import preset
from tests import gemm_numerics as gn


def case(pname, name, N, K, M, *salt):
    rng = np.random.default_rng(zlib.crc32("/".join(map(str, (pname, name, M) + salt)).encode()))
    w, s, x = gn.rand_fp8(rng, N, K), gn.rand_scale(rng, N, K), gn.rand_bf16(rng, (M, K))
    r = gn.rand_bf16(rng, (M, N))
    return w, s, x, r


# ---------------------------------------------------------------- contract
def test_plan_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 128"):
        gemm.plan(1000, 256)
    with pytest.raises(ValueError, match="K=200 must be"):
        gemm.plan(256, 200)
    with pytest.raises(ValueError, match="swiglu needs N = 2F"):
        gemm.plan(2 * 96, 256, "swiglu")
    with pytest.raises(ValueError, match="split=3 does not divide"):
        gemm.plan(256, 512, split=3)
    with pytest.raises(ValueError, match="epilogue 'gelu'"):
        gemm.plan(256, 256, "gelu")
    with pytest.raises(ValueError, match="32-bit offsets"):
        gemm.plan(2**17, 2**15)


def test_plan_splits():
    p = gemm.plan(5120, 17408, "residual")
    assert (p.split, p.per) == (split_k(5120, 17408), 17408 // 128 // split_k(5120, 17408))
    assert p.smem == gemm.STAGES * gemm.STAGE_BYTES + gemm.TOTAL_BYTES <= 227 * 1024
    one = gemm.plan(1024, 5120)  # S = 40 = K/128: one K-block per split runs as S = 1 (same bits)
    assert (one.split, one.per, one.smem) == (40, 40, gemm.STAGES * gemm.STAGE_BYTES)
    assert gemm.plan(34816, 5120, "swiglu").n_out == 17408


def test_operands_rejected_with_names():
    p = gemm.plan(256, 256, "residual")
    w, s = np.zeros((256, 256), np.uint8), np.zeros((2, 2), np.uint16)
    gemm.check_weights(p, w, s)
    with pytest.raises(ValueError, match=r"weight_scale_inv .*shape \(2, 2\)"):
        gemm.check_weights(p, w, np.zeros((2, 1), np.uint16))
    with pytest.raises(ValueError, match=r"weight \(fp8 bits\): expected dtype uint8"):
        gemm.check_weights(p, w.astype(np.uint16), s)
    x, out, res = np.zeros((40, 256), np.uint16), np.zeros((40, 256), np.uint16), np.zeros((40, 256), np.uint16)
    assert gemm.check_operands(p, x, out, res) == 40
    with pytest.raises(ValueError, match="x must be"):
        gemm.check_operands(p, np.zeros((40, 128), np.uint16), out, res)
    with pytest.raises(ValueError, match=r"x \(bf16 bits\): expected dtype uint16"):
        gemm.check_operands(p, x.astype(np.float32), out, res)
    with pytest.raises(ValueError, match="C-contiguous"):
        gemm.check_operands(p, np.zeros((256, 40), np.uint16).T, out, res)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gemm.check_operands(p, np.zeros(40 * 256 + 8, np.uint16)[1:1 + 40 * 256].reshape(40, 256), out, res)
    with pytest.raises(ValueError, match=r"out .*shape \(40, 256\)"):
        gemm.check_operands(p, x, np.zeros((40, 128), np.uint16), res)
    with pytest.raises(ValueError, match="needs residual"):
        gemm.check_operands(p, x, out)
    with pytest.raises(ValueError, match="residual given"):
        gemm.check_operands(gemm.plan(256, 256), x, out, res)
    with pytest.raises(ValueError, match="M ≥ 1"):
        gemm.check_operands(p, np.zeros((0, 256), np.uint16), np.zeros((0, 256), np.uint16), res[:0])


# ---------------------------------------------------------------- the kernel's order
def test_step_columns_are_the_gemv_permutation():
    cols = gn.step_columns()
    assert sorted(cols.reshape(-1).tolist()) == list(range(128))
    # gemv.cuh: fp8 slots of step t, lane c <-> columns 64(t/4) + 16c + 4(t%4) + {0,1,2,3}
    assert cols[5, 2:4].tolist() == [64 + 16 + 4, 64 + 16 + 5] and cols[5, 10:12].tolist() == [86, 87]


@pytest.mark.parametrize("epilogue,N", [("store", 512), ("swiglu", 1536)])
def test_tile_rows_cover_each_row_once(epilogue, N):
    p = gemm.plan(N, 256, epilogue)
    rows = np.concatenate([gn.tile_rows(p, t) for t in range(p.n_tiles)])
    assert sorted(rows.tolist()) == list(range(N))
    if epilogue == "swiglu":  # every 16-row sub-tile lies in one 128-row scale block
        sub = rows.reshape(-1, 16)
        assert (sub // 128 == sub[:, :1] // 128).all()


TINY = [(n, N, K, e) for n, N, K, e in gn.shapes(preset("tiny"))]


@pytest.mark.parametrize("M", [16, 19, 130])
@pytest.mark.parametrize("name,N,K,epi", TINY, ids=[s[0] for s in TINY])
def test_emulation_is_the_reference_tiny(name, N, K, epi, M):
    w, s, x, r = case("tiny", name, N, K, M)
    nkb = K // 128
    for S in sorted({split_k(N, K), 1, nkb, 2 if nkb % 2 == 0 else 1}):
        cols, got = gn.emulate(w, s, x, epi, S, residual=r)
        want = gn.reference(w, s, x, epi, S, residual=r, cols=cols)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), f"{name} M={M} S={S}"


BIG = [(n, N, K, e) for n, N, K, e in gn.shapes(preset("qwen3.5-27b"))]


@pytest.mark.parametrize("name,N,K,epi", BIG, ids=[s[0] for s in BIG])
def test_emulation_is_the_reference_27b(name, N, K, epi):
    M = 20
    w, s, x, r = case("27b", name, N, K, M)
    p = gemm.plan(N, K, epi)
    cols, got = gn.emulate(w, s, x, epi, residual=r, tiles=(0, p.n_tiles - 1))
    want = gn.reference(w, s, x, epi, residual=r, cols=cols)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), name


@pytest.mark.parametrize("name,N,K,epi", TINY, ids=[s[0] for s in TINY])
def test_mma_rounding_within_tolerance_and_controls_fail(name, N, K, epi):
    M = 48
    w, s, x, _ = case("tiny", name, N, K, M, "steps")
    cols, got = gn.emulate(w, s, x, "store", mode="steps")
    want = gn.reference(w, s, x, "store", cols=cols)
    gn.assert_close(got.view(np.uint16), want, f"{name} steps")
    # negative controls: the same check against a reference with a planted error must fail
    if K // 128 > 1:
        moved = gn.reference(w, np.ascontiguousarray(np.roll(s, 1, axis=1)), x, "store", cols=cols)
        assert close_mask_fraction(got, moved) < 0.5, "moved scale blocks passed GEMM_TOL"
    wb = w.view(np.uint8).copy()
    n = int(cols[len(cols) // 2])
    wb[n, 7] = 0xFE if wb[n, 7] < 0x80 else 0x7E  # one weight to ∓448 (opposite sign: a change of ≥ 448)
    bad = gn.reference(wb.view(w.dtype), s, x, "store", cols=cols)
    assert not gn.close_mask(got.view(np.uint16), bad).all(), "one changed weight passed GEMM_TOL"


def close_mask_fraction(got, want) -> float:
    return float(gn.close_mask(got.view(np.uint16), want).mean())
