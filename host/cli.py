"""The ``qwen-mk`` command line. Each subcommand lives in its own module under ``host.commands`` and
exposes a click command named ``command``; modules that are missing or fail to import are reported, not
hidden."""
from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

import click

from host.errors import ERROR, EnvironmentIOError
from host.stdout_guard import StdoutClosed, StdoutError, detach_stdout, guarded_stdout

# module name under host.commands -> subcommand name
COMMANDS = {
    "make_checkpoint": "make-checkpoint",
    "inspect_cmd": "inspect",
    "generate": "generate",
    "chat": "chat",
    "compare": "compare",
    "bench": "bench",
    "serve": "serve",
}


def _version() -> str:
    """The installed package's version, else the source tree's pyproject.toml version."""
    from importlib import metadata  # deferred: ~70 ms, and only --version reads it
    try:
        return metadata.version("qwen-mk")
    except metadata.PackageNotFoundError:
        try:
            with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
                return tomllib.load(f)["project"]["version"] + " (source tree)"
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


def _print_version(ctx: click.Context, _param, value: bool) -> None:
    if value and not ctx.resilient_parsing:  # looked up only when asked: every other command starts faster
        click.echo(f"qwen-mk, version {_version()}")
        ctx.exit()


class Main(click.Group):
    """The command group, with one rule for error output (README, exit codes). A usage error
    (``click.UsageError``: an unknown option, a value of the wrong type or outside the option's declared range,
    conflicting options, no prompt) prints click's usage line, a ``Try ... -h`` line and ``Error: ...`` (exit 2).
    Every other error prints one line ``qwen-mk: error: ...`` on stderr (as warnings print ``qwen-mk:
    warning:``): the engine's errors (values its shared checks refuse included) through
    ``host.commands.generate.handle_errors``, and here any other ``click.ClickException`` a command raises
    (make-checkpoint's unwritable --out, inspect --timings without a GPU), with its exit code. A stdout closed by
    its reader (BrokenPipeError: ``| head -1``) ends the command quietly with exit 0; a stdout that cannot be
    written (a full device: ``> /dev/full``) is one error line naming stdout (``EnvironmentIOError``, exit 8).
    Ctrl-C (KeyboardInterrupt) that no command handled prints ``qwen-mk: error: interrupted`` and exits 130."""

    def main(self, *args, **kwargs):
        """click's main with stdout guarded (``host.stdout_guard``) for the whole run, --help and --version
        included."""
        with guarded_stdout():
            try:
                return super().main(*args, **kwargs)
            except StdoutClosed:  # stdout closed by its reader (`| head -1`): end quietly, as coreutils do
                detach_stdout()
                sys.exit(0)
            except StdoutError as e:
                detach_stdout()
                click.echo(f"{ERROR} cannot write to stdout: {e.reason}", err=True)
                sys.exit(EnvironmentIOError.exit_code)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError:
            raise
        except click.ClickException as e:
            click.echo(f"{ERROR} {e.format_message()}", err=True)
            ctx.exit(e.exit_code)
        except KeyboardInterrupt:  # not click's "Aborted!" (exit 1): README's 130
            _interrupted()


@click.group(cls=Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the version and exit.")
def main() -> None:
    """qwen-mk: batch-1 inference for Qwen3.5-27B-FP8 (megakernel, CUDA graph, or CPU VM)."""


def _register() -> None:
    for mod, name in COMMANDS.items():
        try:
            m = importlib.import_module(f"host.commands.{mod}")
        except ModuleNotFoundError as e:
            if e.name == f"host.commands.{mod}":
                continue  # not built yet
            raise
        main.add_command(m.command, name=name)


def _interrupted() -> None:
    """Ctrl-C outside a command's own handling (while the commands import, say): one line, exit 130."""
    click.echo(f"{ERROR} interrupted", err=True)
    sys.exit(130)  # host.errors.GenerationInterrupted.exit_code, README's exit codes


def _by_interrupt(e: BaseException | None) -> bool:
    """Whether ``e`` is a KeyboardInterrupt or was raised while handling one (an extension module's import that
    Ctrl-C broke off re-raises it as ImportError)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


try:
    _register()
except BaseException as e:  # noqa: BLE001 - re-raised unless Ctrl-C caused it
    if not _by_interrupt(e):
        raise
    _interrupted()

if __name__ == "__main__":
    main()
