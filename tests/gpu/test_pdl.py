"""Programmatic Dependent Launch (``discrete/launch.py``, ``DecodeStep(pdl=...)``) changes start times only:
bit identity (uint16 / uint32 patterns, first mismatch reported) of PDL launches against ordinary launches —
the tiny decode step (graph replay teacher-forced with NaN-poisoned activations, free-running greedy, eager
M-row steps) and a chain of dependent GEMVs captured in one graph; plus the helper's argument checks against
the real kernel's parameter list."""
from __future__ import annotations

import numpy as np
import pytest

from loader.config import FIRST_PADDING_ID, preset
from loader.synthetic import SyntheticWeights
from tests.gpu.helpers import CAP, same_state
from tests.tolerance import assert_bits_equal

STEPS = 12


@pytest.fixture(scope="module")
def tiny_w():  # tests/gpu/conftest.py skips every test here without a device
    from discrete.weights_gpu import WeightsGPU
    cfg = preset("tiny")
    return cfg, WeightsGPU.from_synthetic(SyntheticWeights(cfg, 0))


def _graph_run(step, toks, greedy: bool):
    step.reset(tokens=toks[:1])
    step.capture()
    logits, ids = [], []
    for t in toks:
        step.poison()
        step.replay(None if greedy else [t])
        logits.append(step.buffer("logits", 1)[0])
        ids.append(step.read_token())
    return logits, ids, step.snapshot()


def _compare(a, b, cfg, what):
    la, ia, sa = a
    lb, ib, sb = b
    assert ia == ib, f"{what}: argmax differs: {ia} vs {ib}"
    for p, (x, y) in enumerate(zip(la, lb)):
        assert_bits_equal(f"{what}: logits at step {p}", x, y)
    same_state(sa, sb, cfg)


@pytest.mark.parametrize("pdl", [True, "gemv"], ids=["all", "gemv-only"])
def test_step_graph_bit_identical_with_pdl(tiny_w, pdl):
    from discrete.step import DecodeStep
    cfg, w = tiny_w
    toks = list(np.random.default_rng(11).integers(0, FIRST_PADDING_ID, size=STEPS))
    for greedy in (False, True):
        ref = _graph_run(DecodeStep(cfg, w, CAP, 1, debug_logits=True), toks, greedy)
        got = _graph_run(DecodeStep(cfg, w, CAP, 1, debug_logits=True, pdl=pdl), toks, greedy)
        _compare(ref, got, cfg, f"graph {'greedy' if greedy else 'teacher-forced'} pdl={pdl}")


def test_step_eager_rows_bit_identical_with_pdl(tiny_w):
    from discrete.step import DecodeStep
    cfg, w = tiny_w
    toks = np.random.default_rng(12).integers(0, FIRST_PADDING_ID, size=16)
    runs = []
    for pdl in (False, True):
        step = DecodeStep(cfg, w, CAP, 1, debug_logits=True, pdl=pdl)
        step.reset()
        logits, ids, s = [], [], 0
        for m in (8, 3, 1, 4):
            step.poison()
            step.run_eager(toks[s:s + m])
            logits += list(step.buffer("logits", m))
            ids += step.head_bufs["ids"][:m].get().tolist()
            s += m
        runs.append((logits, ids, step.snapshot()))
    _compare(runs[0], runs[1], cfg, "eager M-row steps")


def test_gemv_chain_graph_bit_identical_with_pdl(tiny_w):
    """Eight dependent gate|up + down pairs (x_{i+1} = x_i + down(swiglu(gate_up(x_i)))) in one graph, partial +
    reduce and fused forms: each kernel reads what its predecessor wrote, so a missing wait shows up."""
    import cupy as cp
    from discrete.gemv import Gemv
    cfg, w = tiny_w
    H, F = cfg.hidden_size, cfg.intermediate_size
    outs = []
    for pdl in (False, True):
        layers = [w.layers[i % cfg.num_hidden_layers] for i in range(8)]
        gu = [Gemv(cfg, L["gate_up"].w, L["gate_up"].scale, epilogue="swiglu", pdl=pdl) for L in layers]
        dn = [Gemv(cfg, L["down"].w, L["down"].scale, epilogue="residual", pdl=pdl) for L in layers]
        P = cp.full(max(g.partials_size(1) for g in gu + dn), np.nan, cp.float32)
        x = cp.zeros((len(layers) * 2 + 1, 1, H), cp.uint16)
        x[0] = cp.asarray((np.random.default_rng(3).standard_normal((1, H)).astype(np.float32).view(np.uint32)
                           >> 16).astype(np.uint16))
        act = cp.full((len(layers) * 2, 1, F), 0x7FC1, cp.uint16)
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            s.begin_capture()
            for i in range(len(layers)):
                for j, fused in enumerate((False, True)):
                    k = 2 * i + j
                    gu[i](x[k], act[k], P, fused=fused)
                    dn[i](act[k], x[k + 1], P, residual=x[k], fused=fused)
            g = s.end_capture()
            g.launch(s)
        s.synchronize()
        outs.append((x.get(), act.get()))
    assert_bits_equal("gemv chain: swiglu outputs", outs[0][1], outs[1][1])
    assert_bits_equal("gemv chain: residual outputs", outs[0][0], outs[1][0])


def test_launch_helper_checks_against_the_kernel(tiny_w):
    import cupy as cp
    from discrete.gemv import module
    from discrete.launch import Kernel, LaunchError
    cfg, _ = tiny_w
    k = Kernel(module(cfg).get_function("gemv_reduce"), pdl=True, name="gemv_reduce")
    if k._sizes is not None:
        assert k._sizes == (8, 4, 4, 4, 4, 8, 8)
    P, out = cp.zeros(16, cp.float32), cp.zeros(16, cp.uint16)
    n = np.int32
    P[:] = cp.arange(16, dtype=cp.float32)
    want = (cp.arange(16, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    cp.cuda.Device().synchronize()  # the capture stream below does not order against the null stream
    s = cp.cuda.Stream(non_blocking=True)
    with s:  # the cuLaunchKernelEx path (and its checks) runs only inside a stream capture
        s.begin_capture()
        try:
            with pytest.raises(LaunchError, match="Python int"):
                k((1,), (256,), (P, 1, n(1), n(16), n(0), None, out))
            if k._sizes is not None:
                with pytest.raises(LaunchError, match="argument 4 packs to 8 bytes"):
                    k((1,), (256,), (P, n(1), n(1), n(16), np.int64(0), None, out))
                with pytest.raises(LaunchError, match="6 arguments given"):
                    k((1,), (256,), (P, n(1), n(1), n(16), n(0), None))
            k((1,), (256,), (P, n(1), n(1), n(16), n(0), None, out))  # store epilogue: out = bf16(P)
        finally:
            g = s.end_capture()
        g.launch(s)
    s.synchronize()
    assert cp.array_equal(out, want)
    out[:] = 0  # outside a capture the same Kernel takes CuPy's launch (eager prefill passes)
    k((1,), (256,), (P, n(1), n(1), n(16), n(0), None, out))
    cp.cuda.Device().synchronize()
    assert cp.array_equal(out, want)
