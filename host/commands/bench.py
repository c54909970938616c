"""``qwen-mk bench``: run the benchmark suite, one ``bench/bench_*.py`` module per subprocess; ``qwen-mk bench
replay ARGS...``: the agent-trajectory replay (``python3 -m bench.replay ARGS...``, docs/replay.md).

The modules are written by the kernel helpers and write JSON under ``bench/results/``; this command only
finds them, checks for a GPU and runs them in order (``python3 -m bench.<name>``), so a crash in one does
not hide the others. ``--list`` works without a GPU; so does ``replay`` (its cpu executor needs none).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import click

from host.commands.generate import ERROR
from host.errors import ExecutorUnavailable
from host.executors import gpu_available

ROOT = Path(__file__).resolve().parents[2]


def find_benchmarks(root: Path = ROOT) -> list[str]:
    """Module names ``bench_*`` under ``root/bench``, sorted."""
    return sorted(p.stem for p in (root / "bench").glob("bench_*.py"))


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--list", "list_only", is_flag=True, help="List the benchmark modules and exit.")
@click.option("--only", multiple=True, help="Run only these modules (repeatable), e.g. bench_gemv.")
@click.option("--timeout", type=click.IntRange(min=1), default=1800, show_default=True,
              help="Seconds per module (at least 1).")
@click.argument("sub", nargs=-1, type=click.UNPROCESSED)
def command(list_only, only, timeout, sub):
    """Run the GPU benchmarks (bench/bench_*.py) and report which passed; `qwen-mk bench replay ARGS...` runs the
    agent-trajectory replay (python3 -m bench.replay ARGS..., `qwen-mk bench replay --help`)."""
    if sub:
        if sub[0] != "replay":
            raise click.UsageError(f"unknown subcommand {sub[0]!r}; expected 'replay' (or options only)")
        from bench.replay import main as replay_main  # bench/ is not imported unless asked for
        sys.exit(replay_main(list(sub[1:])))
    names = find_benchmarks()
    if list_only:
        click.echo("\n".join(names) if names else "no benchmark modules in bench/")
        return
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise click.UsageError(f"unknown benchmark(s) {', '.join(unknown)}; found: {', '.join(names) or 'none'}")
    ok, why = gpu_available()
    if not ok:
        click.echo(f"{ERROR} the benchmarks need an NVIDIA GPU: {why}; modules found: "
                   f"{', '.join(names) or 'none'}", err=True)
        sys.exit(ExecutorUnavailable.exit_code)
    if not names:
        click.echo(f"{ERROR} no benchmark modules (bench/bench_*.py) exist yet", err=True)
        sys.exit(1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    failed = []
    for n in (list(only) or names):
        click.echo(f"== {n} ({why})", err=True)
        t = time.perf_counter()
        try:
            rc = subprocess.run([sys.executable, "-m", f"bench.{n}"], cwd=ROOT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        click.echo(f"== {n}: exit {rc} in {time.perf_counter() - t:.1f} s", err=True)
        if rc:
            failed.append(n)
    if failed:
        click.echo(f"{ERROR} failed: {', '.join(failed)}", err=True)
        sys.exit(1)
