"""The tests' tolerance policy, in one place (docs/tolerance.md; STYLE 4), for the CPU and the GPU tests.

Two kinds of check, and nothing in between:

* **bit identity** — what two paths that run the same arithmetic must give (megakernel vs discrete, M rows vs
  one row, graph replay vs eager, a reference op vs the transformers function with the same rounding points).
  Compared as unsigned bit patterns of the element's own width (uint8 / uint16 / uint32 / uint64), so NaN equals
  the same NaN and -0 differs from +0; the first mismatch is reported as (buffer, index):
  :func:`assert_bits_equal`, or :func:`first_mismatch` where a negative control needs the verdict.
* **a named tolerance in bf16 ulps** — where the arithmetic differs (summation order, libm vs CUDA exp,
  tensor-core order). The bound is the caller's, with its reason beside it (the test module's docstring says
  why that bound): :func:`assert_close_ulp` / :func:`ulp_check` on the distance along bf16 values
  (:func:`ulp_distance`), :func:`within_ulp_or_floor` and :func:`close_mask` on |Δ| against the bf16 spacing
  (:func:`bf16_ulp`) with an absolute floor for results that cancel to near 0, and :func:`row_err_ulps` for a
  row-scaled bound. Every check a test relies on has a negative control (a planted error must fail it).
"""
from __future__ import annotations

import numpy as np

from assembler.ref.numerics import BF16, f32

BF16_NORMAL_MIN = 2.0 ** -126  # the smallest normal bf16 (and fp32) magnitude
NAN_ULPS = 1 << 20  # ulp distance reported where either side is NaN: larger than any bound a test allows
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# ---------------------------------------------------------------------------------------------- bit identity
def bits(a) -> np.ndarray:
    """The raw bit patterns of ``a`` as unsigned integers of its element width (bf16 → uint16, fp32 → uint32)."""
    a = np.ascontiguousarray(a)
    return a.view(_UINT[a.dtype.itemsize])


