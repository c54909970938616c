"""Input the API and the CLI refuse cleanly or accept: a closed Session refuses work (it would run on a slot
another session may own), text that is not valid UTF-8 is a clean InvalidArgument / exit 2 (no TokenizerError
traceback; a chat drops that turn only), wrong API argument types are InvalidArgument (not a raw TypeError),
``stop=None`` is accepted (vLLM's default), ``slots`` < 1 is refused at load, ``inspect --sms`` is bounded,
``--version`` exists, ``--raw --no-think`` warns that --no-think does nothing there, and the default capacity
follows a short model context. Scripted executor (tests/helpers.py) and the CLI with its engine loader patched
(milliseconds)."""
from __future__ import annotations

import pytest

from host.engine import Engine
from host.errors import EngineError, InvalidArgument
from tests.helpers import hash_engine, run

BAD = "bad \udcff text"  # what Python makes of the byte 0xFF in argv / stdin (surrogateescape)


def test_closed_session_refuses_work(text_layer):
    eng = hash_engine(text_layer, slots=1)
    s = eng.new_session()
    pending = s.generate([1, 2, 3], max_new_tokens=2)  # made before close(), iterated after
    s.close()
    s.close()  # closing twice is a no-op, as for files
    s2 = eng.new_session()  # the slot is free again
    calls = list(eng.executor.calls)
    with pytest.raises(EngineError, match="session is closed"):
        s.generate([4, 5], max_new_tokens=1)
    with pytest.raises(EngineError, match="session is closed"):
        s.chat([{"role": "user", "content": "hi"}], max_new_tokens=1)
    with pytest.raises(EngineError, match="session is closed"):
        list(pending)
    assert eng.executor.calls == calls  # nothing ran on s2's slot
    r = s2.generate([1, 2, 3], max_new_tokens=2).result()  # control: the open session works
    assert len(r.ids) == 2


def test_invalid_utf8_is_an_invalid_argument(text_layer):
    eng = hash_engine(text_layer)
    with pytest.raises(InvalidArgument, match="prompt: not valid UTF-8"):
        eng.encode(BAD)
    with pytest.raises(InvalidArgument, match="chat: not valid UTF-8"):
        eng.chat([{"role": "user", "content": BAD}])
    with pytest.raises(InvalidArgument, match="expected a str"):
        eng.encode(b"bytes")
    assert eng.encode("good text") == eng.tokenizer.encode("good text")  # control
    assert sorted(eng._free) == [0, 1]  # the one-shot chat gave its slot back


def test_cli_invalid_utf8_exits_2_without_traceback(fake_engine, monkeypatch):
    r = run(["generate", "--max-new-tokens", "1", BAD])
    assert r.exit_code == 2, r.output
    assert "not valid UTF-8" in r.output and "Traceback" not in r.output
    assert not fake_engine  # refused before the model loads
    r = run(["chat", "--max-new-tokens", "1", "--system", BAD])
    assert r.exit_code == 2 and "--system: not valid UTF-8" in r.output
    # in chat a bad line drops that turn only; the next line is answered (lines fed to the prompt directly:
    # CliRunner's stdin cannot carry a lone surrogate)
    import host.commands.chat as chat
    lines = iter([BAD, "hello"])

    def prompt(*a, **k):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    monkeypatch.setattr(chat, "input", prompt, raising=False)  # the chat reads its lines with input()
    r = run(["chat", "--max-new-tokens", "2"])
    assert r.exit_code == 0, r.output
    assert "input: not valid UTF-8" in r.output and "turn dropped" in r.output
    assert "Traceback" not in r.output
    assert len(fake_engine) == 1 and fake_engine[0].executor.calls  # the second line ran


def test_api_argument_types(text_layer):
    with pytest.raises(InvalidArgument, match="path_or_preset: expected"):
        Engine.load(5, executor="cpu")
    for slots in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgument, match="slots: expected a positive integer"):
            Engine.load("tiny", executor="cpu", slots=slots)
    eng = hash_engine(text_layer)
    for bad in (None, 7, "hello"):
        with pytest.raises(InvalidArgument, match="prompt: expected a sequence of integer token ids"):
            eng.generate(bad)
    r = eng.generate([1, 2, 3], max_new_tokens=2, stop=None).result()  # vLLM's default for stop
    assert r.finish_detail == "max_new_tokens"


def test_inspect_sms_is_bounded():
    r = run(["inspect", "--sms", "5000", "--format", "stats"])
    assert r.exit_code == 2 and "1<=x<=1024" in r.output
    r = run(["inspect", "--sms", "7", "--format", "stats", "--layer-limit", "1"])  # control
    assert r.exit_code == 0, r.output


def test_version_and_raw_no_think_warning(fake_engine):
    r = run(["--version"])
    assert r.exit_code == 0 and r.output.startswith("qwen-mk, version ")
    r = run(["generate", "--raw", "--no-think", "--max-new-tokens", "1", "hello"])
    assert r.exit_code == 0, r.output
    assert "--no-think has no effect with --raw" in r.output
    r = run(["generate", "--raw", "--max-new-tokens", "1", "hello"])  # control: no warning without --no-think
    assert r.exit_code == 0 and "--no-think" not in r.output


def test_default_capacity_follows_a_short_model_context(tiny_ckpt, tmp_path):
    """No capacity given: 4096, or the model's context when smaller (vLLM takes its default length from the model),
    so a model with max_position_embeddings 64 loads with the default. An explicit capacity above the context is
    refused (control)."""
    import json
    import shutil
    d = tmp_path / "short"
    shutil.copytree(tiny_ckpt, d)
    cfgp = d / "config.json"
    c = json.loads(cfgp.read_text())
    (c.get("text_config") or c)["max_position_embeddings"] = 64
    cfgp.write_text(json.dumps(c))
    eng = Engine.load(str(d), executor="cpu", quiet=True)
    assert eng.executor.capacity == 64 and eng.new_session().capacity == 64
    with pytest.raises(InvalidArgument, match="capacity: 128 tokens exceeds the model's context of 64"):
        Engine.load(str(d), executor="cpu", capacity=128, quiet=True)
    r = run(["generate", "--model", str(d), "--executor", "cpu", "--max-new-tokens", "1", "--raw", "hi"])
    assert r.exit_code == 0, r.output
