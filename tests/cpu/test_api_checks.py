"""The Python API checks generation arguments as the CLI does, through one shared function
(``host.sampling.check_generation_args``): max_new_tokens not below the session capacity or the model's context
(a prompt takes at least one token) is an InvalidArgument before any work (vLLM raises on a request that cannot fit, too), and top_k / top_p / seed under
greedy decoding raise an IgnoredArgumentWarning (the CLI prints the same warning as a stderr line, once).
finish_detail ``capacity`` stays reachable where the prompt (a session's earlier turns) leaves too little room.
Runs on the scripted executor (tests/helpers.py) and the CLI with its engine loader patched (milliseconds)."""
from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import pytest

import host.errors as errors
from host.engine import Engine
from host.errors import InvalidArgument
from tests.helpers import HashExecutor, hash_engine, run
from loader.config import PRESETS

HAIKU = [{"role": "user", "content": "Write a haiku about the sea"}]


# ---------------------------------------------------------------------------------------------- max_new_tokens
def test_api_refuses_max_new_tokens_above_capacity(text_layer):
    """Engine.generate / Engine.chat / Session.generate raise InvalidArgument naming the value and the capacity,
    before the executor runs anything; max_new_tokens == capacity - 1 is allowed (as the CLI's rule)."""
    eng = hash_engine(text_layer, capacity=20)
    s = eng.new_session()
    calls = list(eng.executor.calls)
    for start in (lambda: eng.generate([1, 2, 3], max_new_tokens=20), lambda: eng.chat(HAIKU, max_new_tokens=20),
                  lambda: s.generate([1, 2, 3], max_new_tokens=20)):
        with pytest.raises(InvalidArgument, match=r"max_new_tokens: 20 exceeds 19, the most the session capacity "
                                                  r"of 20 tokens leaves"):
            start()
    assert eng.executor.calls == calls                                # refused before any prefill or step
    assert eng._free == [1]                                           # the one-shot calls gave their slot back
    r = s.generate([1, 2, 3], max_new_tokens=19, stop_ids=[]).result()  # control: capacity - 1 is fine
    assert (r.finish_reason, r.finish_detail) == ("length", "capacity")
    s.close()


def test_api_refuses_max_new_tokens_above_model_context(text_layer):
    """A model context below the executor capacity bounds max_new_tokens too, and the message names the context."""
    tok, tmpl = text_layer
    cfg = dataclasses.replace(PRESETS["tiny"], max_position_embeddings=16)
    eng = Engine(cfg, None, None, tok, tmpl, HashExecutor(capacity=64))
    with pytest.raises(InvalidArgument, match=r"max_new_tokens: 16 exceeds 15, the most the model's context of 16 "):
        eng.generate([1, 2], max_new_tokens=16)
    assert eng.executor.calls == []
    assert len(eng.generate([1, 2], max_new_tokens=15, stop_ids=[]).result().ids) == 16 - 2


def test_api_default_max_new_tokens_fits_the_capacity(text_layer):
    """No max_new_tokens: 256, lowered to a smaller capacity - 1 (the CLI's default), so a small capacity is no
    error."""
    from host.sampling import DEFAULT_MAX_NEW_TOKENS, SamplingParams, check_generation_args
    from host.commands import generate as gen
    assert gen.DEFAULT_MAX_NEW_TOKENS == DEFAULT_MAX_NEW_TOKENS == 256  # the CLI's help text names the same one
    p = SamplingParams()
    assert check_generation_args(p, None, 4096, 262144) == 256 and check_generation_args(p, None, 20, 262144) == 19
    r = hash_engine(text_layer, capacity=20).generate([1, 2], stop_ids=[]).result()
    assert (r.finish_detail, len(r.ids)) == ("capacity", 20 - 2)
    r = hash_engine(text_layer, capacity=300).generate([1, 2], stop_ids=[]).result()
    assert (r.finish_detail, len(r.ids)) == ("max_new_tokens", 256)


@pytest.mark.parametrize("capacity,n", [(8, 1), (8, 7), (8, 8), (8, 9), (8, 300), (300, 256), (300, 301)])
def test_cli_and_api_agree_on_max_new_tokens(fake_engine, text_layer, capacity, n):
    """Same (capacity, max_new_tokens): the CLI exits with InvalidArgument's code exactly when the API raises it."""
    r = run(["generate", "--raw", "--capacity", str(capacity), "--max-new-tokens", str(n), "hi"])
    eng = hash_engine(text_layer, capacity=capacity)
    try:
        eng.generate([1, 2], max_new_tokens=n).close()
        api_refused = False
    except InvalidArgument:
        api_refused = True
    assert api_refused == (n >= capacity)
    assert (r.exit_code == InvalidArgument.exit_code) == api_refused, r.output
    if not api_refused:
        assert r.exit_code == 0, r.output


