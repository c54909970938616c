"""Capacity, one-shot interrupts and sampling flags: Ctrl-C in a one-shot ``generate`` / ``chat`` says its
one-shot session is closed (not "was rolled back ... and stays usable", which holds for an explicit session;
the wording of one token and of ``result()``: test_sampling_extremes.py); a session follows vLLM's rule, prompt +
generated <= capacity (``--capacity 64`` and a 2-token prompt give 62 tokens), and max_new_tokens' default and
check count the same way; out-of-range ``--temperature`` / ``--top-p`` / ``--top-k`` / ``--seed`` /
``--max-new-tokens`` are click's usage errors, as README's rule says, while the API keeps its own checks.
Scripted executor (tests/helpers.py) and the CLI with its engine loader patched (milliseconds), one real
tiny-model run."""
from __future__ import annotations

import json

import pytest

from host.errors import GenerationInterrupted, InvalidArgument, PromptTooLong
from tests.helpers import HashExecutor, hash_engine, run

HI = [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------------------------------------- Ctrl-C, one-shot
def test_oneshot_interrupt_says_nothing_is_kept(text_layer):
    eng = hash_engine(text_layer, slots=2)
    for start in (lambda: eng.generate([1, 2, 3], max_new_tokens=8, stop_ids=[]),
                  lambda: eng.chat(HI, max_new_tokens=8, stop_ids=[])):
        eng.executor.calls.clear()
        eng.executor.interrupt_at = 2                                  # Ctrl-C in the second step
        with pytest.raises(GenerationInterrupted) as e:
            start().result()
        msg = str(e.value)
        assert msg.startswith("generation interrupted after 2 tokens; its one-shot session is closed"), msg
        assert "rolled back" not in msg and "stays usable" not in msg
        assert sorted(eng._free) == [0, 1]                             # its session is closed: the slot is back
    s = eng.new_session()                                              # control: an explicit session is kept
    eng.executor.calls.clear()
    with pytest.raises(GenerationInterrupted, match=r"after 2 tokens; the session was rolled back to 0 tokens \(its "
                                                    r"last checkpoint; .*\) and stays usable"):
        s.generate([1, 2, 3], max_new_tokens=8, stop_ids=[]).result()
    eng.executor.interrupt_at = None
    want = hash_engine(text_layer).generate([1, 2, 3], max_new_tokens=8, stop_ids=[]).result().ids
    assert s.generate([1, 2, 3], max_new_tokens=8, stop_ids=[]).result().ids == want
    s.close()


def test_cli_generate_interrupt_says_nothing_is_kept(fake_engine, monkeypatch):
    real_step, calls = HashExecutor.step, {"n": 0}

    def ctrl_c(self, token):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step(self, token)
    monkeypatch.setattr(HashExecutor, "step", ctrl_c)
    r = run(["generate", "--max-new-tokens", "8", "hi"])
    assert r.exit_code == GenerationInterrupted.exit_code, r.output
    assert r.stderr == "qwen-mk: error: generation interrupted after 3 tokens; the one-shot session is closed " \
                       "(the text above is all there is)\n", r.stderr
    calls["n"] = 0                                                     # chat keeps its session: says so
    r = run(["chat", "--max-new-tokens", "8", "--no-timings"], input="hi\n/exit\n")
    assert r.exit_code == 0 and "[interrupted: turn dropped, session kept]" in r.stderr, r.output


# ---------------------------------------------------------------------------------------------- capacity, vLLM's rule
def test_prompt_and_reply_fill_at_most_the_capacity(text_layer):
    eng = hash_engine(text_layer, capacity=64)
    r = eng.generate([1, 2], stop_ids=[]).result()                     # the default max_new_tokens: 63
    assert (r.finish_reason, r.finish_detail, len(r.ids)) == ("length", "capacity", 64 - 2)
    r = eng.generate([1, 2], max_new_tokens=62, stop_ids=[]).result()
    assert (r.finish_detail, len(r.ids)) == ("max_new_tokens", 62)
    r = eng.generate(list(range(100, 163)), max_new_tokens=5, stop_ids=[]).result()   # 63 tokens: room for one
    assert (r.finish_detail, len(r.ids)) == ("capacity", 1)
    with pytest.raises(InvalidArgument, match=r"max_new_tokens: 64 exceeds 63, the most the session capacity"):
        eng.generate([1, 2], max_new_tokens=64)
    with pytest.raises(PromptTooLong, match=r"prompt has 64 tokens; .*no room is left for a reply"):
        eng.generate(list(range(100, 164)), max_new_tokens=1)
    with pytest.raises(PromptTooLong) as e:                            # longer still: the message is unchanged
        eng.generate(list(range(100, 165)), max_new_tokens=1)
    assert str(e.value) == ("prompt has 65 tokens; the session holds at most 64 (executor capacity 64, model "
                            "context 262144)")


def test_session_turns_count_their_history(text_layer):
    """A turn's prompt is the whole conversation: prompt (history included) + reply <= capacity, turn after turn."""
    eng = hash_engine(text_layer, capacity=40)
    s = eng.new_session()
    p1 = list(range(100, 110))
    r1 = s.generate(p1, max_new_tokens=20, stop_ids=[]).result()
    p2 = p1 + r1.ids + [7, 8, 9, 10, 11]                              # 35 tokens
    r2 = s.generate(p2, max_new_tokens=20, stop_ids=[]).result()
    assert (r2.finish_detail, len(r2.ids)) == ("capacity", 40 - 35)
    with pytest.raises(PromptTooLong, match="no room is left"):       # the conversation fills the session
        s.generate(p2 + r2.ids, max_new_tokens=1)
    r3 = s.generate(p2 + r2.ids[:4], max_new_tokens=5, stop_ids=[]).result()   # 39: still room for one
    assert (r3.finish_detail, r3.ids) == ("capacity", r2.ids[4:])
    s.close()


def test_cli_capacity_counts_the_prompt(fake_engine):
    r = run(["generate", "--raw", "--json", "--capacity", "64", "hi there"])   # a 2-token prompt
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["timings"]["prompt_tokens"], len(d["ids"]), d["finish_detail"]) == (2, 62, "capacity")
    r = run(["generate", "--raw", "--capacity", "64", "--max-new-tokens", "64", "hi there"])
    assert r.exit_code == InvalidArgument.exit_code and r.stderr.startswith("qwen-mk: error: max_new_tokens: 64 "
                                                                            "exceeds 63"), r.output
    r = run(["generate", "--raw", "--capacity", "2", "hi there"])
    assert r.exit_code == PromptTooLong.exit_code and "no room is left for a reply" in r.stderr, r.output