def first_mismatch(name: str, a, b) -> str | None:
    """None when ``a`` and ``b`` hold the same bits; else the buffer ``name``, the mismatch count and the first
    differing index with both bit patterns."""
    a, b = bits(a), bits(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{name}: shapes {a.shape} vs {b.shape}, bits {a.dtype} vs {b.dtype}"
    bad = np.argwhere(a != b)
    if bad.size:
        i = tuple(int(v) for v in bad[0])
        w = 2 * a.dtype.itemsize + 2
        return f"{name}: {len(bad)} of {a.size} differ, first at {i}: {int(a[i]):#0{w}x} vs {int(b[i]):#0{w}x}"
    return None


def assert_bits_equal(name: str, a, b) -> None:
    """Bit identity of the buffer ``name``; the message names the first mismatch as (buffer, index)."""
    bad = first_mismatch(name, a, b)
    assert bad is None, bad


# ---------------------------------------------------------------------------------------------- bf16 ulps
def bf16_ulp(x, floor: float = 0.0) -> np.ndarray:
    """The spacing of bf16 values at |x| (x: any float values, taken as float64): 2^(⌊log2 max(|x|, floor)⌋ − 7);
    at 0 (``floor`` 0) bf16's smallest subnormal step 2^-133; inf and NaN give themselves."""
    ax = np.maximum(np.abs(np.asarray(x, np.float64)), floor)
    _, e = np.frexp(ax)
    u = np.where(ax == 0, 2.0 ** -133, np.ldexp(1.0, e - 8))
    return np.where(np.isfinite(ax), u, ax)


def ulp_distance(a, b) -> np.ndarray:
    """Per element, how many bf16 values lie between ``a`` and ``b`` (bf16 arrays or their uint16 bits: bit
    patterns mapped to a monotone integer line, so -0 and +0 are 0 apart); :data:`NAN_ULPS` where either is NaN."""
    def line(u):
        u = np.ascontiguousarray(u).view(np.uint16).astype(np.int64)
        return np.where(u & 0x8000, -(u & 0x7FFF), u)
    nan = np.isnan(a.astype(np.float32)) | np.isnan(b.astype(np.float32))
    return np.where(nan, NAN_ULPS, np.abs(line(a) - line(b)))


def ulp_check(got, ref, ulp: int, frac: float = 1.0) -> tuple[bool, str]:
    """(every element within ``ulp`` bf16 ulps of ``ref`` and at most a fraction ``frac`` of them differing at
    all, a one-line summary) — the verdict alone, for negative controls."""
    d = ulp_distance(got, ref)
    differ = float(np.mean(d > 0))
    ok = int(d.max()) <= ulp and differ <= frac
    return ok, f"max ulp {int(d.max())}, mismatching {differ:.2e} of {d.size}"


def assert_close_ulp(name: str, got, ref, ulp: int, reason: str, frac: float = 1.0) -> None:
    """``got`` within ``ulp`` bf16 ulps of ``ref`` everywhere, at most a fraction ``frac`` of elements differing
    (``reason``: why that bound; it is printed with a failure, as is the first element outside it)."""
    ok, summary = ulp_check(got, ref, ulp, frac)
    if not ok:
        d = ulp_distance(got, ref)
        i = tuple(int(v) for v in np.argwhere(d == d.max())[0])
        raise AssertionError(f"{name}: {summary} (allowed {ulp} ulp on at most {frac:.1e}: {reason}); "
                             f"first worst at {i}: {int(bits(got)[i]):#06x} vs {int(bits(ref)[i]):#06x}")


def rel_ulps(a, b) -> np.ndarray:
    """|a − b| in units of the bf16 spacing at max(|a|, |b|), elementwise (float; values below 1e-30 count as 1e-30)."""
    a, b = f32(a).astype(np.float64), f32(b).astype(np.float64)
    return np.abs(a - b) / bf16_ulp(np.maximum(np.abs(a), np.abs(b)), 1e-30)


def within_ulp_or_floor(a, b, ulp: float = 1.0, floor_rel: float = 1e-5) -> bool:
    """True when every element differs by ≤ ``ulp`` bf16 ulps (:func:`rel_ulps`), or by ≤ floor_rel × max|b|
    (values that cancel to ≈ 0 carry the absolute error of their inputs, not one ulp of their own size)."""
    d = np.abs(f32(a).astype(np.float64) - f32(b).astype(np.float64))
    return bool(np.all((rel_ulps(a, b) <= ulp) | (d <= floor_rel * np.abs(f32(b)).max())))


def close_mask(got_u16: np.ndarray, want: np.ndarray, rms_floor: float = 2.0 ** -16) -> np.ndarray:
    """True where got (bf16 bits) is within one bf16 ulp of want (bf16), or within ``rms_floor`` · RMS(row of
    want) (outputs near zero after cancellation)."""
    g = f32(got_u16.view(BF16)).astype(np.float64)
    w = f32(want).astype(np.float64)
    rms = np.sqrt(np.mean(w * w, axis=-1, keepdims=True))
    tol = np.maximum(bf16_ulp(w), rms_floor * rms)
    return np.abs(g - w) <= tol  # NaN compares False


def assert_close_mask(name: str, got_u16, want, reason: str) -> None:
    """:func:`close_mask` everywhere; the message names the count outside and the first such element."""
    ok = close_mask(got_u16, want)
    if not ok.all():
        i = tuple(int(v) for v in np.argwhere(~ok)[0])
        raise AssertionError(f"{name}: {int((~ok).sum())} of {ok.size} outside tolerance ({reason}); first at {i}: "
                             f"got {f32(got_u16.view(BF16))[i]!r}, want {f32(want)[i]!r}")


def row_err_ulps(got, ref) -> float:
    """max |got − ref| in bf16 ulps of max |ref| of the row (NaN in got → inf), for row-scaled bounds."""
    g, r = got.astype(np.float64), ref.astype(np.float64)
    if np.isnan(g).any():
        return float("inf")
    return float(np.max(np.abs(g - r)) / bf16_ulp(np.max(np.abs(r)), BF16_NORMAL_MIN))
