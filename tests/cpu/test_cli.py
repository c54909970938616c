"""The CLI (``qwen-mk generate | chat | bench``) through click's CliRunner: one real run of the tiny model on
the CPU, exit codes for every bad-input case, and chat/JSON mechanics on the scripted executor of
tests/helpers.py (so they run in milliseconds)."""
from __future__ import annotations

import json

import pytest

from host.errors import (EmptyPrompt, ExecutorUnavailable, GenerationInterrupted, InvalidArgument, ModelLoadError,
                         PromptTooLong)
from host.executors import gpu_available
from loader.config import PRESETS
from tests.helpers import HashExecutor, run


def test_generate_tiny_on_cpu(tiny_ckpt):
    """The real path: tokenizer, chat template, reference model on the CPU, streamed text, timing line."""
    r = run(["generate", "Write a haiku about the sea", "--model", str(tiny_ckpt), "--executor", "cpu",
             "--max-new-tokens", "2"])
    assert r.exit_code == 0, r.output + str(r.exception)
    assert r.stdout.strip() and "prefill" in r.stderr and "decode 2 tok" in r.stderr and "finish length" in r.stderr


def test_generate_json_and_stdin(fake_engine):
    r = run(["generate", "--json", "--max-new-tokens", "4"], input="Write a haiku about the sea\n")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert set(d) >= {"text", "ids", "finish_reason", "timings", "executor_detail"} and len(d["ids"]) == 4
    tk = fake_engine[0].tokenizer
    assert d["text"] == tk.decode(d["ids"]) and d["finish_reason"] == "length"
    assert d["timings"]["prompt_tokens"] == len(tk.encode(fake_engine[0].template.render(
        [{"role": "user", "content": "Write a haiku about the sea\n"}])))
    r2 = run(["generate", "Hi", "--max-new-tokens", "4"])         # streamed form prints the same text
    assert r2.exit_code == 0 and r2.stdout.strip() and "finish length" in r2.stderr


@pytest.mark.parametrize("args,code", [
    (["generate", "--raw", ""], EmptyPrompt.exit_code),        # with the chat template "" is a valid message
    (["generate", "--raw", "   \n"], EmptyPrompt.exit_code),
    (["generate", "hi", "--temperature", "-1"], 2),           # outside the option's declared range: usage error
    (["generate", "hi", "--top-p", "2"], 2),
    (["generate", "hi", "--max-new-tokens", "0"], 2),
    (["generate", "hi " * 50, "--capacity", "16"], PromptTooLong.exit_code),
    (["generate", "hi", "--model", "x", "--preset", "tiny"], 2),
], ids=lambda a: " ".join(a)[:40] if isinstance(a, list) else str(a))
def test_generate_bad_input_exit_codes(fake_engine, args, code):
    r = run(args)
    assert r.exit_code == code, (r.exit_code, r.output)
    if code != 2:
        assert "error:" in r.stderr


def test_generate_bad_model_dir(tmp_path, tiny_ckpt):
    r = run(["generate", "hi", "--model", str(tmp_path / "absent"), "--executor", "cpu"])
    assert r.exit_code == ModelLoadError.exit_code and "not a directory" in r.stderr
    (tmp_path / "config.json").write_text((tiny_ckpt / "config.json").read_text())  # no weights
    r = run(["generate", "hi", "--model", str(tmp_path), "--executor", "cpu"])
    assert r.exit_code == ModelLoadError.exit_code and "error:" in r.stderr and str(tmp_path) in r.stderr


@pytest.mark.parametrize("kind", ["megakernel", "graph"])
def test_generate_gpu_executor_without_gpu(kind, tiny_ckpt):
    if gpu_available()[0]:
        pytest.skip("a GPU is present")
    r = run(["generate", "hi", "--model", str(tiny_ckpt), "--executor", kind])
    assert r.exit_code == ExecutorUnavailable.exit_code and "needs an NVIDIA GPU" in r.stderr


def test_generate_interrupted(fake_engine, monkeypatch):
    def boom(self, token):
        raise KeyboardInterrupt
    monkeypatch.setattr(HashExecutor, "step", boom)
    r = run(["generate", "hi", "--max-new-tokens", "5"])
    assert r.exit_code == GenerationInterrupted.exit_code and "interrupted" in r.stderr


def test_chat_keeps_session_and_survives_interrupt(fake_engine, monkeypatch):
    r = run(["chat", "--max-new-tokens", "3", "--no-think"], input="hello\nhow are you\n/exit\n")
    assert r.exit_code == 0, r.output
    assert r.stderr.count("finish length") == 2
    ex, tk = fake_engine[0].executor, fake_engine[0].tokenizer
    header = len(tk.encode("<|im_start|>user\nhello<|im_end|>\n"))
    kinds = [c[0] for c in ex.calls]
    turn2 = ex.calls[kinds.index("prefill", kinds.index("step"))]
    assert turn2[1] == header, ex.calls                          # re-ran from turn 1's assistant header, not 0
    calls = {"n": 0}
    real_step = HashExecutor.step

    def flaky(self, token):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_step(self, token)
    monkeypatch.setattr(HashExecutor, "step", flaky)
    r = run(["chat", "--max-new-tokens", "4", "--no-think"], input="one\ntwo\n")
    assert r.exit_code == 0, r.output
    assert "[interrupted" in r.stderr and r.stderr.count("finish length") == 1