def test_real_tiny_model_stops_at_the_capacity(tiny_ckpt):
    r = run(["generate", "--model", str(tiny_ckpt), "--executor", "cpu", "--raw", "--json", "--capacity", "4",
             "hi there"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["timings"]["prompt_tokens"], len(d["ids"]), d["finish_detail"]) == (2, 2, "capacity")


# ---------------------------------------------------------------------------------------------- sampling flags
@pytest.mark.parametrize("cmd", ["generate", "chat"])
@pytest.mark.parametrize("args,name", [
    (["--temperature", "-1"], "--temperature"), (["--temperature", "nan"], "--temperature"),
    (["--temperature", "inf"], "--temperature"), (["--top-p", "2"], "--top-p"), (["--top-p", "0"], "--top-p"),
    (["--top-p", "nan"], "--top-p"), (["--top-k", "-1"], "--top-k"), (["--seed", "-1"], "--seed"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_out_of_range_sampling_flags_are_usage_errors(monkeypatch, cmd, args, name):
    import host.commands.chat as chat
    import host.commands.generate as gen
    fail = lambda kw: pytest.fail("the model was loaded")  # noqa: E731
    monkeypatch.setattr(gen, "load_engine", fail)
    monkeypatch.setattr(chat, "load_engine", fail)
    r = run([cmd, *args, *(["hi"] if cmd == "generate" else [])], input="hi\n")
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("Usage: ") and f"Error: Invalid value for '{name}'" in r.stderr, r.stderr
    assert "qwen-mk: error" not in r.stderr


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=2.0),
                                dict(top_k=-1), dict(seed=-1)], ids=str)
def test_api_keeps_its_own_sampling_checks(text_layer, kw):
    with pytest.raises(InvalidArgument):
        hash_engine(text_layer).generate([1, 2], max_new_tokens=2, **kw)
