"""``host.speculate.KChooser``: k minimises measured ms per emitted token (round cost / expected tokens per round
from the running acceptance per position), k = 0 when rounds cost more than they emit, and exploration visits
unmeasured k."""
from __future__ import annotations

import numpy as np

from host.speculate import EXPLORE_EVERY, MAX_K, KChooser


def _feed(ch: KChooser, step_ms: float, per_row_ms: float, alpha: float, rounds: int = 60, seed: int = 0):
    rng = np.random.default_rng(seed)
    for r in range(rounds):
        k = r % (MAX_K + 1)
        a = 0
        while a < k and rng.random() < alpha:
            a += 1
        verify = step_ms + per_row_ms * k
        ch.observe(k, a, verify, 0.5 * k, verify + 0.5 * k + 0.2)


def test_cheap_verify_and_good_drafts_pick_a_long_k():
    ch = KChooser()
    _feed(ch, step_ms=10.0, per_row_ms=0.5, alpha=0.9)
    tokens, ms = ch.expected()
    assert ch.choose(MAX_K) >= 4 and ms[ch.choose(MAX_K)] < ms[0] and tokens[7] > 4
    assert ch.choose(2) <= 2 and ch.choose(0) == 0


def test_expensive_verify_picks_plain_decode():
    ch = KChooser()
    _feed(ch, step_ms=10.0, per_row_ms=12.0, alpha=0.7)         # a row costs more than a step: never pays
    assert ch.rounds % EXPLORE_EVERY != EXPLORE_EVERY - 1
    assert ch.choose(MAX_K) == 0


def test_exploration_measures_unmeasured_k():
    ch = KChooser()
    seen = set()
    for r in range(EXPLORE_EVERY * (MAX_K + 2)):
        k = ch.choose(MAX_K)
        seen.add(k)
        ch.observe(k, 0, 10.0 + k, 0.5 * k, 11.0 + 1.5 * k)
    assert seen >= set(range(MAX_K + 1)) and not np.isnan(ch.round_ms).any()
