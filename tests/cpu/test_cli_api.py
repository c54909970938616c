"""CLI and Python API details a vLLM / OpenAI user relies on: finish reasons (``stop`` / ``length`` with
``stop_reason`` and ``finish_detail``), ``Generation.text``, argument errors naming the argument, warnings for
flags that have no effect, chat slash commands, and the synthetic-weights warning for ``--model DIR``.
Loop mechanics run on the scripted executor (tests/helpers.py); the synthetic warning on the real tiny model."""
from __future__ import annotations

import json
import os

import pytest

from host.engine import Engine
from host.errors import ExecutorUnavailable, InvalidArgument
from loader.config import IM_END_ID, PRESETS
from tests.helpers import drain, hash_engine, run

SYNTHETIC = "SYNTHETIC random weights"


# ---------------------------------------------------------------------------------------------- finish reasons
def test_finish_reasons_use_vllm_names(text_layer):
    """finish_reason is stop | length (vLLM); stop_reason is the stop string or stop token id (None for EOS and
    for length); finish_detail keeps what the engine knows (max_new_tokens vs capacity, eos vs stop token)."""
    eng = hash_engine(text_layer, capacity=40)
    body = eng.tokenizer.encode("Hello world. The end of it")
    cases = [  # (script, generate kwargs, finish_reason, stop_reason, finish_detail); max_new_tokens < capacity
        (body, dict(max_new_tokens=3), "length", None, "max_new_tokens"),
        (body + [IM_END_ID], dict(max_new_tokens=39), "stop", None, "eos"),
        (body + [IM_END_ID], dict(max_new_tokens=39, stop=["world."]), "stop", "world.", "stop_string"),
        (body, dict(max_new_tokens=39, stop_ids=[body[2]]), "stop", body[2], "stop_token"),
        (body + [IM_END_ID], dict(max_new_tokens=39, stop_ids=[IM_END_ID]), "stop", None, "eos"),
        (body * 4, dict(max_new_tokens=39, stop_ids=[]), "length", None, "capacity"),
    ]
    for script, kw, reason, stop_reason, detail in cases:
        eng.executor.script = script
        deltas, r = drain(eng.generate(list(range(100, 110)), **kw))
        assert (r.finish_reason, r.stop_reason, r.finish_detail) == (reason, stop_reason, detail), kw
        assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == (reason, stop_reason)
        assert all(d.finish_reason is None and d.stop_reason is None for d in deltas[:-1])
        j = r.to_json()
        assert (j["finish_reason"], j["stop_reason"], j["finish_detail"]) == (reason, stop_reason, detail)
        json.dumps(j)


