"""Counter-based hash generator for synthetic weights (NumPy side).

Every element of a synthetic tensor is a pure function of (seed, tensor name, flat element index), so any
slice can be produced on its own, in any order, on the CPU (here) or on the GPU
(``discrete/kernels/hashgen.cuh``, the same arithmetic in CUDA). Both sides use only exact integer ops and
correctly rounded fp32 ``+ - * /`` (no FMA contraction, no transcendental functions), then fp32→bf16 and
fp32→e4m3 round-to-nearest-even with saturation before the cast, so they produce the same bits.

Hash: splitmix64 (Steele, Lea, Flood 2014; the finaliser of Vigna's ``splitmix64.c``):
``key = mix(mix(seed + G) ^ tid)``, ``tid`` = first 8 bytes (little-endian) of sha256(name);
``h[i] = mix(key + (i + 1)·G)`` (mod 2^64).

Value kinds (``a``, ``b`` are fp32 constants chosen per tensor by ``loader.synthetic``):

| kind | value (each op rounded to fp32) | distribution |
|---|---|---|
| NORMAL | ``f32(c)·a + b``, c = Σ four 16-bit fields of h − 131070 | Irwin–Hall(4) ≈ N(b, (a·65536/√3)²), |z| ≤ 2√3 |
| UNIFORM | ``u·a + b``, u = (h >> 40)·2^-24 | U[b, b + a) |
| LOG_UNIFORM | ``ln(u·a + b)`` by exponent split + atanh series (deg 9, error < 1e-8) | log of U[b, b + a), b > 0 |

Block quantisation to fp8 (spec §5): per 128×128 block ``s = f32(amax / 448)`` stored as bf16 (RNE),
``q = e4m3_rne(clamp(w / f32(s_bf16), ±448))``; an all-zero block gets s = 0 and q = 0.
"""
from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB

NORMAL, UNIFORM, LOG_UNIFORM = 0, 1, 2
KIND_NAMES = {NORMAL: "normal", UNIFORM: "uniform", LOG_UNIFORM: "log_uniform"}
IH_CENTER = 2 * 65535            # mean of the sum of four 16-bit fields
IH_UNIT = np.float32(np.sqrt(3.0) / 65536.0)  # multiplier giving unit variance (derived: Var = 4·(2^32−1)/12)
FP8_MAX = np.float32(448.0)
BLOCK = 128

# fp32 constants of the log series; the CUDA header spells the same bits as hex-float literals
LN2 = np.float32(np.log(2.0))
SQRT2 = np.float32(np.sqrt(2.0))
LOG_COEFS = tuple(np.float32(1.0 / k) for k in (9, 7, 5, 3, 1))

_U64 = np.uint64


def mix64_int(z: int) -> int:
    """splitmix64 finaliser on a Python int (mod 2^64)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def tensor_id(name: str) -> int:
    """64-bit tensor id: first 8 bytes (little-endian) of sha256 of the canonical tensor name."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def tensor_key(seed: int, name: str) -> int:
    """Per-tensor key ``mix(mix(seed + G) ^ tid)``; ``seed`` is taken mod 2^64. Returns a Python int."""
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return mix64_int(mix64_int(int(seed) + GOLDEN) ^ tensor_id(name))


def hash_at(key: int, idx: np.ndarray) -> np.ndarray:
    """``mix(key + (idx + 1)·G)`` for an array of flat indices (any int dtype) → uint64 array."""
    with np.errstate(over="ignore"):
        z = idx.astype(_U64)  # a copy: updated in place below (halves memory traffic)
        z += _U64(1)
        z *= _U64(GOLDEN)
        z += _U64(key)
        z ^= z >> _U64(30)
        z *= _U64(MIX1)
        z ^= z >> _U64(27)
        z *= _U64(MIX2)
        z ^= z >> _U64(31)
    return z


