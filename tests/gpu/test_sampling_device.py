"""Sampling on the GPU (discrete/sampling.py) against the host sampler (assembler/ref/sampling.sample).

Each case draws a bf16 row and a u, runs the kernel on a NaN-free but poisoned workspace, and runs the reference
with a generator that returns the same u. The ids must be equal, except where the reference's own draw lies
within BOUNDARY_REL of a cumulative boundary (the one place the fixed-point sums may round the other way,
docs/sampling.md): such cases are counted and must stay rare; or where u = 0 and the host's pick has a probability
below 2^-62 of the kept mass, which the kernel's fixed-point masses cannot hold (it draws the first id it can). The number of ids the filters keep must equal the
reference's count of normal (not subnormal: the kernels flush those) probabilities. Negative controls: a draw
shifted by 0.01 or a top-p off by 0.05 must be caught by the same comparison.
"""
from __future__ import annotations

import numpy as np
import pytest

from assembler.ref import sampling as ref
from assembler.ref.numerics import BF16, f32
from loader.config import FIRST_PADDING_ID, preset
from host.sampling import mask_padding
from tests.gpu.helpers import seed_of

cp = pytest.importorskip("cupy")

BOUNDARY_REL = 1e-9  # |u·Σp − c_boundary| / Σp below this: the host's draw sits on a rounding boundary
FIXED_RES = 2.0 ** -62  # the kernel's fixed-point probability unit: a smaller share has mass 0 there
_FLT_MIN = np.float32(np.finfo(np.float32).tiny)


class _FixedU:
    """A generator stand-in: ``random()`` returns the given u (ref.sample draws exactly one per row)."""

    def __init__(self, u: float):
        self.u = float(u)

    def random(self) -> float:
        return self.u


def _row(rng, kind: str, V: int) -> np.ndarray:
    """bf16 bits [V] of one kind of logit row."""
    if kind == "normal":
        x = rng.standard_normal(V).astype(np.float32) * 3
    elif kind == "peaked":
        x = rng.standard_normal(V).astype(np.float32) * 2
        x[rng.integers(0, FIRST_PADDING_ID, 5)] += 25
    elif kind == "ties":  # few distinct values: ties at every top-k and top-p boundary
        x = rng.integers(-6, 3, V).astype(np.float32) * 0.5
    elif kind == "flat":
        x = np.zeros(V, np.float32)
    elif kind == "wide":  # a range past exp's fp32 underflow
        x = rng.uniform(-200, 20, V).astype(np.float32)
    else:
        raise ValueError(kind)
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _reference(bits: np.ndarray, temperature, top_k, top_p, u):
    """(id, kept count, the draw's distance to its nearest cumulative boundary over Σp, the id's share of Σp)."""
    logits = mask_padding(f32(bits.view(BF16)))  # the bits as bf16 values (f32 of uint16 would cast integers)
    tok = int(ref.sample(logits, temperature, top_k, top_p if top_p is not None else 1.0, _FixedU(u)))
    s = ref.filter_logits(logits, temperature, top_k, top_p)
    m = np.max(s)
    with np.errstate(invalid="ignore"):
        if np.isposinf(m):
            e = np.where(np.isposinf(s), np.float32(1), np.float32(0))
        else:
            e = np.exp((s - m).astype(np.float32).astype(np.float64)).astype(np.float32)
    kept = int(np.count_nonzero(e >= _FLT_MIN))
    p = ref._softmax32(s[None])[0].astype(np.float64)
    c = np.cumsum(p)
    t = u * c[-1]
    margin = float(np.min(np.abs(c - t)) / c[-1])
    return tok, kept, margin, float(p[tok] / c[-1])


CASES = [  # (row kind, temperature, top_k, top_p)
    ("normal", 1.0, 0, None), ("normal", 0.7, 20, 0.95), ("normal", 0.6, 0, 0.8), ("normal", 1.3, 50, None),
    ("normal", 1.0, 1, None), ("normal", 0.9, 1000, 0.5), ("peaked", 0.6, 20, 0.95), ("peaked", 1.0, 0, 0.99),
    ("ties", 1.0, 20, None), ("ties", 1.0, 0, 0.7), ("ties", 0.8, 7, 0.5), ("flat", 1.0, 0, 0.3),
    ("flat", 1.0, 5, None), ("wide", 1.0, 0, None), ("wide", 2.0, 0, 0.9), ("normal", 1e-30, 0, None),
    ("normal", 1.0, 0, 1e-7), ("ties", 1.0, 0, 1e-7), ("normal", 1.0, 300000, 0.9),
]


