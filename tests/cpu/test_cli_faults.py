"""Faults of the user's environment reach the user as one ``qwen-mk: error: ...`` line and a documented exit code,
never a traceback: a stdout closed by its reader (exit 0, quietly) or on a full device (exit 8), an unwritable or
full first-use cache (exit 8, naming the directory and QWEN_MK_CACHE, no temporary directory left), and the
smaller checks (an empty --stop, bench --timeout below 1, no GPU for a GPU executor, a missing
tokenizer_config.json, Ctrl-C / Ctrl-D at the chat prompt). Each fault has its control: the same command without
the fault succeeds."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from host.errors import EnvironmentIOError, ExecutorUnavailable, InvalidArgument, ModelLoadError
from tests.helpers import run

ROOT = Path(__file__).resolve().parents[2]
ERROR = "qwen-mk: error:"
GEN = ["generate", "--preset", "tiny", "--executor", "cpu", "--max-new-tokens", "2", "hi"]
COMMANDS = {"generate": GEN, "generate --json": GEN[:1] + ["--json"] + GEN[1:], "inspect": ["inspect"],
            "--help": ["--help"]}


def cli(args, cache: Path, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    """The CLI in a subprocess (``python -m host.cli``) with the cache at ``cache``; stderr captured as text."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), QWEN_MK_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "host.cli", *args], cwd=ROOT, env=env, stdout=stdout,
                          stderr=subprocess.PIPE, timeout=300)


def error_lines(stderr: str) -> list[str]:
    """The stderr lines of errors, after checking that stderr holds no traceback."""
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    return [ln for ln in stderr.splitlines() if ln.startswith(ERROR)]


@pytest.fixture(scope="module")
def controls(tiny_ckpt):
    """Each command of COMMANDS run once with a working stdout (a pipe): exit 0 and some output."""
    out = {}
    for name, args in COMMANDS.items():
        p = cli(args, tiny_ckpt.parent)
        assert p.returncode == 0 and p.stdout.strip() and not error_lines(p.stderr.decode()), (name, p.stderr)
        out[name] = p
    return out


# ---------------------------------------------------------------------------------------------------- stdout
@pytest.mark.parametrize("name", ["generate", "inspect", "--help"])
def test_closed_stdout_ends_quietly(name, controls, tiny_ckpt):
    """A reader that closed the pipe (``| head -1``): exit 0, no error and no traceback (coreutils' rule)."""
    assert controls[name].returncode == 0
    r, w = os.pipe()
    os.close(r)  # closed before the command writes: every write gets EPIPE
    try:
        p = cli(COMMANDS[name], tiny_ckpt.parent, stdout=w)
    finally:
        os.close(w)
    assert p.returncode == 0, p.stderr
    assert error_lines(p.stderr.decode()) == []


