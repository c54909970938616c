"""Turn a training run's output into the committed artefact of ``loader/trained.py``.

    python3 -m tools.train.export --run DIR --corpus DIR [--eval DIR] --out loader/weights/qwen3.5-tiny-trained

Every body tensor is normalised to the checkpoint format of ``loader.checkpoint.expected_tensors``: a tensor the
format stores as e4m3 that arrives as bf16 is block-quantised here with the export rule of ``tools/train/train.py``
(per 128×128 block s = bf16(amax/448), q = e4m3(w/s), fp32 arithmetic, round to nearest even, saturating);
anything else must already have the format's dtype and shape. Writes ``body_<i>.npz`` shards (< 12 MiB),
``embed.npz`` (copied), ``train_log.json`` (copied) and ``manifest.json`` (config, corpus manifest and hashes,
the training run's evaluation, and the evaluation of the exported checkpoint from ``tools.train.evaluate`` when
``--eval`` is given).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from loader.checkpoint import FP8, SCALE_SUFFIX, expected_tensors
from loader.config import preset
from loader.synthetic import config_json

SHARD_BYTES = 12 << 20


def e4m3_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 bits uint8 [R, C], bf16 scale bits uint16 [R/128, C/128]) of float32 ``w`` [R, C]."""
    R, C = w.shape
    wb = w.reshape(R // 128, 128, C // 128, 128)
    amax = np.maximum(np.abs(wb).max(axis=(1, 3)), np.float32(1e-12))
    s = (amax / np.float32(448.0)).astype(ml_dtypes.bfloat16)
    q = np.clip(wb / s.astype(np.float32)[:, None, :, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(R, C).view(np.uint8), s.view(np.uint16)


def normalise(body: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Body tensors in the checkpoint's dtypes; returns (tensors, names quantised here)."""
    exp = expected_tensors(preset("tiny"))
    out, quantised = {}, []
    for n, a in body.items():
        shape, dt = exp[n]
        if dt == FP8 and a.dtype == np.uint16:
            out[n], out[n + SCALE_SUFFIX] = e4m3_blocks(a.view(ml_dtypes.bfloat16).astype(np.float32))
            quantised.append(n)
        elif not n.endswith(SCALE_SUFFIX) or n not in out:
            out[n] = a
    return out, quantised


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="build the trained model's artefact")
    ap.add_argument("--run", type=Path, required=True, help="output directory of tools.train.train")
    ap.add_argument("--corpus", type=Path, required=True, help="directory of tools.train.corpus")
    ap.add_argument("--eval", type=Path, default=None, help="output directory of tools.train.evaluate")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    body: dict[str, np.ndarray] = {}
    for f in sorted(a.run.glob("body_*.npz")):
        with np.load(f) as z:
            body.update({n: z[n] for n in z.files})
    body, quantised = normalise(body)
    a.out.mkdir(parents=True, exist_ok=True)
    for old in a.out.glob("body_*.npz"):
        old.unlink()
    shards, cur, size = [], {}, 0
    for n, v in body.items():
        if cur and size + v.nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[n], size = v, size + v.nbytes
    shards.append(cur)
    for i, sh in enumerate(shards):
        np.savez_compressed(a.out / f"body_{i}.npz", **sh)
    for f in ("embed.npz", "train_log.json"):
        if (a.run / f).resolve() != (a.out / f).resolve():
            shutil.copyfile(a.run / f, a.out / f)
    log = json.loads((a.run / "train_log.json").read_text())
    cm = json.loads((a.corpus / "manifest.json").read_text())
    man = {
        "name": "qwen3.5-tiny-trained",
        "what": "a small Qwen3.5 (the tiny preset's shape: hidden 256, 8 layers LLLF LLLF, 1 MTP layer) trained by "
                "qwen-mk on the CPython standard library, the CPython documentation and seeded tool-use "
                "conversations; a small model: its text is plausible in form, often wrong in substance",
        "config": config_json(preset("tiny"))["text_config"],
        "licence": "weights trained on PSF-licensed text (CORPUS-LICENSE.txt) and on generated conversations",
        "corpus": {k: cm[k] for k in ("deb", "deb_sha256", "python", "split_rule", "tokens", "corpus_npz_sha256")}
                  | {"sources": {s: {k: v for k, v in d.items() if k != "val_files"} for s, d in cm["sources"].items()},
                     "val_files": {s: d.get("val_files", []) for s, d in cm["sources"].items()}},
        "training": {k: log[k] for k in ("seed", "args", "versions", "params", "vocab", "steps", "tokens_seen",
                                         "train_seconds", "tokens_per_s")},
        "quantised_at_export": quantised,
        "eval_training_run": log["eval"],
        "files_sha256": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(a.out.glob("*.npz"))},
    }
    if a.eval is not None:
        man["eval_exported_checkpoint"] = json.loads((a.eval / "eval.json").read_text())
    (a.out / "manifest.json").write_text(json.dumps(man, indent=1) + "\n")
    print(json.dumps({"quantised": quantised, "shards": len(shards),
                      "bytes": sum(p.stat().st_size for p in a.out.glob("*.npz"))}))


if __name__ == "__main__":
    main()
