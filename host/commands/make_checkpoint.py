"""``qwen-mk make-checkpoint``: write a synthetic checkpoint in the real Qwen3.5-FP8 format (loader.synthetic).

The checkpoint is written into a temporary sibling directory of OUT (``.<name>.tmp-<pid>``) and renamed into
place when complete, so OUT never holds a half-written checkpoint (an error or Ctrl-C removes the temporary
directory). Ctrl-C (SIGINT, to the process group or to this process alone) stops the generator processes and
exits 130 with one line, ``qwen-mk: error: interrupted: nothing was written to --out OUT``. An OUT that exists and is not empty is refused unless ``--force`` replaces it.

``--max-shards N`` writes a partial checkpoint on purpose (for timing the writer): only the first N shards, but
the index maps every tensor to its planned shard and marks the write partial (``metadata.qwen_mk_partial``), so
loading it fails (exit 6) with an "incomplete checkpoint" error naming the absent shard files."""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import click

from loader.config import PRESETS, preset
from host import gpu_checkpoint  # its functions looked up at the call: a test replaces gpu_usable
from host.errors import ExecutorUnavailable, GenerationInterrupted
from loader.synthetic import MAX_SHARD_BYTES, sigint_ignored, write_checkpoint

INTERRUPTED = GenerationInterrupted.exit_code  # 130, README's exit code of an interrupt (Ctrl-C)


def _remove(p: Path) -> None:
    if p.is_symlink() or p.is_file():
        p.unlink()
    elif p.exists():
        shutil.rmtree(p, ignore_errors=True)


def _looks_like_checkpoint(entries: list[str]) -> bool:
    """Whether a directory's entries are a checkpoint's (what --force may replace): a config.json or a
    safetensors file / index among them."""
    return any(e == "config.json" or e.endswith((".safetensors", ".safetensors.index.json")) for e in entries)


def _out_error(msg: str) -> click.ClickException:
    """An --out the command cannot write to (below a file, no permission, read-only): a bad argument, exit 2
    (README's exit codes)."""
    e = click.ClickException(msg)
    e.exit_code = 2
    return e


def _generator(device: str, workers: int):
    """(write_checkpoint's ``generate``, where the tensors are drawn, in words) for ``--device``. ``gpu`` without a
    usable GPU is an error (exit 3, as an executor that cannot run here); ``auto`` falls back to the CPU."""
    if device == "cpu":
        return None, f"on the CPU, {workers} process(es)"
    ok, why = gpu_checkpoint.gpu_usable()
    if ok:
        return gpu_checkpoint.gpu_chunks, f"on the GPU ({why})"
    if device == "gpu":
        e = click.ClickException(f"--device gpu: {why}; use --device cpu (NumPy, --workers processes)")
        e.exit_code = ExecutorUnavailable.exit_code
        raise e
    return None, f"on the CPU, {workers} process(es)"


@click.command(name="make-checkpoint")
@click.option("--preset", "preset_name", type=click.Choice(sorted(PRESETS)), required=True, help="model preset")
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="output directory (created; refused when it exists and is not empty, unless --force)")
@click.option("--force", is_flag=True, help="replace a previous checkpoint in OUT (a directory with a config.json "
              "or *.safetensors; anything else is refused): everything in it is deleted once the new checkpoint is "
              "complete")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="generator seed")
@click.option("--shard-bytes", type=click.IntRange(min=1), default=MAX_SHARD_BYTES, show_default=True,
              help="largest shard size in bytes")
@click.option("--max-shards", type=click.IntRange(min=1), default=None,
              help="write only the first N shards (for timing the writer): the result is a PARTIAL checkpoint "
              "that cannot be loaded; its index still lists every shard and is marked partial, so --model OUT "
              "fails (exit 6) naming the missing shard files")
@click.option("--workers", type=click.IntRange(min=1), default=min(8, os.cpu_count() or 1), show_default=True,
              help="generator processes")
@click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True,
              help="where the tensors are drawn: gpu (on the device, then streamed to disk; the same bits), cpu "
              "(NumPy in --workers processes), auto = gpu when one is usable, else cpu")
