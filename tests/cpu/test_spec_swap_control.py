"""The MTP draft's wiring on the trained model, end to end through speculative decoding (``host.cpu_mtp``): with
the fc input as trained ([norm(embed(t+1)), norm(h_t)]) the drafts are accepted often; with the two halves swapped
(the negative control) almost never. Also: the pruned draft head costs little acceptance, and an executor without
an MTP draft (the GPU ones) decodes plainly and says why."""
from __future__ import annotations

import pytest

from host.speculate import Speculator

CODE = '''def lcm(a, b):
    """Return the least common multiple of a and b."""
    return a * b // gcd(a, b)


def gcd(a, b):
'''


@pytest.fixture(scope="module")
def engine():
    from host.engine import Engine
    return Engine.load(executor="cpu", capacity=160, slots=1, quiet=True)


def _acceptance(engine, sp) -> float:
    engine._speculator = sp
    try:
        r = engine.generate(engine.encode(CODE), max_new_tokens=48, speculate=1).result()
    finally:
        engine._speculator = None
    return r.timings.acceptance[0]


def test_swapped_mtp_halves_accept_almost_nothing(engine):
    ex = engine.executor
    right = _acceptance(engine, Speculator(ex))
    swapped = _acceptance(engine, Speculator(ex, swap=True))
    assert right >= 0.6, right                                  # measured 0.84 (2-core machine)
    assert swapped <= 0.25 and right - swapped >= 0.5, swapped   # measured 0.12


def test_pruned_head_costs_little_acceptance(engine):
    """The pruned draft head (static core + session ids) against the full head on the same text."""
    ex = engine.executor
    full = _acceptance(engine, Speculator(ex, core_size=None))
    pruned = _acceptance(engine, Speculator(ex))
    assert pruned >= full - 0.1, (pruned, full)


def test_executor_without_draft_falls_back_to_plain_decode(text_layer):
    from host.engine import Engine
    from loader.config import PRESETS
    from tests.helpers import HashExecutor
    tok, tmpl = text_layer
    eng = Engine(PRESETS["tiny"], None, None, tok, tmpl, HashExecutor(capacity=64))
    a = eng.generate([5, 6, 7], max_new_tokens=6, speculate="off").result()
    b = eng.generate([5, 6, 7], max_new_tokens=6, speculate=3).result()
    assert a.ids == b.ids and b.timings.rounds == 0
    assert b.timings.speculate.startswith("off (the hash executor has no MTP draft") and "plain decode" in b.timings.speculate
