"""The small Qwen3.5 trained by qwen-mk (``qwen3.5-tiny-trained``): its committed artefact and the expansion into a
checkpoint in exactly the real format.

The artefact (``loader/weights/qwen3.5-tiny-trained/``, written by ``tools/train/train.py``) holds:
- ``body_<i>.npz``: every tensor except the embedding and lm_head, by canonical name, as the checkpoint stores it
  (fp8 e4m3 bits as uint8 with their 128×128 ``*_scale_inv`` bf16 bits, the rest bf16 bits as uint16);
- ``embed.npz``: the compact tied vocabulary: ``ids`` int32 [K-2] (full ids of the rows 0..K-3), ``embed_e4m3``
  uint8 [K, H] and ``embed_exp`` int8 [K]: row r = e4m3(row) · 2^exp[r], exact in bf16; row K-2 is shared by every
  other text id, row K-1 is the padding rows' zero;
- ``manifest.json`` (config, corpus hashes, validation losses, acceptance), ``train_log.json`` (the run's log),
  ``CORPUS-LICENSE.txt`` (the PSF licence of the corpus).

Expansion (:func:`write_checkpoint`): ``embed_tokens`` and the untied ``lm_head`` both [248,320, H] bf16, equal:
a kept id's row, the shared row for every other id below 248,077, zero for the 243 padding ids. With this layout
the full softmax equals the training's compact softmax with its ``log(count)`` logit corrections (see
``tools/train/train.py``). One ``model.safetensors`` (~274 MB), config.json of the ``tiny`` shape, generation
config, the tokenizer files and qwen-mk's chat template (the one the training conversations were rendered with).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

from loader import tokenizer  # write_tokenizer_files looked up at the call: a test makes it fail
from loader.checkpoint import FP8, ST_NAMES, expected_tensors, stored_name
from loader.config import FIRST_PADDING_ID, ModelConfig, preset
from loader.progress import Progress
from loader.synthetic import GENERATION_CONFIG, config_json

WEIGHTS = Path(__file__).resolve().parent / "weights"
TRAINED: dict[str, str] = {"qwen3.5-tiny-trained": "tiny"}  # name -> the preset whose shape it has
DEFAULT_MODEL = "qwen3.5-tiny-trained"  # the model of generate / chat / Engine.load when none is given
STAMP = ".qwen-mk-trained"
WRITTEN_MB = 275  # the expanded checkpoint, derived: 2 × 248,320 × 256 × 2 B + the body
TEMPLATE_FIRST_LINE = "{#- qwen-mk's chat template for Qwen3.5 checkpoints (here: qwen3.5-tiny-trained), written from the rules of"


class TrainedModelError(RuntimeError):
    """The committed artefact is missing or inconsistent (a damaged installation)."""


def artefact_dir(name: str) -> Path:
    """Directory of trained model ``name``'s artefact. Raises KeyError listing the trained models."""
    if name not in TRAINED:
        raise KeyError(f"unknown trained model {name!r}; known: {', '.join(sorted(TRAINED))}")
    return WEIGHTS / name


def config(name: str) -> ModelConfig:
    """The ModelConfig of trained model ``name`` (its shape preset's, renamed)."""
    return preset(TRAINED[name]).replace(name=name)


def artefact_hash(name: str) -> str:
    """sha256 over the artefact's files and the code that expands it (this module, the format, the tokenizer)."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for p in sorted(artefact_dir(name).glob("*.npz")) + [here / f for f in (
            "trained.py", "checkpoint.py", "config.py", "tokenizer.py", "synthetic.py")] + [here / "templates" / "chat_template.jinja"]:
        h.update(p.name.encode() + (p.read_bytes() if p.is_file() else b"<absent>"))
    return h.hexdigest()


def _bits_to_array(bits: np.ndarray, dtype: str) -> np.ndarray:
    return bits.view(ml_dtypes.float8_e4m3fn if dtype == FP8 else ml_dtypes.bfloat16)


class _open_npz:
    """``np.load`` of an artefact file whose read errors (a cut or damaged archive) name the file."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        try:
            self.z = np.load(self.path)
        except (OSError, ValueError, zipfile.BadZipFile) as e:
            raise TrainedModelError(f"{self.path}: cannot be read ({e}); reinstall qwen-mk") from None
        return self

    @property
    def files(self) -> list[str]:
        return self.z.files

    def __getitem__(self, n: str) -> np.ndarray:
        try:
            return self.z[n]
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
            raise TrainedModelError(f"{self.path}: tensor {n!r} cannot be read ({e}); reinstall qwen-mk") from None

    def __exit__(self, *exc) -> None:
        self.z.close()


