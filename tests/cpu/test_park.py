"""Parking a session in host memory (``Executor.park`` / ``unpark``, ``Session.park`` / ``unpark``) on the cpu
executors, with the trained small model (cpu) and the tiny synthetic checkpoint (cpu-vm).

A session parked, its slot reused by another conversation, and unparked into a different slot must continue
bit for bit as the same session never parked: the logits of every later step (bf16 bits), the greedy ids of a
later turn, and every state array below the position. Each check has a negative control: a parked KV row or
GDN state value changed by a little gives different logits.
"""
from __future__ import annotations

import numpy as np
import pytest

from host.engine import Engine
from host.errors import EngineError
from loader.config import FIRST_PADDING_ID

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


@pytest.fixture(scope="module")
def eng():
    return Engine.load(capacity=512, slots=2, quiet=True)


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def _steps(ex, first: int, n: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy-decode n tokens on the selected slot from ``first``: (ids, logits bits of every step)."""
    ids, bits, tok = [], [], first
    for _ in range(n):
        out = ex.step(tok)
        bits.append(_bits(out.logits).copy())
        tok = int(np.argmax(np.asarray(out.logits, np.float32)[:FIRST_PADDING_ID]))
        ids.append(tok)
    return ids, bits


def _prefilled(eng, ids: list[int], slot: int):
    ex = eng.executor
    ex.reset(slot)
    pos = 0
    while pos < len(ids):  # 64-aligned pieces, as a session runs them (checkpoint-friendly)
        nxt = min(len(ids), (pos // 64 + 1) * 64)
        out = ex.prefill(ids[pos:nxt])
        pos = nxt
    return int(np.argmax(np.asarray(out.logits, np.float32)[:FIRST_PADDING_ID]))


def test_executor_park_unpark_is_bit_identical_and_a_corrupted_park_is_not(eng):
    ex = eng.executor
    ids = eng.encode(PROMPT * 6)
    assert len(ids) > 64 + 8, "the prompt must cross a chunk anchor"
    tok = _prefilled(eng, ids, 0)
    more, _ = _steps(ex, tok, 5)  # some decode rows past the prefill as well
    parked = ex.park()
    assert parked.position == len(ids) + 5 and parked.nbytes > 0
    ref_ids, ref_bits = _steps(ex, more[-1], 12)  # the same slot, never moved: the reference

    _prefilled(eng, eng.encode("import os\nprint(os.getcwd())\n" * 4), 1)  # slot 1 holds another conversation
    snaps = ex.unpark(parked, 1)  # ... and is reset and reused for the parked one
    assert snaps == [] and ex.position == parked.position
    got_ids, got_bits = _steps(ex, more[-1], 12)
    assert got_ids == ref_ids
    for i, (a, b) in enumerate(zip(got_bits, ref_bits)):
        assert np.array_equal(a, b), f"step {i}: logits differ after unpark"

    for what in ("k", "rec"):  # negative controls: one parked value a little off changes the logits
        ex.unpark(parked, 1)
        p2 = ex.park()  # a second copy of the same state, to corrupt
        arr = next(iter(p2.data[what].values()))
        if what == "k":
            arr[:, 3] *= 1.5  # one KV row (every head) of the first attention layer
        else:
            arr.reshape(-1)[7] += 0.25  # one recurrent-state value of the first GDN layer
        ex.unpark(p2, 0)
        _, bad_bits = _steps(ex, more[-1], 12)
        assert any(not np.array_equal(a, b) for a, b in zip(bad_bits, ref_bits)), f"corrupted {what}: no change"


def test_unparked_state_equals_the_parked_one_below_its_position(eng):
    ex = eng.executor
    s = eng.new_session()  # speculative decoding fills the MTP cache, which parks too
    s.generate(eng.encode(PROMPT * 2), max_new_tokens=8, speculate=2, stop_ids=[]).result()
    s._ex()
    before = ex.model.park(ex._state)
    assert before["mtp_k"] is not None and before["mtp_pos"] > 0
    parked = ex.park()
    other = 1 - s.slot
    s.close()
    _prefilled(eng, eng.encode("poison " * 80), other)
    ex.unpark(parked, other)
    after = ex.model.park(ex._state)
    for key, a in before.items():
        b = after[key]
        if isinstance(a, dict):
            for i in a:
                assert np.array_equal(a[i], b[i], equal_nan=True), f"{key}[{i}] differs"
        elif isinstance(a, np.ndarray):
            assert np.array_equal(a, b, equal_nan=True), f"{key} differs"
        else:
            assert a == b, key


def _convo(eng, turns: int):
    """A chat history of ``turns`` user messages with fixed assistant replies (no generation needed)."""
    msgs = []
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}: what is {i} + {i}?"})
        msgs.append({"role": "assistant", "content": f"{i} + {i} = {2 * i}."})
    return msgs


def test_session_park_unpark_continues_as_a_session_never_parked(eng):
    a = eng.new_session()
    b = eng.new_session()  # both slots taken: a parked session must wait for a free one
    msgs = [{"role": "user", "content": "def fibonacci(n):"}]
    g = a.chat(msgs, max_new_tokens=12, temperature=0, speculate=2)
    first = g.result()
    n_ckpt = len(a.checkpoints)
    parked = a.park()
    assert a.parked is parked and a.slot is None and len(a.checkpoints) == n_ckpt
    with pytest.raises(EngineError, match="parked"):
        a.chat(msgs)
    c = eng.new_session()  # takes the slot a left, and runs in it
    c.chat(_convo(eng, 3), max_new_tokens=4, temperature=0).result()
    b.chat(_convo(eng, 2), max_new_tokens=4, temperature=0).result()
    with pytest.raises(EngineError, match="slots are in use"):
        a.unpark()
    assert a.parked is parked, "a refused unpark leaves the session parked"
    c.close()
    b.close()
    a.unpark()
    follow = msgs + [{"role": "assistant", "content": first.content},
                     {"role": "user", "content": "Now print the first ten."}]
    r = a.chat(follow, max_new_tokens=16, temperature=0, speculate=2).result()
    assert r.timings.reused_tokens > 0, "the follow-up reuses the parked history"
    twin = eng.new_session()  # the same two turns, never parked
    twin.chat(msgs, max_new_tokens=12, temperature=0, speculate=2).result()
    ref = twin.chat(follow, max_new_tokens=16, temperature=0, speculate=2).result()
    assert r.ids == ref.ids and r.timings.reused_tokens == ref.timings.reused_tokens
    assert r.timings.acceptance_counts == ref.timings.acceptance_counts  # the drafts read the parked MTP cache
    a.close()
    twin.close()


def test_cpu_vm_executor_parks_bit_identically(tiny_ckpt):
    eng = Engine.load(str(tiny_ckpt), "cpu-vm", capacity=256, slots=2, quiet=True)
    ex = eng.executor
    ids = list(range(100, 170))  # 70 ids: crosses the first chunk anchor
    tok = _prefilled(eng, ids, 0)
    parked = ex.park()
    ref_ids, ref_bits = _steps(ex, tok, 3)
    _prefilled(eng, list(range(300, 340)), 1)
    ex.unpark(parked, 1)
    got_ids, got_bits = _steps(ex, tok, 3)
    assert got_ids == ref_ids and all(np.array_equal(a, b) for a, b in zip(got_bits, ref_bits))
    next(iter(parked.data["v"].values()))[5] *= 2  # negative control: one V row
    ex.unpark(parked, 0)
    _, bad_bits = _steps(ex, tok, 3)
    assert any(not np.array_equal(a, b) for a, b in zip(bad_bits, ref_bits))
