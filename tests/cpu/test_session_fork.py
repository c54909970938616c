"""``Session.fork()`` (trained model, cpu executor): a fork continues exactly as a session that never forked, and so
does the session it came from.

* Both have the parent's ids; each turn after the fork equals a fresh session's over the same history and new ids
  (its ids and the bits of the last logits row); the fork runs only what is appended (``prefilled_tokens``).
* One slot: the fork starts parked and cannot run until it is unparked into a slot the parent gave back.
* Errors: forking a closed or a parked session raises EngineError.
* Negative control: a fork whose recurrent state (and its anchor's) is zeroed behind its back (position and ids
  kept) no longer matches.
"""
from __future__ import annotations

import numpy as np
import pytest

from host.engine import Engine
from host.errors import EngineError

PROMPT = ("import argparse\nimport os\nimport sys\n\n\ndef read_config(path):\n    with open(path) as f:\n"
          "        return [line.strip() for line in f if line.strip()]\n\n\ndef write_report(rows, out):\n"
          "    for row in rows:\n        out.write(str(row) + '\\n')\n\n\ndef parse_args(argv):\n"
          "    \"\"\"Parse the command line and")
TAILS = ("\n    parser = argparse.ArgumentParser(", "\n    return {")


@pytest.fixture(scope="module")
def eng():
    return Engine.load(None, "cpu", slots=3, quiet=True)


def _turn(s, ids: list[int], ran: list | None = None) -> tuple[list[int], bytes]:
    """(the ids a 10-token greedy turn generates, the bits of the last processed token's logits); the tokens the
    turn prefilled are appended to ``ran``."""
    r = s.generate(ids, max_new_tokens=10).result()
    if ran is not None:
        ran.append(r.timings.prefilled_tokens)
    return r.ids, np.asarray(s._last.logits).view(np.uint16).tobytes()


def _fresh(eng, history: list[int], tail: list[int]) -> tuple[list[int], bytes]:
    s = eng.new_session()
    try:
        s.generate(history, max_new_tokens=1).result()
        return _turn(s, history + tail)
    finally:
        s.close()


def test_fork_and_parent_continue_as_if_never_forked(eng):
    tok = eng.tokenizer
    p = eng.new_session()
    child = None
    try:
        prompt = tok.encode(PROMPT)
        assert len(prompt) > 64  # a prefill past the cpu executor's first 64-row anchor: appends reuse state
        r1 = p.generate(prompt, max_new_tokens=16, stop_ids=[]).result()
        history = list(p.ids)
        assert r1.ids
        a, b = (tok.encode(t) for t in TAILS)
        want_b = _fresh(eng, history, b)
        # negative control: a fork whose recurrent state (and its anchor's) is zeroed behind its back, position
        # and ids kept, no longer gives the fresh session's bits
        bad = p.fork()
        try:
            st = eng.executor._states[bad.slot]
            for d in (st.rec, st.ck_rec):
                for x in d.values():
                    x[...] = 0
            assert _turn(bad, history + b) != want_b
        finally:
            bad.close()
        child = p.fork()
        assert child.slot is not None and child.slot != p.slot and child.ids == history
        ran: list[int] = []
        got_p, got_c = _turn(p, history + a, ran), _turn(child, history + b, ran)
        assert ran == [len(a), len(b)]  # only the appended ids ran: the state came along
        assert got_c == want_b          # ids and the logits' bits
        child.close()
        child = None
        assert got_p == _fresh(eng, history, a)
    finally:
        p.close()
        if child is not None:
            child.close()


def test_fork_without_a_free_slot_starts_parked():
    eng = Engine.load(None, "cpu", slots=1, quiet=True)
    tok = eng.tokenizer
    p = eng.new_session()
    p.generate(tok.encode(PROMPT), max_new_tokens=16, stop_ids=[]).result()
    history = list(p.ids)
    child = p.fork()
    assert child.slot is None and child.parked is not None
    with pytest.raises(EngineError, match="parked"):
        child.generate(history, max_new_tokens=2).result()
    with pytest.raises(EngineError, match="parked"):
        child.fork()
    p.park()
    child.unpark()
    tail = tok.encode(TAILS[0])
    got = child.generate(history + tail, max_new_tokens=10).result()
    assert got.timings.prefilled_tokens == len(tail)
    child.close()
    p.unpark()
    assert p.generate(history + tail, max_new_tokens=10).result().ids == got.ids
    p.close()
    with pytest.raises(EngineError, match="closed"):
        p.fork()
