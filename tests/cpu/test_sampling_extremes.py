"""Sampling extremes and the limits around them:

1. a temperature so small that logits / T overflows (1e-40, 1e-300, 5e-324, 1e-38) or so large that T itself
   overflows fp32 (3.5e38, 1e308) gives no nan probabilities and no padding id: a temperature below 1e-5 is
   greedy decoding (vLLM's _SAMPLING_EPS) and a huge one is clamped to the fp32 range, with ordinary
   temperatures' seeded draws equal to recorded ones;
2. the CLI's --max-new-tokens default follows a ``--model DIR``'s context (a context below 257 does not refuse
   every generate / chat turn the user gave no --max-new-tokens for), as the API does;
3. a capacity below 2 fails at load in both the API and the CLI (CLI: click usage error);
4. SamplingParams takes NumPy scalars, refuses 10**400 with InvalidArgument (not a raw TypeError) and refuses
   bools;
5. Ctrl-C wording: "1 token", the one-shot CLI message, and ``result()`` saying "interrupted", not "closed".

Scripted executor (tests/helpers.py) and the CLI with its engine loader patched (milliseconds); a few real
tiny-model runs on the CPU.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from assembler.ref import ops
from host.engine import Engine
from host.errors import EngineError, GenerationInterrupted, IgnoredArgumentWarning, InvalidArgument
from host.sampling import SAMPLING_EPS, Sampler, SamplingParams, mask_padding
from loader.config import FIRST_PADDING_ID, PRESETS
from tests.helpers import HashExecutor, hash_engine, run

V = PRESETS["tiny"].vocab_size


def _logits(seed: int = 7, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(V) * scale).astype(np.float32)


# ---------------------------------------------------------------------------------------------- 1. temperature
@pytest.mark.parametrize("t", [1e-40, 1e-300, 5e-324, 1e-38, 1e-6, 9.99e-6])
def test_temperature_below_eps_is_greedy(t):
    x = _logits()
    x[FIRST_PADDING_ID + 5] = 1e4                                        # a padding id holds the largest logit
    p = SamplingParams(temperature=t, seed=1)
    assert p.greedy
    assert Sampler(p)(x) == int(ops.argmax(mask_padding(x))) < FIRST_PADDING_ID
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy           # 1e-5 itself samples, as in vLLM


@pytest.mark.parametrize("t", [3.5e38, 1e308, float(np.finfo(np.float32).max), 1e30])
def test_huge_temperature_never_nan(t):
    """T above the fp32 range would be inf in fp32 (-inf (masked padding) / inf = nan); it is the largest fp32:
    the distribution is (near) uniform over the real ids, never a padding id."""
    x = _logits()
    s = Sampler(SamplingParams(temperature=t, seed=3))
    toks = [s(x) for _ in range(16)]
    assert all(0 <= tok < FIRST_PADDING_ID for tok in toks) and len(set(toks)) > 8, toks
    f = ops.filter_logits(mask_padding(x), t)
    assert not np.isnan(f).any() and np.isneginf(f[FIRST_PADDING_ID:]).all()


@pytest.mark.parametrize("t", [1e-40, 5e-324])
def test_reference_sample_survives_overflowing_scores(t):
    """The reference op itself (no host eps): scores that overflow to +inf take the limit (the +inf ones share
    the mass); no nan, no padding id."""
    x = mask_padding(_logits())
    g = np.random.Generator(np.random.PCG64(0))
    toks = [int(ops.sample(x, t, 0, 1.0, g)) for _ in range(8)]
    assert all(tok < FIRST_PADDING_ID and x[tok] > 0 for tok in toks), toks


# Seeded draws recorded on these logits (assembler/ref/sampling.py): ordinary temperatures must give
# bit-identical results (the normal path is plain fp32 math, untouched by the clamps).
GOLDEN = [((0.7, None, None), [240730, 100929, 222889, 88412, 100234, 31860]),
          ((1.0, None, None), [242685, 99782, 226774, 70451, 85244, 29951]),
          ((0.7, 50, 0.9), [234944, 100929, 199148, 100234, 100929, 34861]),
          ((1.0, 0, 0.95), [242685, 100157, 226523, 70544, 85367, 30036]),
          ((1.5, 20, None), [225984, 99350, 199148, 71479, 90325, 10479])]


@pytest.mark.parametrize("args,want", GOLDEN, ids=lambda a: str(a) if isinstance(a, tuple) else "")
def test_ordinary_temperatures_match_recorded_draws(args, want):
    t, k, p = args
    s = Sampler(SamplingParams(temperature=t, top_k=k, top_p=p, seed=1234))
    assert [s(_logits()) for _ in range(6)] == want


def test_cli_tiny_and_huge_temperatures(fake_engine):
    """Extreme temperatures through the CLI on the scripted executor (its largest logit is on a padding id): exit
    0; a tiny temperature gives the greedy ids and prints no seed (none is drawn)."""
    greedy = json.loads(run(["generate", "--raw", "--json", "--max-new-tokens", "4", "x"]).stdout)["ids"]
    for t in ("1e-40", "1e-300", "5e-324", "1e-38"):
        r = run(["generate", "--raw", "--json", "--max-new-tokens", "4", "--temperature", t, "x"])
        assert r.exit_code == 0, r.output + repr(r.exception)
        assert json.loads(r.stdout)["ids"] == greedy
        r = run(["generate", "--raw", "--max-new-tokens", "2", "--temperature", t, "x"])
        assert r.exit_code == 0 and "seed" not in r.stderr, r.output
    for t in ("3.5e38", "1e308"):
        r = run(["generate", "--raw", "--json", "--max-new-tokens", "4", "--temperature", t, "x"])
        assert r.exit_code == 0, r.output + repr(r.exception)
        assert all(i < FIRST_PADDING_ID for i in json.loads(r.stdout)["ids"])


def test_cli_help_documents_the_eps():
    out = run(["generate", "--help"]).output
    assert "0 = greedy; so is any value below 1e-5" in out


def test_api_tiny_temperature_real_model(tiny_ckpt):
    """A tiny temperature through the API on the real tiny model: greedy ids, no traceback."""
    eng = Engine.load(tiny_ckpt, "cpu", capacity=64, quiet=True)
    with pytest.warns(IgnoredArgumentWarning, match="seed has no effect"):   # greedy: the seed is ignored
        r = eng.generate([9707], max_new_tokens=2, temperature=1e-39, seed=1).result()
    assert r.ids == eng.generate([9707], max_new_tokens=2).result().ids


def test_greedy_warning_names_a_tiny_temperature(text_layer):
    eng = hash_engine(text_layer)
    with pytest.warns(UserWarning, match=r"^top_k has no effect under greedy decoding \(temperature 1e-06, below "
                                         r"1e-5\) and is ignored; pass temperature >= 1e-5 to sample$"):
        eng.generate([1, 2], max_new_tokens=1, temperature=1e-6, top_k=5).result()


# ---------------------------------------------------------------------------------------------- 2. default vs context
@pytest.fixture
def context_100(monkeypatch, text_layer):
    """The CLI's loader patched to a scripted engine whose model context is 100 (a --model DIR's config), as
    Engine.load builds it: capacity min(4096, context)."""
    import host.commands.chat as chat
    import host.commands.generate as gen
    cfg = dataclasses.replace(PRESETS["tiny"], max_position_embeddings=100)
    tok, tmpl = text_layer

    def make(capacity=None):
        return Engine(cfg, None, None, tok, tmpl, HashExecutor(capacity=min(capacity or 4096, 100)))
    monkeypatch.setattr(gen, "load_engine", lambda kw: make(kw["capacity"]))
    monkeypatch.setattr(chat, "load_engine", lambda kw: make(kw["capacity"]))
    return make


def test_cli_default_max_new_tokens_fits_a_model_dir_context(context_100, tmp_path):
    r = run(["generate", "--model", str(tmp_path), "--raw", "--json", "hi there"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["timings"]["prompt_tokens"] + len(d["ids"]) == 100 and d["finish_detail"] == "capacity"
    eng = context_100()                                                   # the API, same prompt, no max_new_tokens
    api = eng.generate(eng.encode("hi there")).result()
    assert api.ids == d["ids"]
    r = run(["chat", "--model", str(tmp_path), "--no-timings"], input="hi\nagain\n/exit\n")
    assert r.exit_code == 0 and "error" not in r.stderr and "dropped" not in r.stderr, r.output


def test_cli_chat_refuses_a_too_large_max_new_tokens_once(context_100, tmp_path):
    """Given explicitly and above the loaded model's context: one error before the first turn (exit 2), not a
    dropped turn for every line."""
    r = run(["chat", "--model", str(tmp_path), "--max-new-tokens", "150"], input="hi\nagain\n/exit\n")
    assert r.exit_code == InvalidArgument.exit_code, r.output
    assert "max_new_tokens: 150 exceeds 99" in r.stderr and "dropped" not in r.stderr, r.stderr


def test_cli_max_new_tokens_help_mentions_the_context():
    out = " ".join(run(["generate", "--help"]).output.split())
    assert "256, or --capacity - 1 or the model's context - 1 when smaller" in out


def test_real_model_dir_with_a_small_context(tiny_ckpt, tmp_path):
    """The real tiny model from a checkpoint whose config says max_position_embeddings 6."""
    d = tmp_path / "ck"
    d.mkdir()
    for f in os.listdir(tiny_ckpt):
        if f != "config.json":
            os.symlink(os.path.join(tiny_ckpt, f), d / f)
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = 6
    (d / "config.json").write_text(json.dumps(cfg))
    r = run(["generate", "--model", str(d), "--executor", "cpu", "--raw", "--json", "hi there"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["timings"]["prompt_tokens"], len(out["ids"]), out["finish_detail"]) == (2, 4, "capacity")


# ---------------------------------------------------------------------------------------------- 3. capacity >= 2
@pytest.mark.parametrize("cap", ["0", "1", "-3"])
@pytest.mark.parametrize("cmd", ["generate", "chat"])
def test_cli_capacity_below_2_is_a_usage_error(monkeypatch, cmd, cap):
    import host.commands.chat as chat
    import host.commands.generate as gen
    fail = lambda kw: pytest.fail("the model was loaded")  # noqa: E731
    monkeypatch.setattr(gen, "load_engine", fail)
    monkeypatch.setattr(chat, "load_engine", fail)
    r = run([cmd, "--capacity", cap] + (["hi"] if cmd == "generate" else []), input="hi\n/exit\n")
    assert r.exit_code == 2, r.output
    assert "Usage:" in r.stderr and "Invalid value for '--capacity'" in r.stderr, r.stderr
    assert "max_new_tokens" not in r.stderr and "qwen-mk: error" not in r.stderr


@pytest.mark.parametrize("cap", [1, 0, -1])
def test_api_capacity_below_2_is_refused_at_load(cap, tmp_path):
    with pytest.raises(InvalidArgument, match=r"^capacity: expected an integer >= 2 \(.*prompt.*generated"):
        Engine.load("tiny", executor="cpu", capacity=cap)
    with pytest.raises(InvalidArgument, match=r"^capacity: "):        # before the model directory is read
        Engine.load(tmp_path / "absent", executor="cpu", capacity=cap)


def test_api_capacity_2_generates_one_token(tiny_ckpt):
    eng = Engine.load(tiny_ckpt, "cpu", capacity=2, quiet=True)           # control: the smallest useful capacity
    r = eng.generate([9707]).result()
    assert (len(r.ids), r.finish_reason) == (1, "length")


# ---------------------------------------------------------------------------------------------- 4. SamplingParams
@pytest.mark.parametrize("kw", [dict(temperature=np.float32(0.5)), dict(temperature=np.int64(1)),
                                dict(temperature=np.float64(0.7), top_p=np.float32(0.5)),
                                dict(temperature=1.0, top_p=np.float64(1.0), top_k=np.int32(5), seed=np.uint64(9))],
                         ids=str)
def test_numpy_scalars_are_accepted(kw, text_layer):
    p = SamplingParams(**kw)
    assert all(type(getattr(p, f)) in (int, float, type(None)) for f in ("temperature", "top_k", "top_p", "seed"))
    r = hash_engine(text_layer).generate([1, 2], max_new_tokens=2, **kw).result()
    json.dumps(r.to_json())                                               # plain numbers: --json can print them


@pytest.mark.parametrize("kw", [dict(temperature=10 ** 400), dict(top_p=10 ** 400), dict(temperature=-(10 ** 400)),
                                dict(temperature=True), dict(temperature=False), dict(top_p=True),
                                dict(seed=True), dict(seed=False), dict(top_k=True), dict(top_k=np.bool_(True)),
                                dict(temperature=np.bool_(True)), dict(temperature=np.float32("nan")),
                                dict(temperature=np.float64("inf"))],
                         ids=lambda kw: ",".join(f"{k}={v!r}"[:24] for k, v in kw.items()))
def test_bad_sampling_values_raise_invalid_argument(kw):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(**kw)
    assert len(str(e.value)) < 200, str(e.value)                          # 10**400's 401 digits are cut short


def test_bool_max_new_tokens_is_refused(text_layer):
    with pytest.raises(InvalidArgument, match="max_new_tokens"):
        hash_engine(text_layer).generate([1, 2], max_new_tokens=True)


# ---------------------------------------------------------------------------------------------- 5. Ctrl-C wording
def test_interrupt_after_one_token_is_singular_and_result_says_interrupted(text_layer):
    eng = hash_engine(text_layer, slots=2)
    eng.executor.interrupt_at = 1                                         # Ctrl-C in the first step: 1 token out
    g = eng.generate([1, 2, 3], max_new_tokens=8, stop_ids=[])
    with pytest.raises(GenerationInterrupted) as e:
        g.result()
    assert str(e.value).startswith("generation interrupted after 1 token; its one-shot session is closed"), e.value
    assert e.value.tokens == 1
    for again in (g.result, lambda: g.text):
        with pytest.raises(GenerationInterrupted, match="interrupted") as e2:
            again()
        assert "closed before it finished" not in str(e2.value)
    s = eng.new_session()                                                 # a kept session: same, its own wording
    eng.executor.calls.clear()
    g = s.generate([1, 2, 3], max_new_tokens=8, stop_ids=[])
    with pytest.raises(GenerationInterrupted, match=r"after 1 token; the session was rolled back to 0 tokens"):
        list(g)
    with pytest.raises(GenerationInterrupted, match=r"interrupted.*rolled back"):
        g.result()
    s.close()
    g = hash_engine(text_layer).generate([1, 2, 3], max_new_tokens=8)   # control: close() says "closed"
    next(g)
    g.close()
    with pytest.raises(EngineError, match="closed before it finished"):
        g.result()


@pytest.mark.parametrize("at,tokens", [(1, "1 token"), (3, "3 tokens")])
def test_cli_oneshot_interrupt_message(fake_engine, monkeypatch, at, tokens):
    real_step, calls = HashExecutor.step, {"n": 0}

    def ctrl_c(self, token):
        calls["n"] += 1
        if calls["n"] == at:
            raise KeyboardInterrupt
        return real_step(self, token)
    monkeypatch.setattr(HashExecutor, "step", ctrl_c)
    r = run(["generate", "--raw", "--max-new-tokens", "8", "hi"])
    assert r.exit_code == GenerationInterrupted.exit_code, r.output
    assert r.stdout.strip()                                               # the partial text is on stdout
    assert r.stderr == (f"qwen-mk: error: generation interrupted after {tokens}; the one-shot session is closed "
                        f"(the text above is all there is)\n"), r.stderr
    calls["n"] = 0
    r = run(["generate", "--raw", "--json", "--max-new-tokens", "8", "hi"])
    assert r.exit_code == GenerationInterrupted.exit_code and r.stdout == "", r.output
    assert r.stderr == (f"qwen-mk: error: generation interrupted after {tokens}; the one-shot session is closed "
                        f"(no JSON was printed)\n"), r.stderr
