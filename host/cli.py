"""The ``qwen-mk`` command line. Each subcommand lives in its own module under ``host.commands`` and
exposes a click command named ``command``; modules that are missing or fail to import are reported, not
hidden."""
from __future__ import annotations

import importlib

import click

# module name under host.commands -> subcommand name
COMMANDS = {
    "make_checkpoint": "make-checkpoint",
    "inspect_cmd": "inspect",
    "generate": "generate",
    "chat": "chat",
    "compare": "compare",
    "bench": "bench",
}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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


_register()

if __name__ == "__main__":
    main()
