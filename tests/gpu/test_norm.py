"""GPU tests of the three RMSNorm forms in ``discrete/kernels/norm.cuh`` against ``assembler.ref.ops``.

Tolerance: bit-identical bf16 outputs expected (the device computes the statistic, rsqrt and silu in float64 and
rounds once, like the reference). Allowed: at most 1 bf16 ulp on at most 0.1 % of elements, because CUDA's and
libm's float64 exp may differ by one float64 ulp, which can move an fp32 rounding in ~1 of 2^29 cases.
Negative controls: the same check against a reference with the weight form swapped must fail.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from assembler.ref import ops
from loader.config import preset
from tests.tolerance import ulp_check

BF = ml_dtypes.bfloat16
MAX_ULP, MAX_FRAC = 1, 1e-3

TEST_SRC = r'''
#include "norm.cuh"
template <int NT>
__device__ void t_rows_nt(const mx_u16* x, const mx_u16* w, mx_u16* y, float* rstd, int M, int n) {
    __shared__ double red[NT / 32];
    mx_rmsnorm_rows<NT>(x, n, w, y, n, M, n, red);
    for (int m = 0; m < M; ++m) {
        const float r = mx_block_rstd<NT>(x + (size_t)m * n, n, red);
        if (threadIdx.x == 0) rstd[m] = r;
    }
}
// the block sizes of the norm's callers: finish.cu (256), the megakernel (512), the TMA GEMV prologue (640)
extern "C" __global__ void t_rows(const mx_u16* x, const mx_u16* w, mx_u16* y, float* rstd, int M, int n) {
    t_rows_nt<256>(x, w, y, rstd, M, n);
}
extern "C" __global__ void t_rows512(const mx_u16* x, const mx_u16* w, mx_u16* y, float* rstd, int M, int n) {
    t_rows_nt<512>(x, w, y, rstd, M, n);
}
extern "C" __global__ void t_rows640(const mx_u16* x, const mx_u16* w, mx_u16* y, float* rstd, int M, int n) {
    t_rows_nt<640>(x, w, y, rstd, M, n);
}
extern "C" __global__ void t_head(const mx_u16* x, const mx_u16* w, mx_u16* y) {  // one warp per 256-wide head
    const int lane = threadIdx.x, h = blockIdx.x;
    float v[8]; mx_u16 o[8];
    for (int e = 0; e < 8; ++e) v[e] = mx_bf2f(x[h * 256 + lane * 8 + e]);
    mx_head_norm1pw<8>(v, w, o);
    for (int e = 0; e < 8; ++e) y[h * 256 + lane * 8 + e] = o[e];
}
extern "C" __global__ void t_gated(const mx_u16* x, const mx_u16* z, const mx_u16* w, mx_u16* y) {  // 128-wide heads
    const int lane = threadIdx.x, h = blockIdx.x;
    float v[4], g[4]; mx_u16 o[4];
    for (int e = 0; e < 4; ++e) { v[e] = mx_bf2f(x[h * 128 + lane * 4 + e]); g[e] = mx_bf2f(z[h * 128 + lane * 4 + e]); }
    mx_head_norm_gated<4>(v, g, w, o);
    for (int e = 0; e < 4; ++e) y[h * 128 + lane * 4 + e] = o[e];
}
'''


def within(got: np.ndarray, ref: np.ndarray) -> tuple[bool, str]:
    return ulp_check(got, ref, MAX_ULP, MAX_FRAC)


@pytest.fixture(scope="module")
def mod():
    import cupy as cp
    from discrete.build import nvrtc_options, translation_unit
    code = translation_unit(preset("tiny"), []) + TEST_SRC
    return cp.RawModule(code=code, options=nvrtc_options(), backend="nvrtc")


def _bf(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(BF)


def _dev(a):
    import cupy as cp
    return cp.asarray(a.view(np.uint16))


def _poisoned(shape):
    import cupy as cp
    return cp.full(shape, 0x7FC1, dtype=np.uint16)


@pytest.mark.parametrize("name", ["tiny", "qwen3.5-27b"])
@pytest.mark.parametrize("nt", [256, 512, 640])
def test_rows_1pw(gpu, mod, name, nt):
    """Both ways of mx_rmsnorm_rows: 16-byte chunks in registers (aligned rows of n <= 8·NT·MX_NORM_CH) and the
    element-wise fallback (27B at NT = 256; any misaligned row, forced below with x one element off)."""
    import cupy as cp
    cfg = preset(name)
    n, rng = cfg.hidden_size, np.random.default_rng(11)
    fn = mod.get_function("t_rows" if nt == 256 else f"t_rows{nt}")
    for M in (1, 3, 8):
        x, w = _bf(rng, (M, n), 3.0), _bf(rng, (n,), 0.1)
        y, rstd = _poisoned((M, n)), cp.full((M,), np.nan, np.float32)
        fn((1,), (nt,), (_dev(x), _dev(w), y, rstd, np.int32(M), np.int32(n)))
        got = y.get().view(BF)
        ref = ops.rmsnorm(x, w, cfg.rms_norm_eps)
        ok, msg = within(got, ref)
        assert ok, f"{name} NT={nt} M={M}: {msg}"
        # the intermediate: rstd as the reference computes it, to the bit
        ref_rstd = ops._inv_rms(x.astype(np.float32), cfg.rms_norm_eps).reshape(-1)
        assert np.array_equal(rstd.get().view(np.uint32), ref_rstd.view(np.uint32)), f"{name} M={M}: rstd differs"
        # negative control: plain w instead of (1 + w) must fail the same check
        bad = ops.bf16(x.astype(np.float32) * ref_rstd[:, None] * w.astype(np.float32))
        assert not within(got, bad)[0], "negative control passed: the check cannot fail"
        # rows are independent: row m of an M-row launch == a 1-row launch of that row (bit identity)
        y1 = _poisoned((1, n))
        fn((1,), (nt,), (_dev(x[M - 1:]), _dev(w), y1, rstd, np.int32(1), np.int32(n)))
        assert np.array_equal(y1.get()[0], y.get()[M - 1]), f"{name} M={M}: last row differs from the 1-row run"
        # misaligned x (2 bytes past a 16-byte boundary): the element-wise way, the same bits
        xp = cp.zeros(M * n + 8, cp.uint16)
        xp[1:1 + M * n] = _dev(x).reshape(-1)
        y2 = _poisoned((M, n))
        fn((1,), (nt,), (xp[1:], _dev(w), y2, rstd, np.int32(M), np.int32(n)))
        assert np.array_equal(y2.get(), y.get()), f"{name} NT={nt} M={M}: the misaligned (element-wise) way differs"


@pytest.mark.parametrize("name", ["tiny", "qwen3.5-27b"])
def test_head_qk_norm(gpu, mod, name):
    cfg = preset(name)
    assert cfg.head_dim == 256
    rng = np.random.default_rng(12)
    for M in (1, 8):
        heads = M * cfg.num_attention_heads
        x, w = _bf(rng, (heads, 256), 2.0), _bf(rng, (256,), 0.2)
        y = _poisoned((heads, 256))
        mod.get_function("t_head")((heads,), (32,), (_dev(x), _dev(w), y))
        got = y.get().view(BF)
        ok, msg = within(got, ops.rmsnorm(x, w, cfg.rms_norm_eps))
        assert ok, f"{name} M={M}: {msg}"
        bad = ops.rmsnorm(x, ops.bf16(w.astype(np.float32) - 1.0), cfg.rms_norm_eps)  # weight form swapped
        assert not within(got, bad)[0], "negative control passed"


@pytest.mark.parametrize("name", ["tiny", "qwen3.5-27b"])
def test_gated_norm(gpu, mod, name):
    cfg = preset(name)
    dv, rng = cfg.linear_value_head_dim, np.random.default_rng(13)
    for M in (1, 8):
        heads = M * cfg.linear_num_value_heads
        x, z = _bf(rng, (heads, dv), 0.5), _bf(rng, (heads, dv), 2.0)
        w = (1.0 + rng.standard_normal(dv) * 0.1).astype(np.float32).astype(BF)
        y = _poisoned((heads, dv))
        mod.get_function("t_gated")((heads,), (32,), (_dev(x), _dev(z), _dev(w), y))
        got = y.get().view(BF)
        ok, msg = within(got, ops.rmsnorm_gated(x, z, w, cfg.rms_norm_eps))
        assert ok, f"{name} M={M}: {msg}"
        bad = ops.rmsnorm_gated(x, z, ops.bf16(w.astype(np.float32) + 1.0), cfg.rms_norm_eps)  # (1+w) form
        assert not within(got, bad)[0], "negative control passed"