def load_tensors(name: str) -> dict[str, np.ndarray]:
    """Every tensor of the expanded checkpoint by canonical name, as stored (ml_dtypes bf16 / e4m3 arrays of the
    shapes of ``loader.checkpoint.expected_tensors``). Raises TrainedModelError naming the file and tensor when
    the artefact does not match the shape preset."""
    d = artefact_dir(name)
    cfg = config(name)
    exp = expected_tensors(cfg)
    out: dict[str, np.ndarray] = {}
    shards = sorted(d.glob("body_*.npz"))
    if not shards or not (d / "embed.npz").is_file():
        raise TrainedModelError(f"{d}: the artefact of {name!r} is incomplete (needs body_*.npz and embed.npz); "
                                "reinstall qwen-mk")
    for f in shards:
        with _open_npz(f) as z:
            for n in z.files:
                if n not in exp:
                    raise TrainedModelError(f"{f}: tensor {n!r} is not a tensor of the {TRAINED[name]!r} shape")
                shape, dt = exp[n]
                a = z[n]
                if a.shape != tuple(shape) or a.dtype != (np.uint8 if dt == FP8 else np.uint16):
                    raise TrainedModelError(f"{f}: tensor {n!r} is {a.dtype} {a.shape}, expected the bits of "
                                            f"{dt} {tuple(shape)}")
                out[n] = _bits_to_array(a, dt)
    with _open_npz(d / "embed.npz") as z:
        try:
            ids, q, k = z["ids"], z["embed_e4m3"], z["embed_exp"]
        except KeyError as e:
            raise TrainedModelError(f"{d / 'embed.npz'}: lacks {e}; reinstall qwen-mk") from None
    K, H = q.shape
    if H != cfg.hidden_size or ids.shape != (K - 2,) or k.shape != (K,):
        raise TrainedModelError(f"{d / 'embed.npz'}: ids {ids.shape}, embed_e4m3 {q.shape}, embed_exp {k.shape} do "
                                f"not form a compact vocabulary of hidden size {cfg.hidden_size}")
    rows = (q.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.exp2(k.astype(np.float32))[:, None])
    compact = rows.astype(ml_dtypes.bfloat16)
    if not np.array_equal(compact.astype(np.float32), rows):
        raise TrainedModelError(f"{d / 'embed.npz'}: embedding rows are not exact in bf16 (damaged artefact)")
    V = cfg.vocab_size
    full_idx = np.full(V, K - 2, dtype=np.int64)
    full_idx[ids] = np.arange(K - 2)
    full_idx[FIRST_PADDING_ID:] = K - 1
    full = compact[full_idx]
    out["model.embed_tokens.weight"] = full
    out["lm_head.weight"] = full.copy()
    missing = sorted(set(exp) - set(out))
    if missing:
        raise TrainedModelError(f"{d}: the artefact lacks {len(missing)} tensors, e.g. {missing[0]!r}")
    return out


def write_checkpoint(name: str, out_dir: str | Path, log=None, progress: str | None = None) -> dict:
    """Expand trained model ``name`` into ``out_dir`` (created): config.json, generation_config.json, one
    ``model.safetensors`` in the real format, tokenizer.json + tokenizer_config.json. ``log(str)`` gets progress
    lines (``i/N tensors``); ``progress`` (a label saying what is written where) shows a bar of the bytes on stderr
    instead when it is a terminal (``loader.progress``). Returns {"bytes", "tensors"}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config(name)
    tensors = load_tensors(name)
    exp = expected_tensors(cfg)
    names = list(exp)  # model order
    hdr, off = {"__metadata__": {"format": "pt", "qwen_mk_model": name}}, 0
    for n in names:
        nb = tensors[n].nbytes
        hdr[stored_name(cfg, n)] = {"dtype": ST_NAMES[exp[n][1]], "shape": list(exp[n][0]), "data_offsets": [off, off + nb]}
        off += nb
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(out / "model.safetensors", "wb") as fh, Progress(off, progress or "", progress is not None) as bar:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        for i, n in enumerate(names):
            fh.write(np.ascontiguousarray(tensors[n]).tobytes())
            bar.update(tensors[n].nbytes)
            if log and not bar.shown and (i + 1) % 40 == 0:
                log(f"{i + 1}/{len(names)} tensors")
    (out / "config.json").write_text(json.dumps(config_json(cfg), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    tmpl = tokenizer.TEMPLATE_PATH.read_text(encoding="utf-8").split("\n", 1)
    tokenizer.write_tokenizer_files(out, TEMPLATE_FIRST_LINE + "\n" + tmpl[1])
    return {"bytes": off + len(raw) + 8, "tensors": len(names)}


def ensure_checkpoint(name: str, cache_dir: str | Path | None = None, log=None, progress: bool = False) -> Path:
    """Path of the expanded checkpoint of trained model ``name`` in the cache (``<cache>/<name>``, cache =
    ``cache_dir`` or ``$QWEN_MK_CACHE`` or ``~/.cache/qwen-mk``), written on first use and rewritten when
    :func:`artefact_hash` changes. Concurrent callers are serialised by a file lock; written into a temporary
    sibling and renamed, so an error leaves no partial checkpoint (the temporary directory is removed). ``log(str)``
    gets a first line saying what is written where, then progress lines; ``progress``: a bar of the bytes written
    on stderr instead of those lines, when stderr is a terminal."""
    artefact_dir(name)
    root = Path(cache_dir or os.environ.get("QWEN_MK_CACHE") or Path.home() / ".cache" / "qwen-mk")
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    want = artefact_hash(name)

    def fresh() -> bool:
        st = final / STAMP
        return st.is_file() and st.read_text().strip() == want

    if fresh():
        return final
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if fresh():
            return final
        tmp = root / f".tmp-{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        if log:
            log(f"writing its checkpoint into {final} (first use; {WRITTEN_MB} MB, a few seconds)")
        try:
            label = f"{name} -> {final / 'model.safetensors'}" if progress else None
            write_checkpoint(name, tmp, log=log, progress=label)
            (tmp / STAMP).write_text(want + "\n")
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def manifest(name: str) -> dict:
    """The artefact's manifest.json (config, corpus, losses, acceptance)."""
    return json.loads((artefact_dir(name) / "manifest.json").read_text())


def size_bytes(name: str) -> int:
    """Bytes of the committed artefact's weight files."""
    return sum(p.stat().st_size for p in artefact_dir(name).glob("*.npz"))


__all__ = ["DEFAULT_MODEL", "TRAINED", "TrainedModelError", "artefact_dir", "artefact_hash", "config", "ensure_checkpoint",
           "load_tensors", "manifest", "size_bytes", "write_checkpoint"]
