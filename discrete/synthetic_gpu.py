"""Materialise synthetic weights directly in GPU memory (no files): the CuPy launcher of
``discrete/kernels/hashgen.cu``.

For a :class:`loader.synthetic.SyntheticWeights` spec, every tensor is filled on the device with the same
bits as ``SyntheticWeights.get`` (and a checkpoint written with the same seed). CuPy has no bf16 or fp8
dtype, so arrays hold raw bits: bf16 tensors as ``uint16``, fp8 e4m3 payloads as ``uint8`` (shapes as
stored, row-major); scales (``weight_scale_inv``) are bf16 bits ``uint16``.
"""
from __future__ import annotations

import math

import numpy as np

from discrete.build import load_module
from loader.checkpoint import FP8, SCALE_SUFFIX
from loader.synthetic import Recipe, SyntheticWeights

FILL_BLOCKS, FILL_THREADS, FP8_THREADS = 132 * 8, 256, 256  # FP8_THREADS = QMK_HASH_FP8_THREADS in hashgen.cu


def _module(cfg):
    return load_module(cfg, ["hashgen.cu"])


def _check(arr, dtype, shape, what: str) -> None:
    import cupy as cp
    if not isinstance(arr, cp.ndarray) or arr.dtype != dtype or tuple(arr.shape) != tuple(shape) \
            or not arr.flags.c_contiguous:
        got = f"{type(arr).__name__} {getattr(arr, 'dtype', '?')} {getattr(arr, 'shape', '?')}"
        raise ValueError(f"{what}: expected a C-contiguous cupy {np.dtype(dtype).name} array {tuple(shape)}, got {got}")


def fill_values_f32(cfg, r: Recipe, start: int, n: int):
    """fp32 generator values of elements [start, start + n) of recipe ``r`` (before any rounding) as a
    cupy float32 array [n] (for tests)."""
    import cupy as cp
    out = cp.empty(n, cp.float32)
    _module(cfg).get_function("qmk_hash_fill_f32")(
        (FILL_BLOCKS,), (FILL_THREADS,),
        (out, np.uint64(n), np.uint64(start), np.uint64(r.key), np.int32(r.kind), np.float32(r.a), np.float32(r.b)))
    return out


def fill(weights: SyntheticWeights, name: str, out=None, scale_out=None):
    """Fill tensor ``name`` (a weight; for fp8 weights also its scale) on the device.

    bf16 tensors: returns a uint16 array of the stored shape (``out`` if given). fp8 weights (the
    ``.weight`` name): returns (q uint8 [rows, cols], scale uint16 [ceil(rows/128), ceil(cols/128)]),
    filling ``out``/``scale_out`` if given. Raises KeyError for an unknown tensor, ValueError for a scale name
    (fill its weight) or for a wrong output array."""
    import cupy as cp
    if name.endswith(SCALE_SUFFIX):
        raise ValueError(f"fill({name!r}): scales come with their weight; fill {name[:-len(SCALE_SUFFIX)]!r}")
    r = weights.recipe(name)
    mod = _module(weights.config)
    args = (np.uint64(r.key), np.int32(r.kind), np.float32(r.a), np.float32(r.b))
    if r.dtype == FP8:
        rows, cols = r.shape
        sshape = (math.ceil(rows / 128), math.ceil(cols / 128))
        q = cp.empty(r.shape, cp.uint8) if out is None else out
        s = cp.empty(sshape, cp.uint16) if scale_out is None else scale_out
        _check(q, cp.uint8, r.shape, f"fill({name!r}) out")
        _check(s, cp.uint16, sshape, f"fill({name!r}) scale_out")
        mod.get_function("qmk_hash_fill_fp8")((sshape[1], sshape[0]), (FP8_THREADS,),
                                             (q, s, np.int32(rows), np.int32(cols), *args))
        return q, s
    o = cp.empty(r.shape, cp.uint16) if out is None else out
    _check(o, cp.uint16, r.shape, f"fill({name!r}) out")
    mod.get_function("qmk_hash_fill_bf16")((FILL_BLOCKS,), (FILL_THREADS,), (o, np.uint64(o.size), *args))
    return o


def materialize(weights: SyntheticWeights, names=None) -> dict:
    """Every tensor of ``weights`` (or of ``names``; a scale name brings its weight) as device arrays,
    canonical name → cupy array (bits as in the module docstring)."""
    names = weights.names() if names is None else list(names)
    want = {n[:-len(SCALE_SUFFIX)] if n.endswith(SCALE_SUFFIX) else n for n in names}
    out = {}
    for n in weights.names():
        if n in want:
            res = fill(weights, n)
            if isinstance(res, tuple):
                out[n], out[n + SCALE_SUFFIX] = res
            else:
                out[n] = res
    return out
