"""dtype helpers for the reference ops: exact widening and round-to-nearest-even narrowing.

bf16 ↔ fp32 by bit manipulation (fast, exact), fp8 e4m3 → float64 through a 256-entry table (exact: every
e4m3 value is a float64). Narrowing follows torch: a value computed in fp32 is rounded to bf16 once (RNE).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
F32 = np.dtype(np.float32)

_FP8_LUT64 = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float64)


def f32(x: np.ndarray) -> np.ndarray:
    """Widen bf16 (or pass fp32/fp64 through as fp32). bf16 → fp32 is exact (bit shift)."""
    x = np.asarray(x)
    if x.dtype == BF16:
        return (x.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if x.dtype == FP8:
        return _FP8_LUT64[x.view(np.uint8)].astype(np.float32)
    return x.astype(np.float32, copy=False)


def f64(x: np.ndarray) -> np.ndarray:
    """Widen bf16 / fp8 / fp32 to float64 exactly."""
    x = np.asarray(x)
    if x.dtype == np.float64:
        return x
    if x.dtype == FP8:
        return _FP8_LUT64[x.view(np.uint8)]
    return f32(x).astype(np.float64)


def bf16(x: np.ndarray) -> np.ndarray:
    """Round to bf16 (RNE). float64 input is first rounded to fp32, as torch computes in fp32."""
    x = np.asarray(x)
    if x.dtype == BF16:
        return x
    return x.astype(np.float32).astype(BF16)


def need(cond: bool, msg) -> None:
    """Raise ValueError(msg) unless cond (input checks with a message naming the argument). ``msg`` may be a
    callable returning the message (hot paths: formatted only on failure)."""
    if not cond:
        raise ValueError(msg() if callable(msg) else msg)


def need_dtype(x: np.ndarray, dt: np.dtype, what: str) -> None:
    if np.asarray(x).dtype != dt:
        raise ValueError(f"{what}: expected dtype {dt}, got {np.asarray(x).dtype}")


def silu64(x: np.ndarray) -> np.ndarray:
    """SiLU in float64 then fp32 (torch computes it in fp32 for bf16/fp32 inputs)."""
    x = np.asarray(x, dtype=np.float64)
    return (x / (1.0 + np.exp(-x))).astype(np.float32)


def sigmoid64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)
