"""The fast CPU executor (``host/cpu_fast.py``, executor kind ``cpu``) against the NumPy reference on the tiny
synthetic checkpoint, and the executor interface (slots, snapshots) of both CPU kinds.

Tolerance (``host.cpu_fast.agreement``): the fast path is float32 at the reference's bf16 rounding points, so it
is not bit-identical; its logits may differ from the reference's no more than the transformers oracle's two
paths differ from each other (docs/tolerance.md envelope: d32 statistics after a one-ulp allowance, top-1 equal
wherever the reference's margin is clear). Negative controls: a skipped layer, the wrong RoPE base, a perturbed
weight matrix, each of which the same check must reject.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from assembler.ref.envelope import GOLDEN_SUFFIX, load_golden
from assembler.ref.numerics import BF16, f32, f64

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
PROMPT, DECODE, VERIFY = 100, 4, 4   # prefill rows (crosses the 64 cut), single decode steps, one 4-row decode


@pytest.fixture(scope="module")
def weights(tiny_ckpt):
    from loader.checkpoint import Checkpoint
    return Checkpoint.open(tiny_ckpt)


@pytest.fixture(scope="module")
def ids():
    return load_golden(GOLDEN / f"oracle_prose{GOLDEN_SUFFIX}")["ids"].astype(np.int64)[:PROMPT + DECODE + VERIFY]


def _run(model, ids) -> np.ndarray:
    """Logits [PROMPT + DECODE + VERIFY, V] as float32: prefill of every prompt row, then DECODE single steps
    and one VERIFY-row decode call, teacher forced with ``ids``."""
    st = model.new_state(256)
    out = [f32(model.prefill(st, ids[:PROMPT]))]
    for t in range(PROMPT, PROMPT + DECODE):
        out.append(f32(model.decode(st, ids[t:t + 1])))
    out.append(f32(model.decode(st, ids[PROMPT + DECODE:])))
    return np.concatenate(out)


@pytest.fixture(scope="module")
def ref_logits(weights, ids):
    from assembler.ref.model import ReferenceModel
    return _run(ReferenceModel(weights), ids)


@pytest.fixture(scope="module")
def fast(weights):
    from host.cpu_fast import FastModel
    return FastModel(weights)


def test_bounds_are_the_envelope():
    """The fast path's bounds are the oracle self-disagreement envelope of the goldens, not numbers of its own."""
    from assembler.ref.envelope import Envelope, load_goldens
    from host.cpu_fast import D32_BOUNDS, TIE_MARGIN
    env = Envelope.calibrate(load_goldens(GOLDEN))
    assert env.d32 == D32_BOUNDS and env.tie_margin == TIE_MARGIN


def test_fast_logits_agree_with_reference(fast, ref_logits, ids):
    from host.cpu_fast import agreement
    stats, fails = agreement(_run(fast, ids), ref_logits)
    print("fast vs reference:", stats)
    assert not fails, fails
    assert stats["positions"] == PROMPT + DECODE + VERIFY


def _skip_layer(m):
    m.skip = frozenset([5])


def _rope_base(m):
    m.theta = 1e4


def _perturb_down(m):
    m.layers[5]["down"] = m.layers[5]["down"] * np.float32(1.2)


@pytest.mark.parametrize("defect", [_skip_layer, _rope_base, _perturb_down],
                         ids=["skip-layer-5", "rope-theta-1e4", "down-proj-5-x1.2"])
def test_negative_controls_fail_the_check(fast, ref_logits, ids, defect):
    """Each planted defect must fail the check on d32 (measured after the allowance: d32 max 0.75-8.6, the fast
    path's 0.125)."""
    import copy

    from host.cpu_fast import agreement
    m = copy.copy(fast)
    m.layers = [dict(L) for L in fast.layers]          # a defect replaces entries, never the shared arrays
    defect(m)
    stats, fails = agreement(_run(m, ids), ref_logits)
    assert any(f.startswith("d32") for f in fails), (stats, fails)