@pytest.fixture(scope="module")
def sampler():
    """One DeviceSampler for the module (the 27B vocabulary); without a GPU the tests here are skipped at
    collection (tests/gpu/conftest.py), so this never runs there."""
    from discrete.sampling import DeviceSampler
    return DeviceSampler(preset("qwen3.5-27b"))


def _device(sampler, bits, temperature, top_k, top_p, u):
    sampler.ws.fill(np.uint64(0xA5A5A5A5A5A5A5A5))  # poison: launch() must zero what the kernel reads
    tok = sampler(cp.asarray(bits), temperature, top_k, top_p, u)
    return tok, sampler.last[0]


@pytest.mark.parametrize("case", CASES, ids=[f"{k}-T{t}-k{kk}-p{p}" for k, t, kk, p in CASES])
def test_device_draw_equals_host_draw(sampler, case):
    kind, temperature, top_k, top_p = case
    rng = np.random.default_rng(seed_of("sample", *map(str, case)))
    V = sampler.V
    boundary = 0
    for trial in range(6):
        bits = _row(rng, kind, V)
        for u in (0.0, float(rng.random()), float(rng.random()), 1 - 2 ** -53):
            want, kept_ref, margin, share = _reference(bits, temperature, top_k, top_p, u)
            got, kept = _device(sampler, bits, temperature, top_k, top_p, u)
            assert got < FIRST_PADDING_ID
            if got != want and not (u == 0.0 and share < FIXED_RES and got > want):
                assert margin < BOUNDARY_REL, (f"trial {trial} u={u!r}: device id {got}, host id {want} "
                                               f"(draw {margin:.3g} of Σp from a boundary, share {share:.3g})")
                boundary += 1
            assert kept == kept_ref, f"trial {trial} u={u!r}: kept {kept} ids, host keeps {kept_ref}"
    assert boundary <= 1


def test_negative_controls_are_caught(sampler):
    """The comparison above detects a shifted draw and a wrong top-p (each must produce a flagged mismatch)."""
    rng = np.random.default_rng(seed_of("sample-neg"))
    bits = _row(rng, "normal", sampler.V)
    caught_u = caught_p = 0
    for _ in range(20):
        u = float(rng.random()) * 0.98
        want, _, margin, _ = _reference(bits, 1.0, 0, 0.9, u)
        got, _ = _device(sampler, bits, 1.0, 0, 0.9, u + 0.01)
        caught_u += got != want and margin >= BOUNDARY_REL
        _, kept_ref, _, _ = _reference(bits, 1.0, 0, 0.9, u)
        _, kept = _device(sampler, bits, 1.0, 0, 0.85, u)
        caught_p += kept != kept_ref
    assert caught_u >= 15 and caught_p == 20


def test_padding_never_drawn(sampler):
    """Padding rows hold the largest logits: they still never win."""
    bits = np.full(sampler.V, 0x3F80, np.uint16)          # 1.0 everywhere
    bits[FIRST_PADDING_ID:] = 0x4480                       # 1024.0 on every padding row
    for u in (0.0, 0.5, 0.999999):
        tok, kept = _device(sampler, bits, 1.0, 0, None, u)
        assert tok < FIRST_PADDING_ID and kept == FIRST_PADDING_ID


def test_bad_arguments(sampler):
    x = cp.zeros(sampler.V, cp.uint16)
    with pytest.raises(ValueError, match="temperature"):
        sampler(x, 0.0, 0, None, 0.5)
    with pytest.raises(ValueError, match="u must be"):
        sampler(x, 1.0, 0, None, 1.0)
    with pytest.raises(ValueError, match="logits"):
        sampler(cp.zeros(sampler.V, cp.float32), 1.0, 0, None, 0.5)


@pytest.mark.parametrize("kind", ["graph", "megakernel"])
def test_engine_samples_on_device_as_on_host(gpu, kind):
    """A seeded sampled generation on a GPU executor: the device draws equal the host's (same logits, same u)."""
    from host.engine import Engine

    eng = Engine.load("tiny", executor=kind, capacity=256, quiet=True)
    kw = dict(max_new_tokens=40, temperature=0.8, top_k=40, top_p=0.9, seed=1234)
    prompt = eng.encode("The sea is")
    assert eng.executor.device_sampling
    on_device = eng.generate(prompt, **kw).result()
    assert eng.executor._sampler is not None and eng.executor._sampler.last[0] > 0  # the device drew
    eng.executor.device_sampling = False
    on_host = eng.generate(prompt, **kw).result()
    assert on_device.ids == on_host.ids
    other = eng.generate(prompt, **{**kw, "seed": 99}).result()  # control: the seed matters
    assert other.ids != on_host.ids
