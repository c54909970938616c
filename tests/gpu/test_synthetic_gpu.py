"""Synthetic weights materialised on the GPU (discrete/synthetic_gpu.py + kernels/hashgen.cu) hold the same bits
as the NumPy generator (loader.synthetic.SyntheticWeights): every tensor of the tiny preset in full, and for the
27B every tensor sampled (one random 128×128 block of each fp8 weight with its scale, random elements of each
bf16 tensor) plus whole small tensors. Outputs are poisoned with NaN bit patterns (0xFF bytes) before filling,
so an element the kernel skips cannot pass. All comparisons are exact, as bit patterns."""
from __future__ import annotations

import time
import zlib

import numpy as np
import pytest

from loader import hashgen
from loader.checkpoint import FP8, SCALE_SUFFIX
from loader.config import preset
from loader.synthetic import SyntheticWeights
from tests.tolerance import bits

cp = pytest.importorskip("cupy")
sgpu = pytest.importorskip("discrete.synthetic_gpu")


def rng(tag: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(tag.encode()))


def poisoned_fill(src: SyntheticWeights, name: str):
    """Fill ``name`` into arrays pre-set to 0xFF bytes (NaN in bf16 and e4m3)."""
    r = src.recipe(name)
    if r.dtype == FP8:
        q = cp.full(r.shape, 0xFF, cp.uint8)
        s = cp.full((-(-r.shape[0] // 128), -(-r.shape[1] // 128)), 0xFFFF, cp.uint16)
        return sgpu.fill(src, name, out=q, scale_out=s)
    return sgpu.fill(src, name, out=cp.full(r.shape, 0xFFFF, cp.uint16))


def test_f32_values_match_numpy(gpu):
    src = SyntheticWeights(preset("qwen3.5-27b"), 3)
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.5.linear_attn.A_log",
                 "model.layers.5.linear_attn.dt_bias", "model.layers.5.linear_attn.conv1d.weight"):
        r = src.recipe(name)
        start = int(rng(name).integers(0, 2**34))
        got = cp.asnumpy(sgpu.fill_values_f32(src.config, r, start, 1 << 20))
        want = hashgen.fill(r.key, r.kind, r.a, r.b, (1 << 20,), start)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name


def test_tiny_every_tensor_bit_exact(gpu):
    src = SyntheticWeights(preset("tiny"), 0)
    for name in src.names():
        if name.endswith(SCALE_SUFFIX):
            continue
        res = poisoned_fill(src, name)
        if isinstance(res, tuple):
            q, s = src.quantized(name)
            assert np.array_equal(cp.asnumpy(res[0]), bits(q)), name
            assert np.array_equal(cp.asnumpy(res[1]), bits(s)), name + SCALE_SUFFIX
        else:
            assert np.array_equal(cp.asnumpy(res), bits(src.get(name))), name


def _check_sampled(src: SyntheticWeights, name: str, dev) -> None:
    r = src.recipe(name)
    g = rng(f"{src.seed}{name}")
    if r.dtype == FP8:
        q_dev, s_dev = dev
        rows, cols = r.shape
        bi, bj = int(g.integers(0, rows // 128)), int(g.integers(0, cols // 128))
        rr, cc = np.meshgrid(np.arange(bi * 128, bi * 128 + 128), np.arange(bj * 128, bj * 128 + 128), indexing="ij")
        w = hashgen.values(r.key, r.kind, r.a, r.b, (rr * cols + cc).reshape(-1).astype(np.uint64)).reshape(128, 128)
        q, s = hashgen.quantize_blocks(w)
        blk = cp.asnumpy(q_dev[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128])
        assert np.array_equal(blk, bits(q)), f"{name} block ({bi}, {bj})"
        assert int(s_dev[bi, bj]) == int(bits(s)[0, 0]), f"{name}{SCALE_SUFFIX}[{bi}, {bj}]"
        assert not bool(((q_dev & 0x7F) == 0x7F).any()), f"{name}: NaN code left (unwritten element)"
        assert not bool((s_dev == 0xFFFF).any()), f"{name}{SCALE_SUFFIX}: unwritten scale"
    else:
        n = int(np.prod(r.shape))
        idx = np.unique(np.concatenate([g.integers(0, n, 4096), [0, n - 1]])).astype(np.uint64)
        want = bits(hashgen.to_bf16(hashgen.values(r.key, r.kind, r.a, r.b, idx)))
        flat = dev.reshape(-1)
        assert np.array_equal(cp.asnumpy(flat[cp.asarray(idx.astype(np.int64))]), want), name
        assert not bool((flat == 0xFFFF).any()), f"{name}: unwritten element"


def test_27b_sampled_against_numpy(gpu):
    """Every 27B tensor is filled (poisoned outputs, one at a time, freed after the check) and sampled."""
    src = SyntheticWeights(preset("qwen3.5-27b"), 0)
    for name in src.names():
        if not name.endswith(SCALE_SUFFIX):
            _check_sampled(src, name, poisoned_fill(src, name))
    # small tensors in full
    for name in ("model.layers.62.linear_attn.A_log",
                 "model.layers.62.linear_attn.dt_bias", "model.layers.62.linear_attn.norm.weight",
                 "model.layers.63.self_attn.k_norm.weight", "mtp.norm.weight"):
        assert np.array_equal(cp.asnumpy(sgpu.fill(src, name)), bits(src.get(name))), name


def test_27b_materialize_whole_model(gpu):
    """The whole 27B model in device memory at once; reports the time (printed, -s to see it)."""
    cfg = preset("qwen3.5-27b")
    src = SyntheticWeights(cfg, 0)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    dev = sgpu.materialize(src)
    cp.cuda.Device().synchronize()
    dt = time.perf_counter() - t0
    total = sum(a.nbytes for a in dev.values())
    print(f"materialised {len(dev)} tensors, {total / 1e9:.2f} GB in {dt:.2f} s")
    assert sorted(dev) == sorted(src.names())
    for name in ("model.layers.63.mlp.down_proj.weight", "lm_head.weight", "mtp.layers.0.self_attn.q_proj.weight"):
        _check_sampled(src, name, (dev[name], dev[name + SCALE_SUFFIX]) if name + SCALE_SUFFIX in dev else dev[name])
    del dev
    cp.get_default_memory_pool().free_all_blocks()
