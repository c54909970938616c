"""Bad files at the 27B's shapes, without 29 GB of writes: ``qwen-mk make-checkpoint --preset qwen3.5-27b`` with its
data sections written sparse (a seek to the end of each: real headers, index and config, zero bytes that take no
disk), then shards cut short, removed, or re-headed with one wrong dtype or shape; and a disk that fills while the
27B is written over an existing checkpoint (ENOSPC from the writer: the target is left as it was)."""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from loader import synthetic
from loader.checkpoint import INDEX_FILE, Checkpoint, CheckpointError, expected_tensors
from loader.config import preset
from tests.helpers import run

PRESET = "qwen3.5-27b"


def _sparse_write(fail_at: int | None = None):
    """A stand-in for ``loader.synthetic._write_data``: the shard's data section as a hole of the right length;
    the ``fail_at``-th shard (0-based) raises ENOSPC after a partial write instead."""
    calls = []

    def write(src, names, fh, pool, step=None, generate=None):
        exp = expected_tensors(src.config)
        want = sum(math.prod(exp[n][0]) * np.dtype(getattr(ml_dtypes, exp[n][1])).itemsize for n in names)
        calls.append(names[0])
        if fail_at is not None and len(calls) - 1 == fail_at:
            fh.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fh.seek(want - 1, os.SEEK_CUR)
        fh.write(b"\0")
        if step:
            step(want)
        return want
    return write, calls


def _make(out: Path, *extra) -> object:
    return run(["make-checkpoint", "--preset", PRESET, "--out", str(out), "--device", "cpu", "--workers", "1",
                "--no-tokenizer", *extra])


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """The sparse 27B checkpoint directory (written once per module)."""
    d = tmp_path_factory.mktemp("ck27") / "qwen27"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(synthetic, "_write_data", _sparse_write()[0])
        r = _make(d)
    assert r.exit_code == 0, (r.output, r.exception)
    return d


def _clone(big: Path, dst: Path) -> Path:
    """dst with the small files copied and the shards symlinked (the reader follows symlinked shards)."""
    dst.mkdir()
    for f in big.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        else:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _shards(d: Path) -> list[str]:
    return sorted(set(json.loads((d / INDEX_FILE).read_text())["weight_map"].values()))


def _header(f: Path) -> tuple[dict, int]:
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return json.loads(fh.read(n)), n


def _rewrite(big: Path, d: Path, shard: str, edit) -> str:
    """Replace d's symlink to ``shard`` by a sparse copy whose header went through ``edit(header) -> name``, padded
    to its old length (the data offsets stay valid). Returns what ``edit`` returned."""
    hdr, n = _header(big / shard)
    what = edit(hdr)
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    assert len(raw) <= n, "the edited header must fit in the old one"
    (d / shard).unlink()
    with open(d / shard, "wb") as fh:
        fh.write(n.to_bytes(8, "little") + raw + b" " * (n - len(raw)))
    os.truncate(d / shard, (big / shard).stat().st_size)
    return what


def test_control_the_sparse_27b_checkpoint_opens(big):
    """Control for every fault below: the untouched directory opens and validates at the 27B's shapes."""
    ck = Checkpoint.open(big)
    cfg = preset(PRESET)
    assert ck.config.hidden_size == cfg.hidden_size and ck.config.num_hidden_layers == cfg.num_hidden_layers
    assert ck.names() == list(expected_tensors(cfg))
    assert len(_shards(big)) > 1
    assert sum((big / s).stat().st_size for s in _shards(big)) > 25e9


def test_truncated_27b_shard_names_file_and_tensor(big, tmp_path):
    """A shard one byte short: refused at open, naming the shard and the tensor that runs past its end."""
    d = _clone(big, tmp_path / "t")
    shard = _shards(big)[len(_shards(big)) // 2]
    hdr, n = _header(big / shard)
    last = max((k for k in hdr if k != "__metadata__"), key=lambda k: hdr[k]["data_offsets"][1])
    _rewrite(big, d, shard, lambda h: None)
    os.truncate(d / shard, (big / shard).stat().st_size - 1)
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d)
    msg = str(e.value)
    assert str(d / shard) in msg and "truncated" in msg and repr(last) in msg, msg


def test_index_naming_a_missing_27b_shard(big, tmp_path):
    """The index maps tensors to a shard that is not there: refused naming that file and one of its tensors."""
    d = _clone(big, tmp_path / "m")
    gone = _shards(big)[-2]
    (d / gone).unlink()
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d)
    msg = str(e.value)
    assert "incomplete checkpoint" in msg and repr(gone) in msg and f"of {len(_shards(big))} shard" in msg, msg


def _first(hdr: dict, pred) -> str:
    return next(k for k, v in hdr.items() if k != "__metadata__" and pred(k, v))


@pytest.mark.parametrize("fault", ["dtype", "shape"])
def test_one_27b_tensor_of_the_wrong_dtype_or_shape(big, tmp_path, fault):
    """One tensor re-headed (same byte count: a bf16 norm as F16, an fp8 weight transposed): refused naming the shard,
    the tensor, what was expected and what was found."""
    d = _clone(big, tmp_path / fault)
    shard = _shards(big)[1]

    def edit(h):
        h.pop("__metadata__", None)  # room for the longer field
        if fault == "dtype":
            k = _first(h, lambda k, v: v["dtype"] == "BF16" and k.endswith("input_layernorm.weight"))
            h[k]["dtype"] = "F16"
        else:
            k = _first(h, lambda k, v: v["dtype"] == "F8_E4M3" and v["shape"][0] != v["shape"][1])
            h[k]["shape"] = h[k]["shape"][::-1]
        return k
    name = _rewrite(big, d, shard, edit)
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d)
    msg = str(e.value)
    assert str(d / shard) in msg and repr(name) in msg and "expected" in msg, msg
    assert ("got F16" in msg) if fault == "dtype" else ("got F8_E4M3" in msg), msg


def _tree(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())} if d.exists() else None


@pytest.mark.parametrize("target", ["previous checkpoint (--force)", "new directory"])
def test_disk_full_while_writing_the_27b_leaves_the_target_as_it_was(tiny_ckpt, tmp_path, monkeypatch, target):
    """ENOSPC in the third shard of the 27B: exit 1 with one line naming --out and the cause; the previous
    checkpoint in OUT (or OUT's absence) is untouched and no temporary directory is left. Control: the same write
    with room replaces it."""
    out = tmp_path / "out"
    if target.startswith("previous"):
        out.mkdir()
        for f in tiny_ckpt.iterdir():
            if f.is_file() and not f.name.startswith("."):
                (out / f.name).write_bytes(f.read_bytes())
    before = _tree(out)
    write, calls = _sparse_write(fail_at=2)
    with monkeypatch.context() as m:
        m.setattr(synthetic, "_write_data", write)
        r = _make(out, "--force")
    assert len(calls) == 3
    assert r.exit_code == 1, (r.output, r.exception)
    assert f"--out {out}" in r.output and "No space left on device" in r.output, r.output
    assert _tree(out) == before
    assert [p.name for p in tmp_path.iterdir() if p.name != "out"] == []
    with monkeypatch.context() as m:
        m.setattr(synthetic, "_write_data", _sparse_write()[0])
        r = _make(out, "--force")
    assert r.exit_code == 0, (r.output, r.exception)
    assert INDEX_FILE in os.listdir(out) and "tokenizer_config.json" not in os.listdir(out)  # replaced
    assert Checkpoint.open(out).config.hidden_size == preset(PRESET).hidden_size
