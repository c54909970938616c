"""Checkpoint reader: layouts (sharded index, single file, multimodal and text-only prefixes), laziness,
dequantisation, and one test per kind of bad input, each planted into a copy of the tiny checkpoint."""
from __future__ import annotations

import json
import math
import shutil
import zlib

import ml_dtypes
import numpy as np
import pytest

from loader.checkpoint import (INDEX_FILE, SINGLE_FILE, ST_NAMES, Checkpoint, CheckpointConfigError, CheckpointError,
                               dequantize, expected_tensors, stored_name)
from loader.config import ConfigError, preset
from loader.synthetic import config_json

TINY = preset("tiny")
BIG = ("model.embed_tokens.weight", "lm_head.weight")
F_BIG, F_SMALL = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
LP = "model.language_model.layers."


def write_st(path, tensors: dict) -> None:
    """Minimal safetensors writer (stored name → NumPy array in a bf16/fp8/f32 dtype)."""
    hdr, off = {"__metadata__": {"format": "pt"}}, 0
    for n, a in tensors.items():
        hdr[n] = {"dtype": ST_NAMES[a.dtype.name], "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    raw = json.dumps(hdr).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        for a in tensors.values():
            fh.write(np.ascontiguousarray(a).tobytes())


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_ckpt):
    """The tiny checkpoint re-sharded: the two 127 MB tables in shard 1 (shared by symlink), the rest in
    shard 2 (~20 MB, copied and edited per test)."""
    d = tmp_path_factory.mktemp("base")
    ck = Checkpoint.open(tiny_ckpt)
    big = {stored_name(TINY, n): ck.get(n) for n in BIG}
    small = {stored_name(TINY, n): np.array(ck.get(n)) for n in ck.names() if n not in BIG}
    write_st(d / F_BIG, big)
    shutil.copy(tiny_ckpt / "config.json", d / "config.json")
    return d, small


def make(base, tmp_path, edit=None, drop=(), index_edit=None):
    """A checkpoint in tmp_path: shard 1 symlinked, shard 2 = base tensors after ``edit(dict)``; the index
    lists what is written (minus ``drop``), then ``index_edit(weight_map)``."""
    d, small = base
    tensors = dict(small)
    if edit:
        edit(tensors)
    for n in drop:
        tensors.pop(n)
    (tmp_path / F_BIG).symlink_to(d / F_BIG)
    write_st(tmp_path / F_SMALL, tensors)
    shutil.copy(d / "config.json", tmp_path / "config.json")
    wm = {**{stored_name(TINY, n): F_BIG for n in BIG}, **{n: F_SMALL for n in tensors}}
    if index_edit:
        index_edit(wm)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
    return tmp_path


def test_good_sharded_checkpoint(base, tmp_path, tiny_ckpt):
    ck = Checkpoint.open(make(base, tmp_path))
    ref = Checkpoint.open(tiny_ckpt)
    assert ck.names() == list(expected_tensors(TINY)) == ref.names()
    n = "model.layers.3.self_attn.q_proj.weight"
    assert ck.file_of(n) == (tmp_path / F_SMALL, LP + "3.self_attn.q_proj.weight")
    for n in ("model.layers.3.self_attn.q_proj.weight", "model.embed_tokens.weight", "mtp.fc.weight"):
        a = ck.get(n)
        assert isinstance(a.base, np.memmap) or isinstance(a, np.memmap)  # lazy: backed by the file's map
        assert not a.flags.writeable
        assert np.array_equal(a.view(np.uint8), ref.get(n).view(np.uint8))
    with pytest.raises(KeyError, match="model.layers.99"):
        ck.get("model.layers.99.mlp.up_proj.weight")