def _log_f32(x: np.ndarray) -> np.ndarray:
    """ln(x) for positive normal fp32 x with fp32 ops only (same op order as ``qmk_log_f32`` in CUDA)."""
    bits = x.view(np.uint32)
    e = (bits >> np.uint32(23)).astype(np.int32) - 127
    m = ((bits & np.uint32(0x7FFFFF)) | np.uint32(0x3F800000)).view(np.float32)
    big = m > SQRT2
    m = np.where(big, m * np.float32(0.5), m)   # exact halving: m in (0.707, 1.414]
    e = e + big.astype(np.int32)
    one = np.float32(1.0)
    t = (m - one) / (m + one)
    t2 = t * t
    p = np.full_like(t, LOG_COEFS[0])
    for c in LOG_COEFS[1:]:
        p = p * t2
        p = p + c
    r = (t * p) * np.float32(2.0)
    return e.astype(np.float32) * LN2 + r


def values(key: int, kind: int, a: np.float32, b: np.float32, idx: np.ndarray) -> np.ndarray:
    """fp32 values of elements ``idx`` (flat indices) of the tensor with ``key``. Raises ValueError on an
    unknown kind."""
    a, b = np.float32(a), np.float32(b)
    h = hash_at(key, idx)
    if kind == NORMAL:
        # sum of the four 16-bit fields: pairwise in two 32-bit lanes, then the lanes
        lanes = _U64(0x0000FFFF0000FFFF)
        x = h & lanes
        h >>= _U64(16)
        h &= lanes
        x += h
        c = (x & _U64(0xFFFFFFFF)) + (x >> _U64(32))
        return (c.astype(np.int64) - IH_CENTER).astype(np.float32) * a + b
    u = (h >> _U64(40)).astype(np.float32) * np.float32(2.0 ** -24)
    if kind == UNIFORM:
        return u * a + b
    if kind == LOG_UNIFORM:
        return _log_f32(u * a + b)
    raise ValueError(f"unknown generator kind {kind!r}; expected one of {sorted(KIND_NAMES)}")


def fill(key: int, kind: int, a, b, shape: tuple[int, ...], start: int = 0) -> np.ndarray:
    """fp32 array of ``shape`` holding the elements with flat indices ``start, start+1, …``."""
    n = int(np.prod(shape, dtype=np.int64))
    return values(key, kind, a, b, np.arange(start, start + n, dtype=np.uint64)).reshape(shape)


def to_bf16(w: np.ndarray) -> np.ndarray:
    """fp32 → bf16, round to nearest even (ml_dtypes; exact per the toolchain notes)."""
    return np.asarray(w, dtype=np.float32).astype(ml_dtypes.bfloat16)


def quantize_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-128×128-block scale-to-fit quantisation of fp32 ``w`` [R, C] (any R, C; partial edge blocks use
    their valid part). Returns (q float8_e4m3fn [R, C], scale_inv bfloat16 [ceil(R/128), ceil(C/128)])."""
    if w.ndim != 2 or w.dtype != np.float32:
        raise ValueError(f"quantize_blocks: expected a 2-D float32 array, got {w.dtype} {w.shape}")
    r, c = w.shape
    br, bc = -(-r // BLOCK), -(-c // BLOCK)
    pad = np.zeros((br * BLOCK, bc * BLOCK), np.float32)
    pad[:r, :c] = np.abs(w)
    amax = pad.reshape(br, BLOCK, bc, BLOCK).max(axis=(1, 3))
    s = (amax / FP8_MAX).astype(ml_dtypes.bfloat16)
    sf = np.repeat(np.repeat(s.astype(np.float32), BLOCK, 0), BLOCK, 1)[:r, :c]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(sf == 0, np.float32(0), w / sf)
    q = np.clip(q, -FP8_MAX, FP8_MAX)  # ml_dtypes turns overflow into NaN: clamp first
    return q.astype(ml_dtypes.float8_e4m3fn), s