def test_bench_lists_and_refuses_without_gpu():
    r = run(["bench", "--list"])
    assert r.exit_code == 0
    if gpu_available()[0]:
        pytest.skip("a GPU is present")
    r = run(["bench"])
    assert r.exit_code == ExecutorUnavailable.exit_code and "need an NVIDIA GPU" in r.stderr


def test_bench_replay_is_the_replay_and_other_names_are_refused():
    r = run(["bench", "replay", "--help"])
    assert r.exit_code == 0 and "--executors" in r.stdout and "--history" in r.stdout, r.output
    r = run(["bench", "nosuch"])
    assert r.exit_code == 2 and "unknown subcommand 'nosuch'" in r.stderr


def test_dash_reads_stdin_and_greedy_records_no_seed(fake_engine):
    r = run(["generate", "-", "--json", "--max-new-tokens", "2"], input="Write a haiku about the sea\n")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    tk = fake_engine[0].tokenizer
    assert d["timings"]["prompt_tokens"] == len(tk.encode(fake_engine[0].template.render(
        [{"role": "user", "content": "Write a haiku about the sea\n"}])))  # not the literal prompt "-"
    assert d["seed"] is None  # greedy draws nothing
    s = json.loads(run(["generate", "hi", "--json", "--max-new-tokens", "2", "--temperature", "1"]).stdout)
    assert isinstance(s["seed"], int)  # sampling records the seed it drew


def test_chat_rejects_bad_sampling_before_loading(monkeypatch):
    import host.commands.chat as chat
    monkeypatch.setattr(chat, "load_engine", lambda kw: pytest.fail("the model was loaded before the flags were checked"))
    r = run(["chat", "--temperature", "-1"], input="hello\n")
    assert r.exit_code == InvalidArgument.exit_code and "temperature" in r.stderr


def test_corrupt_tokenizer_files_name_the_file(tmp_path, tiny_ckpt):
    import shutil
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, d)
    (d / "tokenizer.json").write_text('{"x":')
    r = run(["generate", "hi", "--model", str(d), "--executor", "cpu"])
    assert r.exit_code == ModelLoadError.exit_code and "tokenizer.json: not a valid tokenizer.json" in r.stderr
    shutil.copy(tiny_ckpt / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text('{"x":')
    r = run(["generate", "hi", "--model", str(d), "--executor", "cpu"])
    assert r.exit_code == ModelLoadError.exit_code and "tokenizer_config.json: not valid JSON" in r.stderr


def test_make_checkpoint_unwritable_destination(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = run(["make-checkpoint", "--preset", "tiny", "--out", str(blocker / "ckpt"), "--no-tokenizer"])
    assert r.exit_code != 0 and "cannot write the checkpoint to --out" in r.output and "Traceback" not in r.output


def test_chat_turn_longer_than_capacity_keeps_the_chat(fake_engine):
    """A turn the session cannot hold is refused for that turn only; the next turn still runs (exit 0)."""
    r = run(["chat", "--capacity", "64", "--max-new-tokens", "2", "--no-think", "--no-timings"],
            input=" ".join(["word"] * 200) + "\nhi\n/exit\n")
    assert r.exit_code == 0, r.output
    assert "error: prompt has" in r.stderr and "[turn dropped, conversation kept" in r.stderr
    kinds = [c[0] for c in fake_engine[0].executor.calls]
    assert "step" in kinds  # the second turn generated


def test_capacity_above_the_model_context_is_refused(tiny_ckpt):
    r = run(["generate", "--model", str(tiny_ckpt), "--capacity", str(PRESETS["tiny"].max_position_embeddings + 1),
             "hi"])
    assert r.exit_code == InvalidArgument.exit_code and "exceeds the model's context" in r.stderr, r.output


def test_compare_refuses_without_gpu_and_checks_flags():
    assert run(["compare", "--rows", "9"]).exit_code == 2
    assert run(["compare", "--steps", "0"]).exit_code == 2
    if gpu_available()[0]:
        pytest.skip("a GPU is present")
    r = run(["compare"])
    assert r.exit_code == ExecutorUnavailable.exit_code and "on a GPU" in r.stderr, r.output


def test_generate_rejects_bad_sampling_before_loading(monkeypatch):
    import host.commands.generate as gen
    monkeypatch.setattr(gen, "load_engine", lambda kw: pytest.fail("the model was loaded"))
    for args in (["--temperature", "-1"], ["--top-p", "0"]):
        r = run(["generate", *args, "hi"])
        assert r.exit_code == InvalidArgument.exit_code, (args, r.output)


def test_api_chat_with_a_string_names_the_expected_form(fake_engine):
    run(["generate", "--max-new-tokens", "1", "hi"])  # builds one scripted engine
    with pytest.raises(InvalidArgument, match="must be a list"):
        fake_engine[0].render_chat("hello")
