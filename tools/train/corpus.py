"""Build the training corpus of the small model: reproducible, redistributable, recorded by sha256.

Sources (both under the PSF licence, which allows redistributing a model trained on them):
- ``code``: the CPython standard library source of this machine's Python (``sysconfig`` stdlib, ``*.py``
  decodable as UTF-8, at most ``MAX_FILE_BYTES``; ``site-packages`` / ``dist-packages`` excluded);
- ``docs``: the CPython documentation sources (``_sources/**/*.rst.txt``) of Debian's ``python3.X-doc`` package,
  unpacked with ``dpkg-deb`` from the given ``.deb`` (no root needed);
- ``tools``: seeded conversations from :mod:`tools.train.conversations` (train seed 1, validation seed 2).

Validation split by file: a file is held out when ``sha256(relative path) % 50 == 0`` (2 %). Documents are
tokenised with the engine's tokenizer (``loader.tokenizer.Tokenizer.synthetic``: the real Qwen3.5 vocabulary)
and concatenated per split, each followed by ``<|endoftext|>`` (id 248044). Writes ``corpus.npz`` (int32 id
arrays ``train_code``, ``train_docs``, ``train_tools``, ``val_code``, ``val_docs``, ``val_tools``) and
``text_config.json`` (the ``tiny`` preset's text config, read by the trainer)
and ``manifest.json`` (per-source file lists with sha256, the .deb's sha256, token counts, the seeds).

    python3 -m tools.train.corpus --deb /var/cache/apt/archives/python3.11-doc_*.deb --out DIR
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from loader.config import preset
from loader.synthetic import config_json
from loader.tokenizer import Tokenizer
from tools.train import conversations

MAX_FILE_BYTES = 400_000
EOT = 248044
N_TRAIN_CONV, N_VAL_CONV = 10000, 500
TRAIN_SEED, VAL_SEED = 1, 2


def held_out(rel: str) -> bool:
    """Whether the file at relative path ``rel`` belongs to the validation split."""
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 50 == 0


def _stdlib_files() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel or p.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            out.append((rel, p.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def _doc_files(deb: Path, tmp: Path) -> list[tuple[str, str]]:
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True)
    srcs = sorted(tmp.glob("usr/share/doc/python3*/html/_sources"))
    if not srcs:
        raise SystemExit(f"{deb}: no usr/share/doc/python3*/html/_sources in the package")
    out = []
    for p in sorted(srcs[0].rglob("*.rst.txt")):
        out.append((p.relative_to(srcs[0]).as_posix(), p.read_text(encoding="utf-8")))
    return out


def _tokens(tok, texts: list[str]) -> np.ndarray:
    ids: list[int] = []
    for i in range(0, len(texts), 256):
        for seq in tok.encode_batch(texts[i:i + 256]):
            ids.extend(seq)
            ids.append(EOT)
    return np.asarray(ids, dtype=np.int32)


def build(deb: Path, out: Path) -> dict:
    """Build the corpus into ``out``; returns the manifest dict."""
    t0 = time.perf_counter()
    tok = Tokenizer.synthetic()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"code": _stdlib_files(), "docs": _doc_files(deb, Path(tmp))}
    arrays, man = {}, {"deb": deb.name, "deb_sha256": hashlib.sha256(deb.read_bytes()).hexdigest(),
                       "python": sys.version.split()[0], "stdlib": sysconfig.get_paths()["stdlib"],
                       "split_rule": "sha256(relative path) % 50 == 0 -> validation", "sources": {}}
    for name, files in sources.items():
        tr = [t for r, t in files if not held_out(r)]
        va = [t for r, t in files if held_out(r)]
        arrays[f"train_{name}"], arrays[f"val_{name}"] = _tokens(tok, tr), _tokens(tok, va)
        man["sources"][name] = {"files": len(files), "val_files": [r for r, _ in files if held_out(r)],
                                "sha256": hashlib.sha256(b"".join(
                                    r.encode() + b"\0" + hashlib.sha256(t.encode()).digest()
                                    for r, t in files)).hexdigest()}
    tr, va = conversations.generate(N_TRAIN_CONV, TRAIN_SEED), conversations.generate(N_VAL_CONV, VAL_SEED)
    arrays["train_tools"], arrays["val_tools"] = _tokens(tok, tr), _tokens(tok, va)
    man["sources"]["tools"] = {"train_conversations": N_TRAIN_CONV, "val_conversations": N_VAL_CONV,
                               "seeds": [TRAIN_SEED, VAL_SEED],
                               "sha256": hashlib.sha256("".join(tr + va).encode()).hexdigest()}
    np.savez_compressed(out / "corpus.npz", **arrays)
    man["tokens"] = {k: int(v.size) for k, v in arrays.items()}
    man["corpus_npz_sha256"] = hashlib.sha256((out / "corpus.npz").read_bytes()).hexdigest()
    man["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "manifest.json").write_text(json.dumps(man, indent=1) + "\n")
    (out / "text_config.json").write_text(json.dumps(config_json(preset("tiny"))["text_config"], indent=1) + "\n")
    return man


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deb", type=Path, required=True, help="the python3.X-doc .deb")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if not a.deb.is_file():
        raise SystemExit(f"--deb {a.deb}: no such file")
    m = build(a.deb, a.out)
    print(json.dumps({"tokens": m["tokens"], "seconds": m["seconds"]}))


if __name__ == "__main__":
    main()
