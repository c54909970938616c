"""The RMSNorm fused into the GEMV launch (``Gemv(..., norm_weight=...)``, ``DecodeStep(fuse_norm=...)``, issue 5)
against the two-launch form (``qmk_rmsnorm_rows`` then the plain GEMV). Tolerance: none — both run the same
device function (``mx_rmsnorm_rows``) on the same inputs, so every buffer is compared as bit patterns (uint16 /
uint32), first mismatch reported:
* Gemv level: fp8 and bf16 weights, M = 1, 3, 8, fused and partial + reduce, output, partials and the normed
  rows block 0 stores; inputs with a wide dynamic range (the block size differs: 256 threads vs the GEMV's).
* Step level (tiny): several steps with NaN-poisoned activations, M = 1 (graph replay and eager) and M = 3
  (eager and a 3-row graph): the whole activation arena, the split-K scratch, control block, argmax ids/values,
  GDN state and conv rings after every step, and the KV cache at the end.
"""
from __future__ import annotations

import numpy as np
import pytest

from loader.config import FIRST_PADDING_ID, preset
from loader.synthetic import SyntheticWeights
from tests.gpu.helpers import CAP
from tests.tolerance import assert_bits_equal

STEPS = 6


@pytest.fixture(scope="module")
def tiny_w():  # tests/gpu/conftest.py skips every test here without a device
    from discrete.weights_gpu import WeightsGPU
    cfg = preset("tiny")
    return cfg, WeightsGPU.from_synthetic(SyntheticWeights(cfg, 0))


def _bf16_bits(rng, shape, spread: float = 0.0) -> np.ndarray:
    """Random bf16 bit patterns: normal values times 2^U(-spread, spread/2) (finite, no NaN)."""
    v = rng.standard_normal(shape).astype(np.float32)
    if spread:
        v *= np.exp2(rng.uniform(-spread, spread / 2, shape)).astype(np.float32)
    return (v.view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("M", [1, 3, 8], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("fused", [True, False], ids=["fused-reduce", "partial+reduce"])
def test_gemv_norm_prologue_bit_identical(tiny_w, kind, M, fused):
    import cupy as cp
    from discrete.build import load_module
    from discrete.gemv import Gemv
    from discrete.step import control_defines
    cfg, w = tiny_w
    H, L = cfg.hidden_size, w.layers[0]
    rng = np.random.default_rng(100 + M)
    if kind == "fp8":
        p, epi = L["gate_up"], "swiglu"
        wt, sc = p.w, p.scale
    else:
        epi, sc = "store", None
        wt = cp.asarray(_bf16_bits(rng, (3 * 128, H)) & np.uint16(0xBFFF))  # exponent bit 7 cleared: |w| < 2
    nw = cp.asarray(_bf16_bits(rng, (H,)))
    x = cp.asarray(_bf16_bits(rng, (M, H), spread=24.0))
    ref = Gemv(cfg, wt, sc, epilogue=epi, name="ref")
    got = Gemv(cfg, wt, sc, epilogue=epi, name="fused", norm_weight=nw)
    norm = load_module(cfg, ("finish.cu",), control_defines()).get_function("qmk_rmsnorm_rows")
    outs = []
    for g in (ref, got):
        P = cp.full(g.partials_size(M), np.nan, cp.float32)
        xn = cp.full((M, H), 0x7FC1, cp.uint16)
        out = cp.full((M, g.n_out), 0x7FC1, cp.uint16)
        if g is ref:
            norm((1,), (256,), (x, nw, xn, np.int32(M), np.int32(H)))
            g(xn, out, P, fused=fused)
        else:
            g(x, out, P, fused=fused, normed=xn)
        cp.cuda.Device().synchronize()
        outs.append((out.get(), xn.get(), P.get()))
    what = f"{kind} M={M} {'fused' if fused else 'partial+reduce'}"
    assert_bits_equal(f"{what}: normed rows", outs[0][1], outs[1][1])
    assert_bits_equal(f"{what}: output", outs[0][0], outs[1][0])
    assert_bits_equal(f"{what}: partials", outs[0][2], outs[1][2])


def test_gemv_norm_contract(tiny_w):
    import cupy as cp
    from discrete.gemv import Gemv
    cfg, w = tiny_w
    p = w.layers[0]["gate_up"]
    with pytest.raises(ValueError, match="norm_weight"):
        Gemv(cfg, p.w, p.scale, epilogue="swiglu", norm_weight=cp.zeros(cfg.hidden_size + 1, cp.uint16))
    g = Gemv(cfg, p.w, p.scale, epilogue="swiglu")
    x = cp.zeros((1, cfg.hidden_size), cp.uint16)
    with pytest.raises(ValueError, match="no norm_weight"):
        g(x, cp.zeros((1, g.n_out), cp.uint16), cp.zeros(g.partials_size(1), cp.float32), normed=x)


def _state(step, M: int) -> dict:
    """Every buffer the step writes (bit patterns), after the stream drains (lm_head buffers: the M rows written;
    the rest is never-initialised memory)."""
    step.stream.synchronize()
    hb = step.head_bufs
    s = {"arena": step.arena.view(np.uint16).get(), "partials": step.partials.view(np.uint32).get(),
         "ctrl": step.ctrl.get(), "ids": hb["ids"][:M].get(), "vals": hb["vals"][:M].get(),
         "best": hb["best"][:M * step.head.nblk].get()}
    for i in step.rec:
        s[f"rec.{i}"] = step.rec[i].view(np.uint32).get()
        s[f"ring.{i}"] = step.ring[i].get()
    return s


def _run(step, toks, M: int, mode: str) -> list[dict]:
    step.reset(tokens=toks[:M])
    if mode == "graph":
        step.capture()
    states = []
    for s in range(STEPS):
        t = toks[s * M:(s + 1) * M]
        step.poison()
        if mode == "graph":
            step.replay(t)
        else:
            step.run_eager(t)
        states.append(_state(step, M))
    states.append({"kv": step.kv.pool.get()})
    return states


@pytest.mark.parametrize("M,mode", [(1, "graph"), (1, "eager"), (3, "eager"), (3, "graph")],
                         ids=["M1-graph", "M1-eager", "M3-eager", "M3-graph"])
def test_step_fuse_norm_bit_identical(tiny_w, M, mode):
    from discrete.step import DecodeStep
    cfg, w = tiny_w
    toks = [int(t) for t in np.random.default_rng(20 + M).integers(0, FIRST_PADDING_ID, size=STEPS * M)]
    runs = [_run(DecodeStep(cfg, w, CAP, M, debug_logits=True, fuse_norm=f), toks, M, mode) for f in (False, True)]
    for s, (a, b) in enumerate(zip(*runs)):
        for name in a:
            assert_bits_equal(f"M={M} {mode} step {s}: {name}", a[name], b[name])


def test_fuse_norm_drops_the_layer_norm_launches(tiny_w):
    from discrete.step import DecodeStep
    cfg, w = tiny_w
    cats = {f: [c for c, _ in DecodeStep(cfg, w, CAP, 1, fuse_norm=f).launches(1)] for f in (False, True)}
    assert cats[False].count("norm") == 2 * cfg.num_hidden_layers + 1
    assert cats[True].count("norm") == 1
    assert len(cats[False]) - len(cats[True]) == 2 * cfg.num_hidden_layers
