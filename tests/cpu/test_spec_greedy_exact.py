"""Speculative greedy decoding ≡ plain greedy decoding on the cpu executor (``host.speculate``, docs/speculation.md).

Every accept count 0..k is forced by a draft-corrupting hook (drafts replaced by the plain continuation up to j
tokens, then a wrong id), so the exact rollback (replay ring, KV cursor) runs whatever the MTP head proposes; after
every round the speculating slot's state (GDN recurrent, conv, full-attention K/V arrays including the NaN past the
position, position) and its verify logits equal, bit for bit, a slot that decoded the same tokens one at a time.
The rounds cross position 64 (a GDN chunk / checkpoint boundary). Then end to end: ``speculate=K`` and ``auto``
give the ids of ``speculate="off"``, with stop ids, stop strings and max tokens landing inside accepted runs, and a
session keeps the same state and ids across two turns. The trained model (``Engine.load()``'s default).
"""
from __future__ import annotations

import numpy as np
import pytest

from host.sampling import Sampler, SamplingParams

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the arguments and run the command.\"\"\"\n"


@pytest.fixture(scope="module")
def engine():
    from host.engine import Engine
    return Engine.load(executor="cpu", capacity=320, slots=3, quiet=True)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def assert_same_state(a, b, where: str) -> None:
    assert a.pos == b.pos, f"{where}: position {a.pos} != {b.pos}"
    for name in ("rec", "conv", "k", "v"):
        da, db = getattr(a, name), getattr(b, name)
        for i in da:
            ok = np.array_equal(_bits(da[i]), _bits(db[i]))
            assert ok, f"{where}: {name}[layer {i}] differs at {np.argwhere(_bits(da[i]) != _bits(db[i]))[:3].tolist()}"


def _plain(ex, slot: int, prompt: list[int], n: int) -> list[int]:
    ex.reset(slot)
    out = ex.prefill(prompt)
    g = Sampler(SamplingParams())
    toks = [g(out.logits)]
    for _ in range(n - 1):
        toks.append(g(ex.step(toks[-1]).logits))
    return toks


@pytest.mark.parametrize("k", [3, 7])
def test_every_accept_count_leaves_the_plain_state(engine, k):
    from host.speculate import Speculator
    ex = engine.executor
    prompt = engine.encode(PROMPT)
    assert len(prompt) < 64                                     # the rounds cross position 64
    g = _plain(ex, 2, prompt, 96)
    greedy = Sampler(SamplingParams())
    for slot in (0, 1):
        ex.reset(slot)
        ex.prefill(prompt)
    sp = Speculator(ex)
    ex.select(1)
    sp.begin()
    i, r, crossed = 0, 0, False
    while i + k + 2 < len(g):
        j = r % (k + 1)                                          # forced accept count of this round
        want = g[i + 1:i + 1 + j] + [(t + 1) % 240000 for t in g[i + 1 + j:i + 1 + k]]
        sp.corrupt = lambda d, want=want: (want if len(d) == k else pytest.fail("draft count"))
        ex.select(1)
        before = ex._states[1].pos
        emitted, logits, a = sp.round(g[i], k, greedy)
        assert a == j and emitted == g[i + 1:i + 2 + j], (r, j, a, emitted)
        sp.commit(a + 1, emitted)
        ex.select(0)
        for row, t in enumerate([g[i]] + emitted[:-1]):          # the same tokens, one step each
            lg = ex.step(t).logits
            assert np.array_equal(lg.view(np.uint16), logits[row].view(np.uint16)), (r, row)
        assert_same_state(ex._states[0], ex._states[1], f"round {r} (k {k}, accepted {a})")
        crossed |= before <= 64 <= before + k                    # this verify pass spans position 64
        i += a + 1
        r += 1
    assert r >= 2 * (k + 1) and crossed


def test_forced_rejection_is_not_vacuous(engine):
    """The negative control of the state check: a round kept whole (no rollback) differs from the plain state."""
    from host.speculate import Speculator
    ex = engine.executor
    prompt = engine.encode(PROMPT)
    g = _plain(ex, 2, prompt, 8)
    for slot in (0, 1):
        ex.reset(slot)
        ex.prefill(prompt)
    sp = Speculator(ex)
    ex.select(1)
    sp.begin()
    sp.corrupt = lambda d: [(t + 1) % 240000 for t in g[1:4]]
    emitted, _, a = sp.round(g[0], 3, Sampler(SamplingParams()))
    assert a == 0 and emitted == g[1:2]
    sp.commit(4, emitted)                                        # wrong: keeps the 3 rejected rows
    ex.select(0)
    ex.step(g[0])
    with pytest.raises(AssertionError):
        assert_same_state(ex._states[0], ex._states[1], "kept rejected rows")


@pytest.fixture(scope="module")
def plain_runs(engine):
    """Plain greedy results: (prompt, the 32-token run, a stop id inside it, a stop string inside it, runs with them)."""
    prompt = engine.encode(PROMPT)
    base = engine.generate(prompt, max_new_tokens=32, speculate="off").result()
    sid = base.ids[len(base.ids) // 2]
    stop = base.text[len(base.text) // 3:len(base.text) // 3 + 3]
    by_id = engine.generate(prompt, max_new_tokens=32, stop_ids=[sid], speculate="off").result()
    by_text = engine.generate(prompt, max_new_tokens=32, stop=[stop], speculate="off").result()
    return prompt, base, sid, stop, by_id, by_text


@pytest.mark.parametrize("spec", [3, "auto"])
def test_generate_matches_plain_with_stops_inside_runs(engine, plain_runs, spec):
    prompt, base, sid, stop, by_id, by_text = plain_runs
    r = engine.generate(prompt, max_new_tokens=32, speculate=spec).result()
    assert r.ids == base.ids and r.text == base.text
    assert r.timings.rounds > 0 and r.timings.tokens_per_round > 1 and r.timings.speculate == str(spec)
    for n in (1, 2, 13):                                        # max tokens: ends inside a round's run
        a = engine.generate(prompt, max_new_tokens=n, speculate=spec).result()
        assert a.ids == base.ids[:n] and a.finish_detail == "max_new_tokens"
    a = engine.generate(prompt, max_new_tokens=32, stop_ids=[sid], speculate=spec).result()
    assert a.ids == by_id.ids and a.ids[-1] == sid and a.finish_detail == "stop_token"
    a = engine.generate(prompt, max_new_tokens=32, stop=[stop], speculate=spec).result()
    assert (a.ids, a.text, a.finish_detail) == (by_text.ids, by_text.text, "stop_string")


def test_session_turns_keep_the_plain_state(engine):
    prompt = engine.encode(PROMPT)
    s0, s1 = engine.new_session(), engine.new_session()
    try:
        for turn in range(2):
            r0 = s0.generate(prompt, max_new_tokens=21, speculate="off").result()
            r1 = s1.generate(prompt, max_new_tokens=21, speculate=4).result()
            assert r0.ids == r1.ids and s0.ids == s1.ids
            ex = engine.executor
            assert_same_state(ex._states[s0.slot], ex._states[s1.slot], f"turn {turn}")
            prompt = s0.ids + r0.ids + engine.encode("\n\ndef helper(x):\n")
    finally:
        s0.close()
        s1.close()


def test_speculate_argument_is_checked(engine):
    from host.errors import InvalidArgument
    for bad in (8, -1, "fast", 2.5, True):
        with pytest.raises(InvalidArgument, match="speculate"):
            engine.generate([1, 2, 3], speculate=bad)
