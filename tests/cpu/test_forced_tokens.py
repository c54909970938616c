"""Forced tokens under a grammar (``host/session.py``, ``Executor.step_rows``): while the grammar admits exactly one
id next, the session emits it at once and runs it with the pending token as rows of one decode pass.

* The rows of ``step_rows`` carry the bits of one-row steps (cpu executor, tiny synthetic weights): the last row's
  logits and the following step's equal a slot that stepped the same ids one at a time.
* Trained model, tool-call grammar (``tool_choice="required"``), greedy and sampled (seeded): forcing on gives the
  ids, text, tool calls and finish reason of forcing off, with fewer model passes; the sampled run spends a draw
  per forced token, so the seed replays the same reply. A second, unconstrained turn of the same session equals
  the one after a forcing-off first turn (the state the forced rows left is plain decoding's).
* Negative control: with forcing off (``engine.jump_forward = False``) no token is counted as forced.
"""
from __future__ import annotations

import numpy as np
import pytest

from host.engine import Engine
from tools.train.conversations import ALL_TOOLS

SYSTEM = "You are a concise assistant that uses tools when they help."
QUESTION = "What is the weather like in Lisbon today?"


@pytest.fixture(scope="module")
def trained():
    return Engine.load(None, "cpu", quiet=True)


def test_step_rows_has_the_bits_of_one_row_steps():
    eng = Engine.load("tiny", "cpu", capacity=64, slots=2, quiet=True)
    ex = eng.executor
    ids = [int(t) for t in np.random.default_rng(2).integers(0, 240000, 12)]
    outs = {}
    for slot, rows in ((0, True), (1, False)):
        ex.reset(slot)
        ex.prefill(ids[:6])
        if rows:
            last = ex.step_rows(ids[6:11])
        else:
            for t in ids[6:11]:
                last = ex.step(t)
        nxt = ex.step(ids[11])
        outs[rows] = (np.asarray(last.logits).view(np.uint16).copy(), np.asarray(nxt.logits).view(np.uint16).copy())
    assert np.array_equal(outs[True][0], outs[False][0]) and np.array_equal(outs[True][1], outs[False][1])


def _turns(eng, jump_forward: bool, temperature: float):
    eng.jump_forward = jump_forward
    s = eng.new_session()
    try:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        r1 = s.chat(msgs, tools=ALL_TOOLS, tool_choice="required", max_new_tokens=96, temperature=temperature,
                    seed=3).result()
        r2 = s.generate(list(r1.prompt_ids) + list(r1.ids) + eng.tokenizer.encode("\nThe answer is"),
                        max_new_tokens=12).result()
        return r1, r2
    finally:
        s.close()
        eng.jump_forward = True


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_tokens_change_nothing_but_the_passes(trained, temperature):
    on1, on2 = _turns(trained, True, temperature)
    off1, off2 = _turns(trained, False, temperature)
    calls = [[c["function"] for c in r.tool_calls] for r in (on1, off1)]  # (call ids are random)
    assert (on1.ids, on1.text, on1.finish_reason) == (off1.ids, off1.text, off1.finish_reason)
    assert calls[0] == calls[1]
    assert on1.tool_calls, "the grammar's reply holds a call"
    assert on1.timings.forced_tokens > 0 and off1.timings.forced_tokens == 0  # negative control: off counts none
    assert on1.timings.steps < off1.timings.steps
    assert on2.ids == off2.ids and on2.timings.forced_tokens == 0  # no grammar: nothing forced
