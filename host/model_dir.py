"""Where ``Engine.load`` finds its model: a checkpoint directory, a trained model's name (expanded into the cache
once, ``loader.trained``) or a synthetic preset (a checkpoint written into the cache on the CPU; only config and
tokenizer files for a GPU executor, which draws the weights on the device), and the first-use cache directory."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from host.errors import EnvironmentIOError, ExecutorUnavailable, ModelLoadError
from host.executors import CPU_KINDS, cpu_too_large, gpu_available
from loader.config import PRESETS, preset
from loader.synthetic import GENERATION_CONFIG, STAMP, config_json
from loader.synthetic import ensure_checkpoint as ensure_synthetic
from loader.tokenizer import write_tokenizer_files
from loader.trained import DEFAULT_MODEL, TRAINED
from loader.trained import ensure_checkpoint as ensure_trained

# Start of the chat template ``loader.synthetic.write_checkpoint`` (``qwen-mk make-checkpoint``) puts in
# tokenizer_config.json (``loader/templates/chat_template.jinja``); a real checkpoint ships its own template.
SYNTHETIC_TEMPLATE_MARK = "qwen-mk's chat template for synthetic"


def synthetic_marker(d: Path) -> str | None:
    """How checkpoint directory ``d`` shows it holds synthetic weights written by ``loader.synthetic``, or None:
    the ``.qwen-mk-stamp`` file of a cached checkpoint (``ensure_checkpoint``), else qwen-mk's chat template in
    tokenizer_config.json (``write_checkpoint`` stores no other marker). Never raises: a file it cannot read is
    reported by the loader later."""
    if (d / STAMP).is_file():
        return f"{STAMP} of a cached synthetic checkpoint"
    try:
        tmpl = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(tmpl, str) and SYNTHETIC_TEMPLATE_MARK in tmpl[:200]:
        return "qwen-mk's synthetic chat template in tokenizer_config.json"
    return None


def _resolve_model(path_or_preset: str | Path | None, seed: int, quiet: bool, kind: str,
                   defaulted: bool) -> tuple[Path, str | None]:
    """(directory, preset) for a path, a trained model's name or a preset name. A trained model is expanded into
    the cache once (``loader.trained.ensure_checkpoint``) and returned as (directory, None). A preset's weights are
    synthetic: on the CPU the tiny
    checkpoint is written once into the cache and read back; on a GPU no weight file is written at all (the
    directory holds config and tokenizer files; the executor materialises the weights in GPU memory).
    A preset too large for the cpu executor (``cpu_too_large``) raises ExecutorUnavailable before anything is
    written: the preset is valid, the executor cannot run it (``defaulted``: the cpu executor was chosen because
    there is no GPU, and the message says so)."""
    if path_or_preset is None:
        path_or_preset = DEFAULT_MODEL
    p = Path(path_or_preset)
    if str(path_or_preset) in TRAINED and not p.is_dir():  # a trained model: expanded into the cache once
        name = str(path_or_preset)

        def log(msg: str) -> None:
            if not quiet:
                print(f"qwen-mk: {name}: {msg}", file=sys.stderr)
        return Path(ensure_trained(name, log=log, progress=not quiet)), None
    if str(path_or_preset) in PRESETS and not p.is_dir():
        name = str(path_or_preset)
        if kind not in CPU_KINDS:
            d = _synthetic_meta_dir(name, seed)
        elif (why := cpu_too_large(PRESETS[name])) is not None:
            if defaulted:
                raise ExecutorUnavailable(
                    f"preset {name!r} needs a GPU executor (graph or megakernel) and no GPU is usable here: "
                    f"{gpu_available()[1]}. On the CPU it {why}; use --preset tiny there.")
            raise ExecutorUnavailable(f"cpu executor: preset {name!r} {why}. Use --executor graph or megakernel on "
                                      "a GPU, or --preset tiny on the CPU.")
        else:
            d = Path(ensure_synthetic(name, seed=seed, progress=not quiet))
        if not quiet:
            print(f"qwen-mk: preset {name!r} uses SYNTHETIC random weights (seed {seed}, {d}): the text is "
                  "meaningless by design", file=sys.stderr)
        return d, name
    if not p.is_dir():
        raise ModelLoadError(f"model {str(path_or_preset)!r}: not a directory and not a preset "
                             f"(presets: {', '.join(sorted(PRESETS))})")
    mark = synthetic_marker(p)
    if mark and not quiet:  # as for a preset: a checkpoint from `qwen-mk make-checkpoint` is random too
        print(f"qwen-mk: model {p} holds SYNTHETIC random weights ({mark}): the text is meaningless by design",
              file=sys.stderr)
    return p, None


def cache_root() -> Path:
    """The first-use cache directory: ``$QWEN_MK_CACHE``, else ``~/.cache/qwen-mk`` (the loader's writers' rule)."""
    return Path(os.environ.get("QWEN_MK_CACHE") or Path.home() / ".cache" / "qwen-mk")


def cache_error(e: OSError) -> EnvironmentIOError:
    """The one-line error for an OSError met while writing the cache: it names the directory, the reason and
    the variable that moves it."""
    root = cache_root()
    why = e.strerror or str(e) or type(e).__name__
    if root.exists() and not root.is_dir():
        why = "it is a file, not a directory"
    elif e.filename and str(e.filename) != str(root):
        why += f" ({e.filename})"
    return EnvironmentIOError(f"cannot write the cache directory {root}: {why}; set QWEN_MK_CACHE to a writable "
                              "directory with room for the checkpoint")


def _synthetic_meta_dir(name: str, seed: int) -> Path:
    """Cache directory with the config, generation config and tokenizer files of a synthetic preset, and no
    weights (written once; ~15 MB)."""
    d = cache_root() / f"meta-{name}-seed{seed}"
    if not (d / "tokenizer_config.json").is_file():
        tmp = d.with_name(d.name + f".tmp{os.getpid()}")
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / "config.json").write_text(json.dumps(config_json(preset(name)), indent=2) + "\n")
            (tmp / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
            write_tokenizer_files(tmp)
            if d.exists():
                shutil.rmtree(d)
            tmp.rename(d)
        finally:  # a failed write (a full disk) leaves no partial directory
            shutil.rmtree(tmp, ignore_errors=True)
    return d


