"""``qwen-mk make-checkpoint``: write a synthetic checkpoint in the real Qwen3.5-FP8 format (loader.synthetic)."""
from __future__ import annotations

import os

import click

from loader.config import PRESETS, preset
from loader.synthetic import MAX_SHARD_BYTES, write_checkpoint


@click.command(name="make-checkpoint")
@click.option("--preset", "preset_name", type=click.Choice(sorted(PRESETS)), required=True, help="model preset")
@click.option("--out", type=click.Path(file_okay=False), required=True, help="output directory (created)")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="generator seed")
@click.option("--shard-bytes", type=click.IntRange(min=1), default=MAX_SHARD_BYTES, show_default=True,
              help="largest shard size in bytes")
@click.option("--max-shards", type=click.IntRange(min=1), default=None,
              help="stop after this many shards (partial write, for timing; the result is incomplete)")
@click.option("--workers", type=click.IntRange(min=1), default=min(8, os.cpu_count() or 1), show_default=True,
              help="generator processes")
@click.option("--no-tokenizer", is_flag=True, help="do not write tokenizer files")
def command(preset_name: str, out: str, seed: int, shard_bytes: int, max_shards: int | None, workers: int,
            no_tokenizer: bool) -> None:
    """Write a synthetic checkpoint (config, generation config, safetensors shards + index, tokenizer) to OUT."""
    try:
        res = write_checkpoint(preset(preset_name), out, seed, tokenizer="skip" if no_tokenizer else "require",
                               max_shard_bytes=shard_bytes, max_shards=max_shards, workers=workers,
                               log=click.echo)
    except OSError as e:  # unwritable or full destination: one line naming the path, non-zero exit
        raise click.ClickException(f"cannot write the checkpoint to --out {out}: {e.strerror or e} "
                                   f"({e.filename or out})") from None
    done = "partial " if max_shards else ""
    click.echo(f"wrote {done}{preset_name} checkpoint (seed {seed}) to {out}: {res['shards']} shard(s), "
               f"{res['bytes'] / 1e9:.3f} GB of tensors in {res['seconds']:.1f} s "
               f"({res['bytes'] / 1e6 / max(res['seconds'], 1e-9):.0f} MB/s)")
