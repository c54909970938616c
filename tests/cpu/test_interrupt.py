"""Ctrl-C during ``qwen-mk make-checkpoint``: SIGINT to the parent process alone (as ``timeout -s INT`` sends it,
not to the process group) or to the process group (a terminal's Ctrl-C) ends the command within a bound, exit 130, one ``qwen-mk: error: interrupted`` line and
no traceback (none from the generator processes either), no generator process left running, and nothing in --out
or beside it. The same command without the signal writes the checkpoint (exit 0)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 20.0  # from SIGINT to exit: the workers' bounded join is 2 s each; the rest is cleanup on a busy machine


def _start(tmp_path: Path, group: bool = False) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QWEN_MK_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "host.cli", "make-checkpoint", "--preset", "tiny", "--out", str(out),
                             "--workers", "2"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=group)
    return proc, out


def _children(pid: int) -> list[int]:
    """The process's child pids (Linux /proc; empty where the kernel does not list them)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _gone(pid: int) -> bool:
    """The process has exited (absent, or a zombie waiting to be reaped by its new parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _temp_siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def _shard_started(out: Path) -> bool:
    """Whether the writer has begun a shard in its temporary directory (the worker pool is running)."""
    return any(f.stat().st_size > 0 for d in out.parent.glob(f".{out.name}.tmp-*") for f in d.glob("*.safetensors"))


def test_make_checkpoint_without_a_signal_succeeds(tmp_path):
    proc, out = _start(tmp_path)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert "wrote tiny checkpoint" in stdout and "Traceback" not in stderr
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors")) and not _temp_siblings(out)


@pytest.mark.parametrize("when,group", [(0.5, False), (2.0, False), ("mid-write", False), ("mid-write", True)],
                         ids=["import-0.5s", "start-2s", "mid-write", "mid-write-group"])
def test_make_checkpoint_ctrl_c_exits_130_and_leaves_nothing(tmp_path, when, group):
    """SIGINT to the parent only (``timeout -s INT``), or to its whole process group (Ctrl-C in a terminal: the
    generator processes get it too and must not print a traceback)."""
    proc, out = _start(tmp_path, group)
    t0 = time.monotonic()
    if when == "mid-write":  # the shard is being written by the worker pool: 1 s into it
        while not _shard_started(out):
            assert proc.poll() is None and time.monotonic() - t0 < 120, "the write never started a shard"
            time.sleep(0.05)
        time.sleep(1.0)
    else:
        time.sleep(when)
    assert proc.poll() is None, "the write ended before the signal (a faster machine: raise the delays)"
    workers = _children(proc.pid)
    if group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)  # the parent only, as `timeout -s INT` does
    t_sig = time.monotonic()
    try:
        stdout, stderr = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"no exit {BOUND_S:.0f} s after SIGINT; stderr:\n{stderr}")
    assert proc.returncode == 130, (proc.returncode, stderr)
    assert time.monotonic() - t_sig < BOUND_S
    assert "Traceback" not in stderr and "EOFError" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qwen-mk: error: interrupted"), stderr
    assert not out.exists() or not any(out.iterdir())
    assert not _temp_siblings(out)
    deadline = time.monotonic() + 5.0
    while not all(_gone(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(w) for w in workers), f"generator processes left running: {workers}"
