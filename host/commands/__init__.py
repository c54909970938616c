"""CLI subcommands, one module each; ``host.cli`` registers every module listed in COMMANDS."""