def test_single_file_text_only_layout_ignores_vision(tmp_path, tiny_ckpt):
    ref = Checkpoint.open(tiny_ckpt)
    tensors = {n: ref.get(n) for n in ref.names()}  # canonical = text-only stored names
    tensors["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((8, 8), ml_dtypes.bfloat16)
    write_st(tmp_path / SINGLE_FILE, tensors)
    (tmp_path / "config.json").write_text(json.dumps(config_json(TINY.replace(multimodal=False))))
    ck = Checkpoint.open(tmp_path)
    assert not ck.config.multimodal and ck.names() == ref.names()
    assert ck.file_of("model.norm.weight") == (tmp_path / SINGLE_FILE, "model.norm.weight")
    n = "model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv"
    assert np.array_equal(ck.get(n).view(np.uint16), ref.get(n).view(np.uint16))


def test_dequantize_matches_blockwise_loop():
    r = np.random.default_rng(zlib.crc32(b"dequant"))
    for shape in ((256, 384), (130, 300)):
        w = r.integers(0, 256, shape, dtype=np.uint8)
        w[(w & 0x7F) == 0x7F] = 0  # no NaN codes
        w = w.view(ml_dtypes.float8_e4m3fn)
        s = r.uniform(1e-4, 1e-2, (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))).astype(ml_dtypes.bfloat16)
        got = dequantize(w, s)
        want = np.empty(shape, np.float32)
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                blk = np.s_[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
                want[blk] = w[blk].astype(np.float32) * np.float32(s[i, j])
        assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))
        shifted = dequantize(w, np.roll(s, 1, axis=1))  # negative control: scales off by one block
        assert not np.array_equal(shifted, want)
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequantize(w, s[:, :1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize(w.astype(np.float32), s)


# ------------------------------------------------------------------ bad input, one planted fault each
def _expect(path, match):
    with pytest.raises(CheckpointError, match=match):
        Checkpoint.open(path)


def test_missing_shard(base, tmp_path):
    p = make(base, tmp_path)
    (p / F_SMALL).unlink()
    _expect(p, rf"{p}: incomplete checkpoint: 1 of 2 shard file\(s\) listed in {INDEX_FILE} is missing: '{F_SMALL}' "
               rf"\(\d+ tensor\(s\), e\.g\. '{LP}0\.input_layernorm\.weight'\)")


def test_truncated_shard(base, tmp_path):
    p = make(base, tmp_path)
    with open(p / F_SMALL, "r+b") as fh:
        fh.truncate((p / F_SMALL).stat().st_size - 1000)
    _expect(p, rf"{F_SMALL}: truncated: tensor 'mtp\..*' ends at byte \d+ but the file has \d+ bytes")


def test_wrong_shape(base, tmp_path):
    n = LP + "1.mlp.up_proj.weight"

    def edit(t):
        t[n] = t[n][:640]
    _expect(make(base, tmp_path, edit), rf"{F_SMALL}: tensor '{n}': expected F8_E4M3 \(768, 256\), got F8_E4M3 "
                                        r"\(640, 256\)")


def test_wrong_dtype(base, tmp_path):
    n = LP + "2.linear_attn.in_proj_a.weight"

    def edit(t):
        t[n] = t[n].astype(np.float32)
    _expect(make(base, tmp_path, edit), rf"{F_SMALL}: tensor '{n}': expected BF16 \(6, 256\), got F32 \(6, 256\)")


def test_missing_tensor(base, tmp_path):
    n = LP + "5.linear_attn.A_log"
    _expect(make(base, tmp_path, drop=[n]), f"missing tensor '{n}'")


def test_missing_scale(base, tmp_path):
    w = LP + "4.mlp.gate_proj.weight"
    _expect(make(base, tmp_path, drop=[w + "_scale_inv"]),
            rf"{F_SMALL}: fp8 weight '{w}' has no scale tensor '{w}_scale_inv'")


def test_unused_scale(base, tmp_path):
    n = LP + "0.linear_attn.in_proj_b.weight_scale_inv"

    def edit(t):
        t[n] = np.ones((1, 2), ml_dtypes.bfloat16)
    _expect(make(base, tmp_path, edit), rf"{F_SMALL}: scale tensor '{n}' is not used: weight "
                                        r"'model\.layers\.0\.linear_attn\.in_proj_b\.weight' is expected in bfloat16")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_scale(base, tmp_path, bad):
    n = LP + "3.self_attn.o_proj.weight_scale_inv"

    def edit(t):
        t[n] = t[n].copy()
        t[n][1, 0] = bad
    _expect(make(base, tmp_path, edit), rf"{F_SMALL}: scale tensor '{n}' holds 1 non-finite value\(s\), first "
                                        rf"{bad} at block \(1, 0\)")


def test_unexpected_tensor(base, tmp_path):
    def edit(t):
        t[LP + "0.mlp.extra.weight"] = np.ones(3, ml_dtypes.bfloat16)
    _expect(make(base, tmp_path, edit), rf"unexpected tensor '{LP}0\.mlp\.extra\.weight'")


def test_index_names_wrong_shard(base, tmp_path):
    n = LP + "6.post_attention_layernorm.weight"

    def idx(wm):
        wm[n] = F_BIG
    _expect(make(base, tmp_path, index_edit=idx), rf"tensor '{n}' is mapped to {F_BIG}, which does not hold it")


@pytest.mark.parametrize("field,value,match", [
    ("layer_types", ["linear_attention"] * 8, "pattern"),
    ("num_key_value_heads", 5, "num_attention_heads"),
    ("linear_key_head_dim", 64, "linear_key_head_dim"),
], ids=["layer_pattern", "kv_heads", "gdn_head_dim"])
def test_unsupported_config(base, tmp_path, field, value, match):
    p = make(base, tmp_path)
    cj = json.loads((p / "config.json").read_text())
    cj["text_config"][field] = value
    (p / "config.json").write_text(json.dumps(cj))
    with pytest.raises(CheckpointConfigError, match=rf"config\.json.*{match}") as e:
        Checkpoint.open(p)
    assert isinstance(e.value, ConfigError) and isinstance(e.value, ValueError)


def test_not_a_checkpoint(tmp_path):
    _expect(tmp_path / "nope", "not a checkpoint directory")
    (tmp_path / "config.json").write_text(json.dumps(config_json(TINY)))
    _expect(tmp_path, f"neither {INDEX_FILE} nor {SINGLE_FILE} found")
    (tmp_path / SINGLE_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    _expect(tmp_path, "header is not valid JSON")


def test_index_omits_stored_tensor(base, tmp_path):
    n = LP + "6.mlp.up_proj.weight"

    def idx(wm):
        del wm[n]
    _expect(make(base, tmp_path, index_edit=idx), rf"{F_SMALL}: tensor '{n}' is not listed in {INDEX_FILE}")