def test_head_one_of_inspect(tiny_ckpt):
    """``qwen-mk inspect | head -1`` through a shell: the first line, exit 0, an empty stderr."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), QWEN_MK_CACHE=str(tiny_ckpt.parent))
    cmd = f"{sys.executable} -m host.cli inspect | head -1; exit ${{PIPESTATUS[0]}}"
    p = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.startswith("# program tiny") and p.stdout.count("\n") == 1
    assert p.stderr == ""
    control = subprocess.run(["bash", "-c", f"{sys.executable} -m host.cli inspect | wc -l"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
    assert control.returncode == 0 and int(control.stdout) > 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
@pytest.mark.parametrize("name", list(COMMANDS))
def test_full_stdout_is_one_error_line(name, controls, tiny_ckpt):
    """``> /dev/full`` (ENOSPC): one error line naming stdout, exit 8 (EnvironmentIOError), no traceback."""
    assert controls[name].returncode == 0
    with open("/dev/full", "w") as full:
        p = cli(COMMANDS[name], tiny_ckpt.parent, stdout=full)
    lines = error_lines(p.stderr.decode())
    assert p.returncode == EnvironmentIOError.exit_code == 8, p.stderr
    assert lines == [f"{ERROR} cannot write to stdout: No space left on device"]


# ---------------------------------------------------------------------------------------------------- cache
def _no_tmp_left(d: Path) -> None:
    left = [p.name for p in d.iterdir() if ".tmp" in p.name] if d.is_dir() else []
    assert left == [], left


def _cache_error(r, where: Path) -> str:
    assert r.exit_code == EnvironmentIOError.exit_code, (r.output, r.exception)
    lines = error_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert f"cache directory {where}" in lines[0] and "QWEN_MK_CACHE" in lines[0]
    return lines[0]


def test_cache_that_is_a_file(tmp_path, monkeypatch):
    """QWEN_MK_CACHE naming a file (and a path under one): the error names it; control: a directory works."""
    f = tmp_path / "file"
    f.write_text("")
    for where in (f, f / "sub"):
        monkeypatch.setenv("QWEN_MK_CACHE", str(where))
        line = _cache_error(run(GEN), where)
        assert ("it is a file, not a directory" in line) == (where == f), line
    monkeypatch.setenv("QWEN_MK_CACHE", str(tmp_path / "cache"))
    r = run(GEN)
    assert r.exit_code == 0, (r.output, r.exception)
    assert (tmp_path / "cache" / "ckpt-tiny-seed0").is_dir()
    _no_tmp_left(tmp_path / "cache")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_cache(tmp_path, monkeypatch):
    """A read-only QWEN_MK_CACHE: exit 8 naming it; control: the same directory made writable works."""
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    monkeypatch.setenv("QWEN_MK_CACHE", str(d))
    try:
        assert "Permission denied" in _cache_error(run(GEN), d)
    finally:
        d.chmod(0o755)
    assert run(GEN).exit_code == 0


def _full_after_weights(monkeypatch):
    """The tokenizer files (written after the weights, by both writers) fail half-way with ENOSPC."""
    import loader.tokenizer

    def full(out_dir, *a, **k):
        Path(out_dir, "tokenizer.json").write_text("{")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(loader.tokenizer, "write_tokenizer_files", full)


@pytest.mark.parametrize("which", ["trained", "synthetic"])
def test_writers_clean_up_a_failed_write(which, tmp_path, monkeypatch):
    """loader.trained / loader.synthetic ensure_checkpoint: a write failing midway raises the OSError and leaves
    neither the checkpoint nor its temporary directory; control: the same call without the fault writes it."""
    from loader import synthetic, trained
    from loader.trained import DEFAULT_MODEL

    def ensure():
        if which == "trained":
            return trained.ensure_checkpoint(DEFAULT_MODEL, cache_dir=tmp_path)
        return synthetic.ensure_checkpoint("tiny", cache_dir=tmp_path)
    with monkeypatch.context() as m:
        _full_after_weights(m)
        with pytest.raises(OSError) as e:
            ensure()
    assert e.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == []
    d = ensure()
    assert d.is_dir() and (d / "tokenizer_config.json").is_file()
    _no_tmp_left(tmp_path)


def test_full_cache_on_first_use_of_the_default_model(tmp_path, monkeypatch):
    """The default model expanded into a cache that fills up: one error line naming the directory and
    QWEN_MK_CACHE (exit 8), no temporary directory left; control: with room, the same command works."""
    args = ["generate", "--executor", "cpu", "--max-new-tokens", "2", "hi"]
    monkeypatch.setenv("QWEN_MK_CACHE", str(tmp_path))
    with monkeypatch.context() as m:
        _full_after_weights(m)
        assert "No space left on device" in _cache_error(run(args), tmp_path)
    _no_tmp_left(tmp_path)
    r = run(args)
    assert r.exit_code == 0, (r.output, r.exception)
    _no_tmp_left(tmp_path)


# ---------------------------------------------------------------------------------------------- smaller items
def test_empty_stop_refused_before_loading(fake_engine, monkeypatch):
    """``--stop ""``: InvalidArgument (exit 2) before the model loads; control: a non-empty --stop generates."""
    r = run(["generate", "--stop", "", "--max-new-tokens", "2", "hi"])
    assert r.exit_code == InvalidArgument.exit_code
    assert error_lines(r.stderr) == [f"{ERROR} stop: expected non-empty strings, got ['']"]
    assert fake_engine == []  # refused before loading
    r = run(["generate", "--stop", "###", "--max-new-tokens", "2", "hi"])
    assert r.exit_code == 0 and len(fake_engine) == 1, r.output


def test_bench_negative_timeout_is_a_usage_error():
    """``bench --timeout -5``: click's range error (exit 2); control: --timeout 5 is accepted."""
    r = run(["bench", "--timeout", "-5"])
    assert r.exit_code == 2 and "Invalid value for '--timeout'" in r.stderr
    r = run(["bench", "--timeout", "5", "--list"])
    assert r.exit_code == 0, r.output


