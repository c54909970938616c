"""Speculation gives way where a generation's output is decided per main-model step: with a grammar in force or
log-probabilities asked for, ``speculate=3`` decodes plainly, says why in ``timings.speculate``, and gives what
``speculate="off"`` gives. Control: the same request without them runs speculative rounds. Trained model, cpu."""
from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def engine():
    from host.engine import Engine
    return Engine.load(executor="cpu", capacity=256, quiet=True)


MSG = [{"role": "user", "content": "Give the answer as a JSON object with a key 'n'."}]


def test_grammar_turns_speculation_off(engine):
    kw = dict(max_new_tokens=24, response_format={"type": "json_object"}, enable_thinking=False)
    spec = engine.chat(MSG, speculate=3, **kw).result()
    off = engine.chat(MSG, speculate="off", **kw).result()
    assert spec.timings.speculate.startswith("off (a grammar constrains the output")
    assert spec.timings.rounds == 0 and spec.ids == off.ids
    if spec.finish_reason == "stop":
        json.loads(spec.content)


def test_logprobs_turn_speculation_off(engine):
    g = engine.chat(MSG, speculate=3, logprobs=2, max_new_tokens=12)
    deltas = list(g)
    res = g.result()
    assert res.timings.speculate.startswith("off (logprobs were asked for")
    assert sum(len(d.logprobs or []) for d in deltas) == sum(len(d.ids) for d in deltas) == len(res.ids) > 0


def test_control_speculates_without_them(engine):
    res = engine.chat(MSG, speculate=3, max_new_tokens=24).result()
    assert res.timings.speculate == "3" and res.timings.rounds > 0