@click.option("--no-tokenizer", is_flag=True, help="do not write tokenizer files")
def command(preset_name: str, out: str, force: bool, seed: int, shard_bytes: int, max_shards: int | None,
            workers: int, device: str, no_tokenizer: bool) -> None:
    """Write a synthetic checkpoint (config, generation config, safetensors shards + index, tokenizer) to OUT."""
    generate, drawn = _generator(device, workers)
    for a in Path(out).parents:  # the nearest existing ancestor must be a directory
        if a.exists() or a.is_symlink():
            if not a.is_dir():
                raise _out_error(f"cannot write the checkpoint to --out {out}: {a} is not a directory")
            break
    dest = Path(os.path.realpath(out))  # a symlinked OUT: write where it points
    if not dest.name:
        raise click.BadParameter(f"{out!r} is the file-system root; give a directory below it", param_hint="--out")
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"

    def shown(filename) -> str:
        """A path of an OSError as the user knows it: inside the temporary directory -> inside OUT."""
        f = os.fsdecode(filename)
        if f == str(tmp) or f.startswith(str(tmp) + os.sep):
            f = os.path.join(out, os.path.relpath(f, tmp))
        return f

    def fail(e: OSError) -> click.ClickException:
        where = shown(e.filename) if e.filename else None
        same = where is None or os.path.normpath(where) in (os.path.normpath(out), str(dest))
        msg = f"cannot write the checkpoint to --out {out}: {e.strerror or e}" + ("" if same else f" ({where})")
        # a path the user cannot write to is a bad argument (exit 2); a full disk or an I/O error is not (exit 1)
        return _out_error(msg) if e.errno in (errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EROFS) \
            else click.ClickException(msg)

    try:
        entries = sorted(p.name for p in dest.iterdir()) if dest.is_dir() else []
    except OSError as e:
        raise fail(e) from None
    if entries and not force:
        raise click.BadParameter(f"directory {out} is not empty ({len(entries)} entries, e.g. {entries[0]!r}); "
                                 "pass --force to replace it", param_hint="--out")
    if entries and not _looks_like_checkpoint(entries):  # --force never deletes a directory of other things
        raise click.BadParameter(f"directory {out} does not look like a checkpoint (no config.json or "
                                 f"*.safetensors among its {len(entries)} entries, e.g. {entries[0]!r}); --force "
                                 "replaces only a previous checkpoint: choose an empty or new directory",
                                 param_hint="--out")
    try:
        try:
            res = write_checkpoint(preset(preset_name), tmp, seed, tokenizer="skip" if no_tokenizer else "require",
                                   max_shard_bytes=shard_bytes, max_shards=max_shards, workers=workers,
                                   log=click.echo, progress=f"{preset_name} checkpoint -> {out}", generate=generate)
        except RuntimeError as e:  # the tokenizer writer is unavailable
            raise click.ClickException(f"cannot write the checkpoint to --out {out}: {e}") from None
        with sigint_ignored():  # the renames are not broken off half-way by Ctrl-C
            if entries:  # --force: move the old directory aside, the new one in, then delete the old one
                old = dest.parent / f".{dest.name}.old-{os.getpid()}"
                os.rename(dest, old)
                try:
                    os.rename(tmp, dest)
                except OSError:
                    os.rename(old, dest)
                    raise
                _remove(old)
            else:  # absent or empty: one rename (replaces an empty directory; fails if OUT filled up meanwhile)
                os.rename(tmp, dest)
    except OSError as e:  # unwritable or full destination: one line naming the path, non-zero exit
        raise fail(e) from None
    except KeyboardInterrupt:  # Ctrl-C: the workers are stopped (loader.synthetic); exit 130, one line
        e = click.ClickException(f"interrupted: nothing was written to --out {out}")
        e.exit_code = INTERRUPTED
        raise e from None
    finally:
        with sigint_ignored():  # a second Ctrl-C cannot leave the temporary directory behind
            _remove(tmp)
    planned = res.get("total_shards", res["shards"])
    partial = res["shards"] < planned
    shards = f"{res['shards']} of {planned} shards" if partial else f"{res['shards']} shard(s)"
    click.echo(f"wrote {'PARTIAL ' if partial else ''}{preset_name} checkpoint (seed {seed}) to {out}: {shards}, "
               f"{res['bytes'] / 1e9:.3f} GB of tensors in {res['seconds']:.1f} s "
               f"({res['bytes'] / 1e6 / max(res['seconds'], 1e-9):.0f} MB/s; drawn {drawn})")
    if partial:
        click.echo(f"qwen-mk: warning: --max-shards {max_shards} left out {planned - res['shards']} of {planned} "
                   f"shards: {out} is an incomplete checkpoint, which the loader refuses (for timing the writer "
                   "only)", err=True)
