"""Slots and error output: the 27B preset without a GPU is ExecutorUnavailable (exit 7, not ModelLoadError's 6),
one-shot ``Engine.generate`` / ``chat`` calls hold a slot only while they run (a list of more generations than
slots works), errors follow one output rule (click's usage error, else one ``qwen-mk: error:`` line), an empty
user message under the chat template is a valid prompt (not exit 3), and a session runs one generation at a time.
Scripted executor (tests/helpers.py) and the CLI with its engine loader patched (milliseconds)."""
from __future__ import annotations

import gc
import json

import pytest

from host.engine import Engine
from host.errors import EmptyPrompt, EngineError, ExecutorUnavailable, ModelLoadError
from host.executors import gpu_available
from tests.helpers import HashExecutor, hash_engine, run

no_gpu = pytest.mark.skipif(gpu_available()[0], reason="a GPU is present")


def _one_error_line(r) -> str:
    """The whole stderr of a failed command: exactly one ``qwen-mk: error:`` line; returns its message."""
    assert r.stderr.startswith("qwen-mk: error: ") and r.stderr.count("\n") == 1, repr(r.stderr)
    assert "Traceback" not in r.output
    return r.stderr[len("qwen-mk: error: "):]


# ---------------------------------------------------------------------------------------------- 27B without a GPU
@no_gpu
@pytest.mark.parametrize("cmd", ["generate", "chat"])
@pytest.mark.parametrize("executor", [[], ["--executor", "cpu"]], ids=["default-executor", "cpu-executor"])
def test_27b_preset_without_gpu_exits_7(cmd, executor, tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN_MK_CACHE", str(tmp_path))
    r = run([cmd, "--preset", "qwen3.5-27b", *executor, *(["hi"] if cmd == "generate" else [])], input="hi\n")
    assert r.exit_code == ExecutorUnavailable.exit_code, r.output
    msg = _one_error_line(r)
    assert "GiB of weights per token" in msg and "--preset tiny" in msg
    assert ("needs a GPU executor" in msg and "no GPU is usable here" in msg) if not executor \
        else "Use --executor graph or megakernel on a GPU" in msg
    assert not list(tmp_path.iterdir())  # refused before writing any checkpoint or metadata
    r = run([cmd, "--model", str(tmp_path / "absent"), *executor], input="hi\n")  # control: unloadable stays 6
    assert r.exit_code == ModelLoadError.exit_code and "not a directory" in _one_error_line(r)


@no_gpu
def test_27b_preset_without_gpu_is_executor_unavailable_in_the_api(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN_MK_CACHE", str(tmp_path))
    for kind in (None, "cpu"):
        with pytest.raises(ExecutorUnavailable, match="GiB of weights per token"):
            Engine.load("qwen3.5-27b", kind, quiet=True)
    with pytest.raises(ModelLoadError, match="not a directory and not a preset"):  # control
        Engine.load(str(tmp_path / "absent"), "cpu")


# ---------------------------------------------------------------------------------------------- one-shot slots
def test_oneshot_generations_do_not_exhaust_the_slots(text_layer):
    eng = hash_engine(text_layer, slots=2)
    prompts = [[1, 2, 3 + i] for i in range(5)]
    gens = [eng.generate(p, max_new_tokens=3, stop_ids=[]) for p in prompts]   # more than the slots
    gens.append(eng.chat([{"role": "user", "content": "hi"}], max_new_tokens=3))
    assert sorted(eng._free) == [0, 1]                                          # nothing taken before they run
    texts = [g.text for g in gens]
    alone = [hash_engine(text_layer).generate(p, max_new_tokens=3, stop_ids=[]).result() for p in prompts]
    assert texts[:5] == [r.text for r in alone] and [g.result().ids for g in gens[:5]] == [r.ids for r in alone]
    assert sorted(eng._free) == [0, 1]
    # streaming: the slot is taken from the first delta and given back with the last (before StopIteration)
    g = eng.generate([1, 2, 3], max_new_tokens=3, stop_ids=[])
    deltas = [next(g)]
    assert len(eng._free) == 1
    deltas += [next(g), next(g)]
    assert deltas[-1].finish_reason == "length" and sorted(eng._free) == [0, 1]
    assert [i for d in deltas for i in d.ids] == g.result().ids == alone[0].ids
    # dropped mid-stream: the slot comes back at once, with the cyclic garbage collector off
    gc.disable()
    try:
        g = eng.generate([1, 2, 3], max_new_tokens=5)
        next(g)
        assert len(eng._free) == 1
        del g
        assert sorted(eng._free) == [0, 1]
    finally:
        gc.enable()
    # more one-shot streams at the same time than slots: the extra one fails when it starts, the others go on
    a, b, c = (eng.generate([1, 2, 3], max_new_tokens=2, stop_ids=[]) for _ in range(3))
    next(a), next(b)
    with pytest.raises(EngineError, match="all 2 session slots are in use"):
        next(c)
    assert a.result().ids == b.result().ids == alone[0].ids[:2] and sorted(eng._free) == [0, 1]
    assert c.result().ids == alone[0].ids[:2] and sorted(eng._free) == [0, 1]   # refused at start: retried later
    # explicit sessions are unchanged: each holds its slot until close()
    s1, s2 = eng.new_session(), eng.new_session()
    with pytest.raises(EngineError, match="slots are in use"):
        eng.new_session()
    with pytest.raises(EngineError, match="slots are in use"):
        eng.generate([1, 2, 3], max_new_tokens=1).result()
    s1.close()
    assert eng.generate([1, 2, 3], max_new_tokens=1).result().ids == alone[0].ids[:1]
    s2.close()


# ---------------------------------------------------------------------------------------------- error output
def test_error_output_follows_one_rule(fake_engine, monkeypatch):
    r = run(["generate", "--bogus", "hi"])                                     # usage error: click's own output
    assert r.exit_code == 2 and r.stderr.startswith("Usage: ") and "Error: No such option '--bogus'" in r.stderr
    assert "qwen-mk: error" not in r.stderr
    r = run(["generate", "--raw", ""])                                         # engine error: one line
    assert r.exit_code == EmptyPrompt.exit_code and "the prompt is empty" in _one_error_line(r)
    if not gpu_available()[0]:                                                 # a command's ClickException too
        r = run(["inspect", "--timings"])
        assert r.exit_code == ExecutorUnavailable.exit_code and "needs an NVIDIA GPU" in _one_error_line(r)
    calls = {"n": 0}
    real_step = HashExecutor.step

    def failing(self, token):                                                  # an error in the middle of a reply
        calls["n"] += 1
        if calls["n"] == 3:
            raise EngineError("device fault")
        return real_step(self, token)
    monkeypatch.setattr(HashExecutor, "step", failing)
    r = run(["generate", "--max-new-tokens", "8", "hi"])
    assert r.exit_code == 1 and _one_error_line(r) == "device fault\n"
    assert r.stdout and r.stdout.endswith("\n")                                # the cut reply line was ended


# ---------------------------------------------------------------------------------------------- empty message
def test_empty_chat_message_is_a_prompt(fake_engine, text_layer):
    r = run(["generate", "--json", "--max-new-tokens", "2", ""])
    assert r.exit_code == 0, r.output
    tk, tmpl = text_layer
    want = len(tk.encode(tmpl.render([{"role": "user", "content": ""}], add_generation_prompt=True)))
    assert json.loads(r.stdout)["timings"]["prompt_tokens"] == want > 0
    r = run(["generate", "--max-new-tokens", "2"], input="")                   # empty stdin: the same message
    assert r.exit_code == 0 and "finish length" in r.stderr, r.output
    for raw in ("", "  \n"):                                                   # no template: nothing to run
        r = run(["generate", "--raw", raw])
        assert r.exit_code == EmptyPrompt.exit_code and "empty" in _one_error_line(r)
    eng = hash_engine(text_layer)
    assert len(eng.chat([{"role": "user", "content": ""}], max_new_tokens=2).result().ids) == 2
    assert eng.chat([{"role": "user", "content": ""}]).result().prompt_ids   # the API agrees
    with pytest.raises(EmptyPrompt):
        eng.generate([])
    with pytest.raises(EmptyPrompt):
        eng.chat([])


# ---------------------------------------------------------------------------------------------- one session, two turns
def test_second_generation_of_a_session_waits_for_the_first(text_layer):
    """Two Generations made on one session before either ran must not both pass the "already generating" check
    (looking only at a running one would let them, stepped in turn, silently produce wrong tokens from the shared
    slot): the second call raises until the first has finished, been closed or been dropped."""
    eng = hash_engine(text_layer, slots=2)
    alone = hash_engine(text_layer).generate([1, 2, 3], max_new_tokens=3, stop_ids=[]).result().ids
    s = eng.new_session()
    g1 = s.generate([1, 2, 3], max_new_tokens=3, stop_ids=[])
    with pytest.raises(EngineError, match="already generating"):
        s.generate([4, 5, 6], max_new_tokens=3, stop_ids=[])          # g1 made, not started
    next(g1)
    with pytest.raises(EngineError, match="already generating"):
        s.generate([4, 5, 6], max_new_tokens=3, stop_ids=[])          # g1 running
    assert g1.result().ids == alone
    ids = list(s.ids)
    g2 = s.generate(ids + [7], max_new_tokens=2, stop_ids=[])           # g1 finished: the next turn may start
    g2.close()                                                           # closed before it started
    g3 = s.generate(ids + [7], max_new_tokens=2, stop_ids=[])
    del g3                                                               # dropped before it started
    assert len(s.generate(ids + [7], max_new_tokens=2, stop_ids=[]).result().ids) == 2
    s.close()
