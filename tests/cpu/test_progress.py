"""The writers' progress bar (loader.progress): a tqdm bar of bytes on stderr, saying what is written where, shown
only when stderr is a terminal and a label is given; the log lines stay for a pipe or a file; Engine.load(quiet=True)
prints nothing even on a terminal."""
from __future__ import annotations

import io
import sys

from loader import trained
from loader.progress import Progress


class FakeTTY(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _tty(monkeypatch) -> FakeTTY:
    """Make stderr a terminal for the rest of the test (in the test body: pytest's capture replaces sys.stderr
    again after fixture setup)."""
    err = FakeTTY()
    monkeypatch.setattr(sys, "stderr", err)
    return err


def test_progress_is_quiet_without_a_terminal(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    got = []
    with Progress(100, "tiny checkpoint -> /x", True) as bar:
        bar.update(100)
        bar.log(got.append, "a line")
    assert not bar.shown and got == ["a line"] and err.getvalue() == ""


def test_progress_shows_bytes_and_its_label_on_a_terminal(monkeypatch):
    tty = _tty(monkeypatch)
    got = []
    with Progress(2_000_000, "tiny checkpoint -> /x", True) as bar:
        assert bar.shown
        bar.update(1_000_000)
        bar.log(got.append, "a line")
        bar.update(1_000_000)
    out = tty.getvalue()
    assert got == ["a line"] and "tiny checkpoint -> /x" in out and "1.00M/2.00M" in out and "B/s" in out


def test_progress_not_asked_for_shows_nothing_on_a_terminal(monkeypatch):
    tty = _tty(monkeypatch)
    with Progress(100, "", False) as bar:
        bar.update(100)
    assert not bar.shown and tty.getvalue() == ""


def test_trained_expansion_bar_replaces_the_tensor_lines_on_a_terminal(tmp_path, monkeypatch):
    tty = _tty(monkeypatch)
    lines = []
    trained.ensure_checkpoint(trained.DEFAULT_MODEL, cache_dir=tmp_path, log=lines.append, progress=True)
    out = tty.getvalue()
    assert lines and lines[0].startswith(f"writing its checkpoint into {tmp_path / trained.DEFAULT_MODEL} (first use")
    assert not any("tensors" in line for line in lines)  # the bar instead
    assert f"{trained.DEFAULT_MODEL} -> {tmp_path / trained.DEFAULT_MODEL / 'model.safetensors'}" in out
    assert "B/s" in out


def test_trained_expansion_keeps_its_lines_without_a_terminal(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    lines = []
    trained.ensure_checkpoint(trained.DEFAULT_MODEL, cache_dir=tmp_path, log=lines.append, progress=True)
    assert lines[0].startswith("writing its checkpoint into") and lines[-1] == "160/181 tensors"
    assert sys.stderr.getvalue() == ""


def test_engine_load_quiet_prints_nothing_on_a_terminal(tmp_path, monkeypatch):
    from host.engine import Engine
    tty = _tty(monkeypatch)
    monkeypatch.setenv("QWEN_MK_CACHE", str(tmp_path))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    Engine.load(executor="cpu", quiet=True)
    assert (tmp_path / trained.DEFAULT_MODEL).is_dir()  # written on this first use
    assert tty.getvalue() == "" and out.getvalue() == ""