def _fake_cupy(monkeypatch, count):
    runtime = types.SimpleNamespace(getDeviceCount=count,
                                    getDeviceProperties=lambda i: {"name": b"NVIDIA H200"})
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime)))


def test_no_gpu_says_so(monkeypatch):
    """Without a GPU, CUDA's "driver version is insufficient" comes after "no NVIDIA GPU was found", in the
    message of --executor graph / megakernel (exit 7); control: a device makes the check pass."""
    from host.executors import gpu_available

    def insufficient():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime "
                           "version")
    _fake_cupy(monkeypatch, insufficient)
    ok, why = gpu_available()
    assert not ok and why.startswith("no NVIDIA GPU was found (CUDA: cudaErrorInsufficientDriver") and \
        "driver version is insufficient" in why
    for kind in ("graph", "megakernel"):
        r = run(["generate", "--executor", kind, "hi"])
        assert r.exit_code == ExecutorUnavailable.exit_code
        lines = error_lines(r.stderr)
        assert len(lines) == 1 and "no NVIDIA GPU was found" in lines[0], r.stderr
    _fake_cupy(monkeypatch, lambda: 0)
    assert gpu_available() == (False, "no NVIDIA GPU was found (CUDA reports 0 devices)")
    _fake_cupy(monkeypatch, lambda: 1)
    assert gpu_available() == (True, "NVIDIA H200")


def test_missing_tokenizer_config_is_named(tiny_ckpt, tmp_path):
    """A checkpoint directory without tokenizer_config.json: exit 6 naming that file as missing, not "no
    chat_template string"; control: the intact copy loads and generates."""
    from loader.chat_template import ChatTemplate, ChatTemplateError

    d = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, d)
    assert ChatTemplate.from_checkpoint(d)  # control
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json: file not found"):
        ChatTemplate.from_checkpoint(d)
    r = run(["generate", "--model", str(d), "--executor", "cpu", "--max-new-tokens", "2", "hi"])
    assert r.exit_code == ModelLoadError.exit_code
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and "tokenizer_config.json: file not found" in lines[0], r.stderr
    assert "no chat_template string" not in lines[0]


def _scripted_input(monkeypatch, script):
    """The chat prompt's input(): each item of ``script`` is returned, or raised when it is an exception;
    EOFError (Ctrl-D) when the script is done."""
    import host.commands.chat as chat

    items = iter(script)

    def fake(prompt=""):
        item = next(items, EOFError())
        if isinstance(item, BaseException):
            raise item
        return item
    monkeypatch.setattr(chat, "input", fake, raising=False)


def test_chat_ctrl_c_at_the_prompt_clears_the_line(fake_engine, monkeypatch):
    """Ctrl-C while the chat reads a line asks again (the chat goes on); Ctrl-D then ends it (exit 0); control:
    the same conversation without the Ctrl-C gives the same replies."""
    outs = []
    for script in (["hi", KeyboardInterrupt(), "again"], ["hi", "again"]):
        _scripted_input(monkeypatch, script)
        r = run(["chat", "--max-new-tokens", "2"])
        assert r.exit_code == 0, (r.output, r.exception)
        assert error_lines(r.stderr) == []
        assert r.stderr.count("[prefill") == 2, r.stderr  # both messages got a reply
        assert ("line cleared" in r.stderr) == (len(script) == 3)
        outs.append(r.stdout)
    assert outs[0] == outs[1]


def test_chat_ctrl_d_ends_at_once(fake_engine, monkeypatch):
    """Ctrl-D at the first prompt: exit 0, nothing generated; control: a message first gets its reply."""
    for script, replies in (([], 0), (["hi"], 1)):
        _scripted_input(monkeypatch, script)
        r = run(["chat", "--max-new-tokens", "2"])
        assert r.exit_code == 0 and r.stderr.count("[prefill") == replies, r.stderr
