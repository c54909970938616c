"""Work partition of a GEMV into slices: one task range per SM (the discrete kernel launches one block each).

A warp task is one 16-row tile for one split, numbered ``t = tile · S + split`` (S = ``split_k(N, K)``). The
T = (N / 16) · S tasks are cut into ``n_blocks`` contiguous ranges whose sizes differ by at most one, so every
SM streams the same number of bytes (±1 task) and, with one task per warp, all of them run at once. Measured
on the H200 (docs/kernels-gemv.md): fixed 128-row slices left some SMs with 3 blocks and others with 2; the
balanced ranges took gate|up from 60 % to 68 % of bandwidth. A stand-in until ``assembler/scheduler.py`` provides the per-SM partition; results
never depend on the partition (numerics depend on ``split_k`` only), only speed does.
"""
from __future__ import annotations

import numpy as np

from assembler.numerics import H200_SMS, K_BLOCK, ROW_TILE, split_k

FP8_WARPS = 28   # QMK_GEMV_WARPS of kernels/gemv.cuh (fp8 kernel block = 896 threads)
BF16_WARPS = 24  # QMK_GEMV_BF16_WARPS (bf16 kernel block = 768 threads)


def gemv_tasks(n_rows: int, k_cols: int, split: int | None = None) -> tuple[int, int]:
    """(task count T, split S) of an [n_rows, k_cols] projection. Raises ValueError on bad sizes/split."""
    if n_rows <= 0 or n_rows % ROW_TILE:
        raise ValueError(f"gemv partition: n_rows={n_rows} must be a positive multiple of {ROW_TILE}")
    if k_cols <= 0 or k_cols % K_BLOCK:
        raise ValueError(f"gemv partition: k_cols={k_cols} must be a positive multiple of {K_BLOCK}")
    S = split_k(n_rows, k_cols) if split is None else int(split)
    if S <= 0 or (k_cols // K_BLOCK) % S:
        raise ValueError(f"gemv partition: split={S} does not divide the {k_cols // K_BLOCK} K-blocks")
    return (n_rows // ROW_TILE) * S, S


def gemv_slices(n_rows: int, k_cols: int, split: int | None = None, n_blocks: int = H200_SMS) -> np.ndarray:
    """Slices: int32 [min(n_blocks, T), 4] rows (task_start, task_end, 0, 0), balanced to ±1 task, in order."""
    T, _ = gemv_tasks(n_rows, k_cols, split)
    nb = max(1, min(int(n_blocks), T))
    b = np.arange(nb + 1, dtype=np.int64) * T // nb
    out = np.zeros((nb, 4), np.int32)
    out[:, 0], out[:, 1] = b[:-1], b[1:]
    return out