def test_widened_weights_are_exact(weights, fast):
    """Every fused float32 matrix equals fp8 × its block scale (or bf16) of the checkpoint exactly."""
    from host.cpu_fast import dequantize_f32

    def exact(name):
        w = np.asarray(weights.get(name + ".weight"))
        if w.dtype == BF16:
            return f64(w)
        s = np.repeat(np.repeat(f64(np.asarray(weights.get(name + ".weight_scale_inv"))), 128, 0), 128, 1)
        return f64(w) * s[:w.shape[0], :w.shape[1]]
    cat = lambda *ns: np.concatenate([exact(n) for n in ns])  # noqa: E731
    a, g = "model.layers.0.linear_attn.", "model.layers.3.self_attn."
    pairs = [(fast.layers[0]["in"], cat(*(a + n for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")))),
             (fast.layers[0]["out"], cat(a + "out_proj")),
             (fast.layers[3]["in"], cat(g + "q_proj", g + "k_proj", g + "v_proj")),
             (fast.layers[3]["gate_up"], cat("model.layers.3.mlp.gate_proj", "model.layers.3.mlp.up_proj")),
             (fast.lm_head, exact("lm_head"))]
    for have, want in pairs:
        assert have.dtype == np.float32 and np.array_equal(have.astype(np.float64), want)
    # control: a scale applied one 128-row block off changes the widened matrix
    w = np.asarray(weights.get(g + "q_proj.weight"))
    s = np.asarray(weights.get(g + "q_proj.weight_scale_inv"))
    assert not np.array_equal(dequantize_f32(w, np.roll(s, 1, axis=0)), fast.layers[3]["in"][:w.shape[0]])


def test_slots_and_snapshots(weights, ids):
    """Two slots interleaved give each one's logits alone (bit for bit); a restored snapshot replays the same
    logits; without the restore they differ (control)."""
    from host.executors import CpuExecutor, make_executor
    ex = make_executor("cpu", weights, capacity=160, slots=2)
    assert isinstance(ex, CpuExecutor) and ex.name == "cpu" and "float32" in ex.detail
    a, b = ids[:70], ids[30:100]

    def alone(p):
        ex.reset(0)
        return [ex.prefill(p).logits] + [ex.step(t).logits for t in (11, 12, 13)]
    want_a, want_b = alone(a), alone(b)
    ex.reset(0)
    got_a = [ex.prefill(a).logits]
    ex.reset(1)
    got_b = [ex.prefill(b).logits]
    for t in (11, 12, 13):
        ex.select(0)
        got_a.append(ex.step(t).logits)
        ex.select(1)
        got_b.append(ex.step(t).logits)
    same = lambda x, y: all(np.array_equal(u.view(np.uint16), v.view(np.uint16)) for u, v in zip(x, y))  # noqa: E731
    assert same(got_a, want_a) and same(got_b, want_b)
    ex.select(0)
    snap = ex.state_snapshot()
    run = lambda: [ex.step(t).logits for t in (21, 22)]  # noqa: E731
    first = run()
    assert ex.position == len(a) + 5
    ex.state_restore(snap)
    assert ex.position == len(a) + 3 and same(run(), first)
    assert not same(run(), first)                     # control: from position +5 the same tokens give other logits
    with pytest.raises(ValueError, match="slot 2 out of range"):
        ex.select(2)


def test_cpu_vm_kind_is_bit_identical_to_reference(weights, ids):
    """``cpu-vm`` keeps the reference prefill + CPU VM decode: its logits equal ReferenceModel's bits."""
    from assembler.ref.model import ReferenceModel
    from host.executors import CpuVmExecutor, make_executor
    ex = make_executor("cpu-vm", weights, capacity=64, slots=1)
    assert isinstance(ex, CpuVmExecutor) and ex.name == "cpu-vm" and "VM decode" in ex.detail
    ex.reset(0)
    got = [ex.prefill(ids[:20]).logits, ex.step(int(ids[20])).logits]
    rm = ReferenceModel(weights)
    st = rm.new_state(64)
    want = [rm.prefill(st, ids[:20], logit_rows=[19])[-1], rm.decode(st, ids[20:21])[-1]]
    for g, w in zip(got, want):
        assert np.array_equal(g.view(np.uint16), w.view(np.uint16))


def test_default_kind_without_gpu_is_the_fast_path():
    from host.executors import CPU_KINDS, KINDS, default_kind, gpu_available
    assert set(CPU_KINDS) <= set(KINDS)
    if gpu_available()[0]:
        pytest.skip("a GPU is present")
    assert default_kind() == "cpu"