def test_cli_json_and_timing_line_finish(fake_engine):
    r = run(["generate", "--json", "--max-new-tokens", "2", "hi"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["finish_reason"], d["stop_reason"], d["finish_detail"]) == ("length", None, "max_new_tokens")
    r = run(["generate", "--max-new-tokens", "39", "--capacity", "40", "hi"])      # the prompt fills part of it
    assert r.exit_code == 0, r.output
    assert "finish length (capacity)" in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------- Generation.text
def test_generation_text(text_layer):
    eng = hash_engine(text_layer)
    body = eng.tokenizer.encode("Hello world. The end of it")
    eng.executor.script = body
    g = eng.generate([7, 8], max_new_tokens=len(body))
    assert g.text == "Hello world. The end of it" == g.result().text    # drains the stream, as result() does
    g = eng.generate([7, 8], max_new_tokens=len(body))
    first = next(g).text
    assert g.text.startswith(first) and g.text == "Hello world. The end of it"  # after partial iteration too
    s = eng.new_session()
    assert s.generate([7, 8], max_new_tokens=len(body)).text == "Hello world. The end of it"
    s.close()


# ---------------------------------------------------------------------------------------------- executor name
def test_unknown_executor_is_an_invalid_argument(tiny_ckpt, tmp_path):
    for where in (tiny_ckpt, tmp_path / "absent"):                   # checked before the model is opened
        with pytest.raises(InvalidArgument, match=r"executor: expected one of megakernel, graph, cpu, cpu-vm, got 'tpu'") as e:
            Engine.load(where, executor="tpu")
        assert not isinstance(e.value, ExecutorUnavailable)


# ---------------------------------------------------------------------------------------------- chat commands
def _turns(r) -> int:
    return r.stderr.count("| finish ")


def test_chat_unknown_slash_command_is_not_sent(fake_engine):
    r = run(["chat", "--max-new-tokens", "2", "--no-think"], input="/bogus\nhello\n/exit\n")
    assert r.exit_code == 0, r.output
    assert "unknown command '/bogus'" in r.stderr and "/reset" in r.stderr and "/exit" in r.stderr, r.stderr
    assert _turns(r) == 1                                             # only "hello" reached the model
    kinds = [c for c in fake_engine[0].executor.calls if c[0] == "prefill"]
    tk, tmpl = fake_engine[0].tokenizer, fake_engine[0].template
    want = len(tk.encode(tmpl.render([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                     enable_thinking=False)))
    assert kinds[0][1] == 0 and sum(c[2] for c in kinds) == want      # a fresh prompt: no /bogus turn before it


def test_chat_double_slash_sends_a_leading_slash(fake_engine):
    r = run(["chat", "--max-new-tokens", "2", "--no-think"], input="//usr/bin is a folder\n/exit\n")
    assert r.exit_code == 0, r.output
    assert _turns(r) == 1 and "unknown command" not in r.stderr
    tk, tmpl = fake_engine[0].tokenizer, fake_engine[0].template
    want = len(tk.encode(tmpl.render([{"role": "user", "content": "/usr/bin is a folder"}],
                                     add_generation_prompt=True, enable_thinking=False)))
    assert sum(c[2] for c in fake_engine[0].executor.calls if c[0] == "prefill") == want


def test_chat_help_lists_commands(fake_engine):
    r = run(["chat", "--max-new-tokens", "2"], input="/help\n/exit\n")
    assert r.exit_code == 0 and _turns(r) == 0 and "/reset" in r.stderr and "unknown" not in r.stderr


# ---------------------------------------------------------------------------------------------- sampling flags
@pytest.mark.parametrize("cmd", ["generate", "chat"])
def test_top_k_top_p_under_greedy_warn(fake_engine, cmd):
    args = [cmd, "--max-new-tokens", "1"] + (["hi"] if cmd == "generate" else [])
    inp = "hi\n/exit\n" if cmd == "chat" else None
    r = run(args + ["--top-k", "5", "--top-p", "0.5"], input=inp)
    assert r.exit_code == 0, r.output
    assert "warning: --top-k and --top-p have no effect under greedy decoding" in r.stderr, r.stderr
    r = run(args + ["--top-p", "0.5"], input=inp)
    assert "warning: --top-p has no effect" in r.stderr and "--top-k" not in r.stderr
    r = run(args + ["--top-k", "5", "--temperature", "0.7"], input=inp)   # control: sampling uses them
    assert r.exit_code == 0 and "warning" not in r.stderr


@pytest.mark.parametrize("cmd", ["generate", "chat"])
def test_max_new_tokens_above_capacity_refused_before_loading(monkeypatch, cmd):
    import host.commands.chat as chat
    import host.commands.generate as gen
    fail = lambda kw: pytest.fail("the model was loaded before --max-new-tokens was checked")  # noqa: E731
    monkeypatch.setattr(gen, "load_engine", fail)
    monkeypatch.setattr(chat, "load_engine", fail)
    tail = ["hi"] if cmd == "generate" else []
    r = run([cmd, "--capacity", "64", "--max-new-tokens", "65", *tail], input="hi\n")
    assert r.exit_code == InvalidArgument.exit_code, r.output
    assert "max_new_tokens: 65 exceeds" in r.stderr and "--capacity" in r.stderr, r.stderr
    ctx = PRESETS["tiny"].max_position_embeddings
    r = run([cmd, "--preset", "tiny", "--capacity", str(2 * ctx), "--max-new-tokens", str(ctx + 1), *tail],
            input="hi\n")
    assert r.exit_code == InvalidArgument.exit_code and "context" in r.stderr, r.output


def test_max_new_tokens_default_fits_a_small_capacity(fake_engine):
    r = run(["generate", "--capacity", "64", "--max-new-tokens", "63", "hi"])
    assert r.exit_code == 0, r.output
    r = run(["generate", "--json", "--capacity", "32", "hi"])         # the default 256 becomes 31, no error
    assert r.exit_code == 0 and json.loads(r.stdout)["finish_detail"] == "capacity", r.output
    r = run(["chat", "--capacity", "32", "--no-timings"], input="hi\n/exit\n")
    assert r.exit_code == 0 and "error" not in r.stderr, r.output


def test_bad_capacity_is_named_not_max_new_tokens(tiny_ckpt):
    # --capacity below 2 is click's usage error naming the option (test_sampling_extremes.py), not the engine's
    # "capacity: expected a positive integer": named, and before any max_new_tokens check
    r = run(["generate", "--capacity", "0", "--model", str(tiny_ckpt), "--executor", "cpu", "hi"])
    assert r.exit_code == 2 and "Invalid value for '--capacity'" in r.stderr, r.output
    assert "max_new_tokens" not in r.stderr


# ---------------------------------------------------------------------------------------------- synthetic warning
def _linked_copy(src, dst, skip=()):
    dst.mkdir()
    for f in os.listdir(src):
        if f not in skip:
            os.symlink(os.path.join(src, f), dst / f)
    return dst


def test_model_dir_of_synthetic_checkpoint_warns(tiny_ckpt, tmp_path):
    args = ["generate", "hi", "--executor", "cpu", "--max-new-tokens", "1", "--model"]
    r = run(args + [str(tiny_ckpt)])                                  # the cached checkpoint (stamped)
    assert r.exit_code == 0 and SYNTHETIC in r.stderr and "meaningless by design" in r.stderr, r.output
    from host.engine import synthetic_marker
    # the warning comes before the model is opened; a capacity above the context stops the load early (fast)
    args = args[:-1] + ["--capacity", str(PRESETS["tiny"].max_position_embeddings + 1), "--model"]
    made = _linked_copy(tiny_ckpt, tmp_path / "made", skip={".qwen-mk-stamp"})  # as `make-checkpoint` leaves it
    assert synthetic_marker(made) is not None
    r = run(args + [str(made)])
    assert r.exit_code == InvalidArgument.exit_code and SYNTHETIC in r.stderr and str(made) in r.stderr, r.output
    other = _linked_copy(tiny_ckpt, tmp_path / "other", skip={".qwen-mk-stamp", "tokenizer_config.json"})
    tc = json.loads((tiny_ckpt / "tokenizer_config.json").read_text())
    tc["chat_template"] = tc["chat_template"].replace("qwen-mk's chat template for synthetic", "a chat template for")
    (other / "tokenizer_config.json").write_text(json.dumps(tc))
    assert synthetic_marker(other) is None
    r = run(args + [str(other)])                                      # control: not a qwen-mk checkpoint
    assert r.exit_code == InvalidArgument.exit_code and SYNTHETIC not in r.stderr, r.output