def test_cli_and_api_call_the_same_check(monkeypatch, fake_engine):
    """One function, used by both: the session's name is host.sampling's, and the CLI calls it before loading."""
    import host.sampling
    import host.session
    assert host.session.check_generation_args is host.sampling.check_generation_args
    seen = []
    real = host.sampling.check_generation_args

    def spy(*a, **kw):
        seen.append(kw.get("cli", False))
        return real(*a, **kw)
    monkeypatch.setattr(host.sampling, "check_generation_args", spy)
    monkeypatch.setattr(host.session, "check_generation_args", spy)
    r = run(["generate", "--max-new-tokens", "2", "hi"])
    assert r.exit_code == 0, r.output
    assert seen == [True, False]                                      # the CLI's check, then Session.generate's


def test_capacity_finish_still_reached_when_earlier_turns_fill_the_session(text_layer):
    """max_new_tokens < capacity is checked up front; the room the prompt leaves is not (the prompt of a session
    turn is the whole conversation), so a later turn can still end with finish_detail capacity."""
    eng = hash_engine(text_layer, capacity=40)
    s = eng.new_session()
    p1 = list(range(100, 110))
    r1 = s.generate(p1, max_new_tokens=20, stop_ids=[]).result()
    assert (r1.finish_detail, len(r1.ids)) == ("max_new_tokens", 20)
    p2 = p1 + r1.ids + [7, 8, 9, 10, 11]                              # 35 tokens: 6 left of the 40
    r2 = s.generate(p2, max_new_tokens=20, stop_ids=[]).result()
    assert (r2.finish_reason, r2.finish_detail, len(r2.ids)) == ("length", "capacity", 40 - 35)
    s.close()


# ---------------------------------------------------------------------------------------------- greedy warnings
@pytest.mark.parametrize("kw,names", [(dict(top_k=5), ("top_k",)), (dict(top_p=0.5), ("top_p",)),
                                      (dict(seed=3), ("seed",)),
                                      (dict(top_k=5, top_p=0.5, seed=3), ("top_k", "top_p", "seed"))], ids=str)
def test_api_warns_on_sampling_args_under_greedy(text_layer, kw, names):
    eng = hash_engine(text_layer)
    for call in (lambda: eng.generate([1, 2], max_new_tokens=2, **kw), lambda: eng.chat(HAIKU, max_new_tokens=2, **kw)):
        with pytest.warns(UserWarning, match=r"no effect under greedy decoding \(temperature 0\)") as rec:
            g = call()
        g.result()
        assert len(rec) == 1 and rec[0].category is errors.IgnoredArgumentWarning, [str(w.message) for w in rec]
        assert rec[0].message.names == names and all(n in str(rec[0].message) for n in names)
        assert rec[0].filename == __file__                           # attributed to the caller, not host/
    s = eng.new_session()
    with pytest.warns(errors.IgnoredArgumentWarning):
        s.generate([1, 2], max_new_tokens=2, **kw).result()
    s.close()


@pytest.mark.parametrize("kw", [dict(temperature=0.7, top_k=5, top_p=0.5, seed=3),   # sampling uses them
                                dict(top_k=0, top_p=1.0), dict()], ids=str)           # "off" values change nothing
def test_api_no_warning_when_nothing_is_ignored(text_layer, kw):
    eng = hash_engine(text_layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eng.generate([1, 2], max_new_tokens=2, **kw).result()


def test_cli_warns_on_seed_under_greedy_once(fake_engine):
    """The CLI reports what the shared check warns, as its own stderr line, once per command: the API's copy of
    the warning is muted (chat would otherwise repeat it every turn)."""
    with warnings.catch_warnings(record=True) as leaked:
        warnings.simplefilter("always")
        r = run(["generate", "--max-new-tokens", "1", "--seed", "3", "hi"])
        assert r.exit_code == 0, r.output
        assert "qwen-mk: warning: --seed has no effect under greedy decoding (--temperature 0)" in r.stderr, r.stderr
        r = run(["chat", "--max-new-tokens", "1", "--no-timings", "--top-k", "5"], input="hi\nagain\n/exit\n")
        assert r.exit_code == 0, r.output
        assert r.stderr.count("no effect under greedy decoding") == 1, r.stderr
        r = run(["generate", "--max-new-tokens", "1", "--seed", "3", "--temperature", "0.5", "hi"])  # control
        assert r.exit_code == 0 and "warning" not in r.stderr, r.output
    assert not [w for w in leaked if issubclass(w.category, errors.IgnoredArgumentWarning)]


# ---------------------------------------------------------------------------------------------- InvalidArgument doc
def test_invalid_argument_docstring_covers_its_uses():
    """Every ``InvalidArgument("<name>: ...")`` raised under host/ names an argument its docstring mentions."""
    host = Path(__file__).resolve().parents[2] / "host"
    names = set()
    for f in host.rglob("*.py"):
        names |= set(re.findall(r"InvalidArgument\(\s*f?[\"']([a-z_]+):", f.read_text()))
    assert {"executor", "capacity", "chat", "max_new_tokens", "stop", "temperature"} <= names, names  # the scan works
    doc = InvalidArgument.__doc__
    assert not [n for n in sorted(names) if not re.search(rf"\b{n}\b", doc)], (sorted(names), doc)
