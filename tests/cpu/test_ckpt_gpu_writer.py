"""The GPU checkpoint writer's plumbing without a GPU (``host.gpu_checkpoint.gpu_chunks`` through
``loader.synthetic.write_checkpoint(generate=...)``): with a stand-in for ``discrete.synthetic_gpu.fill`` that hands
out NumPy's bits, every file it writes is byte for byte the file the NumPy writer writes in worker processes; a
generator whose bytes do not add up is refused; ``make-checkpoint --device`` picks the generator (the device's own
bits are checked against NumPy's in tests/gpu/test_synthetic_gpu.py and by bench/bench_load.py)."""
from __future__ import annotations

import filecmp

import numpy as np
import pytest
from click.testing import CliRunner

from host.cli import main
from host.gpu_checkpoint import gpu_chunks
from loader.checkpoint import FP8, Checkpoint
from loader.config import preset
from loader.synthetic import write_checkpoint

TINY = preset("tiny")
SHARD = 40_000_000


class _Host:
    """What a device array offers gpu_chunks: ``.get()`` -> host array."""

    def __init__(self, a: np.ndarray):
        self.a = a

    def get(self) -> np.ndarray:
        return self.a


def numpy_fill(src, name):
    """discrete.synthetic_gpu.fill's contract (uint16 bf16 bits; (uint8 payload, uint16 scale) for fp8), from NumPy."""
    if src.recipe(name).dtype == FP8:
        q, s = src.quantized(name)
        return _Host(q.view(np.uint8)), _Host(s.view(np.uint16))
    return _Host(src.get(name).view(np.uint16))


def test_device_writer_files_equal_the_numpy_writer_files(tmp_path):
    a, b = tmp_path / "numpy", tmp_path / "device"
    ra = write_checkpoint(TINY, a, 0, tokenizer="skip", max_shard_bytes=SHARD, workers=2)
    rb = write_checkpoint(TINY, b, 0, tokenizer="skip", max_shard_bytes=SHARD, workers=2,
                          generate=lambda src, names: gpu_chunks(src, names, fill=numpy_fill))
    assert ra["bytes"] == rb["bytes"] and ra["shards"] == rb["shards"] >= 3
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors and len(match) == len(names)
    Checkpoint.open(b)


def test_a_generator_with_the_wrong_byte_count_is_refused(tmp_path):
    def drop_last(src, names):
        yield from list(gpu_chunks(src, names, fill=numpy_fill))[:-1]
    with pytest.raises(RuntimeError, match=r"the generator gave \d+ bytes, the header says \d+"):
        write_checkpoint(TINY, tmp_path / "x", 0, tokenizer="skip", generate=drop_last)


def test_a_scale_before_its_weight_is_refused():
    from loader.synthetic import SyntheticWeights
    n = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="comes before its weight"):
        list(gpu_chunks(SyntheticWeights(TINY), [n + "_scale_inv", n], fill=numpy_fill))


def test_make_checkpoint_device_option(tmp_path, monkeypatch):
    import host.gpu_checkpoint as gc
    monkeypatch.setattr(gc, "gpu_usable", lambda: (False, "no NVIDIA GPU was found (test)"))
    r = CliRunner().invoke(main, ["make-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "g"),
                                  "--no-tokenizer", "--device", "gpu"])
    assert r.exit_code == 7 and "--device gpu: no NVIDIA GPU was found (test); use --device cpu" in r.output, r.output
    assert not (tmp_path / "g").exists()
    seen = {}

    def fake(cfg, out, seed, **kw):
        seen.update(kw)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return {"seconds": 0.1, "bytes": 16, "shards": 1, "total_shards": 1, "tokenizer": False}
    import host.commands.make_checkpoint as mc
    monkeypatch.setattr(mc, "write_checkpoint", fake)
    r = CliRunner().invoke(main, ["make-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "a"),
                                  "--no-tokenizer", "--workers", "2"])  # auto without a GPU: NumPy
    assert r.exit_code == 0 and seen["generate"] is None and "drawn on the CPU, 2 process(es)" in r.output, r.output
    monkeypatch.setattr(gc, "gpu_usable", lambda: (True, "NVIDIA H200 (test)"))
    r = CliRunner().invoke(main, ["make-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "b"),
                                  "--no-tokenizer"])  # auto with a GPU: drawn there
    assert r.exit_code == 0 and seen["generate"] is gc.gpu_chunks and "drawn on the GPU (NVIDIA H200 (test))" in \
        r.output, r.output
    r = CliRunner().invoke(main, ["make-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "c"),
                                  "--no-tokenizer", "--device", "cpu"])
    assert r.exit_code == 0 and seen["generate"] is None, r.output
