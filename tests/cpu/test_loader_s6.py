"""Loader review, session 6: fp8 shards under a config.json without ``quantization_config`` are blamed on
config.json; an index entry that leaves the checkpoint directory is refused (one in a subdirectory is allowed and
named as written); hidden files do not count in the one-file search; ``modules_to_not_convert`` may not list a
module the engine loads as fp8. Built on the cached tiny checkpoint (symlinked, never modified)."""
from __future__ import annotations

import json
import os
import re

import pytest

from loader.checkpoint import INDEX_FILE, Checkpoint, CheckpointConfigError, CheckpointError
from loader.config import ConfigError, ModelConfig
from tests.cpu.test_loader_s5 import SHARD, _dir, _tiny_config  # the same scratch checkpoint directories


def _remap(d, fn):
    """Point every weight_map entry of d's index at ``fn``; returns the first tensor name."""
    idx = json.loads((d / INDEX_FILE).read_text())
    idx["weight_map"] = {k: fn for k in idx["weight_map"]}
    (d / INDEX_FILE).write_text(json.dumps(idx))
    return next(iter(idx["weight_map"]))


# ------------------------------------------------------------------------------------ 1. no quantization_config
def test_fp8_shards_without_quantization_config_blame_config_json(tiny_ckpt, tmp_path):
    from host.engine import Engine
    from host.errors import ModelLoadError
    cj = _tiny_config(tiny_ckpt)
    del cj["quantization_config"]
    d = _dir(tiny_ckpt, tmp_path / "ck", cj)
    with pytest.raises(CheckpointError) as e:  # a CheckpointConfigError: also a ConfigError
        Checkpoint.open(d)
    msg = str(e.value)
    assert isinstance(e.value, CheckpointConfigError) and "\n" not in msg
    assert msg.startswith(f"{d / 'config.json'}: 'quantization_config' is missing but the shards hold fp8 e4m3 "
                          "weights ("), msg
    assert re.search(rf"\d+ F8_E4M3 tensor\(s\), \d+ weight_scale_inv tensor\(s\), e\.g\. '[\w.]+' in {SHARD}\)",
                     msg), msg
    with pytest.raises(ModelLoadError, match="'quantization_config' is missing") as e:
        Engine.load(d, executor="cpu", quiet=True)
    assert e.value.exit_code == 6


# ---------------------------------------------------------------------------------------------- 2. index entries
@pytest.mark.parametrize("entry", ["../outside.safetensors", "ABS", "sub/../../outside.safetensors",
                                   "link/outside.safetensors"], ids=["dotdot", "absolute", "sub_dotdot", "dir_link"])
def test_index_entry_outside_the_directory_is_refused(tiny_ckpt, tmp_path, entry):
    d = _dir(tiny_ckpt, tmp_path / "ck")
    os.symlink(tiny_ckpt / SHARD, tmp_path / "outside.safetensors")  # exists: the old loader opened it
    (d / "sub").mkdir()
    os.symlink(tmp_path, d / "link")  # a directory link leading out of the checkpoint
    if entry == "ABS":
        entry = str(tmp_path / "outside.safetensors")
    name = _remap(d, entry)
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d)
    assert str(e.value) == (f"{d / INDEX_FILE}: tensor {name!r} is mapped to {entry!r}, which is outside the "
                            f"checkpoint directory {d}; expected a shard file name relative to it")


def test_index_entry_in_a_subdirectory(tiny_ckpt, tmp_path):
    d = _dir(tiny_ckpt, tmp_path / "ck", shards=())
    (d / "sub").mkdir()
    os.symlink(tiny_ckpt / SHARD, d / "sub" / SHARD)
    _remap(d, f"sub/{SHARD}")
    n = "model.layers.3.self_attn.q_proj.weight"
    assert Checkpoint.open(d).file_of(n) == (d / "sub" / SHARD, "model.language_model.layers.3.self_attn.q_proj.weight")
    name = _remap(d, "sub/missing.safetensors")  # absent: named as written, not by its base name
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d)
    assert str(e.value).startswith(f"{d}: incomplete checkpoint: 1 of 1 shard file(s) listed in {INDEX_FILE} is "
                                   f"missing: sub/missing.safetensors (") and repr(name) in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------- 3. hidden files
def test_hidden_files_do_not_count_in_the_single_file_search(tiny_ckpt, tmp_path):
    d = _dir(tiny_ckpt, tmp_path / "ck", shards=["model.safetensors"], index=False)
    (d / "._model.safetensors").write_bytes(b"\0" * 4096)  # a macOS AppleDouble copy: not a shard
    (d / ".partial.safetensors").symlink_to(tiny_ckpt / SHARD)
    ck = Checkpoint.open(d)
    assert {ck.file_of(n)[0] for n in ck.names()} == {d / "model.safetensors"}
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(d))}: neither {re.escape(INDEX_FILE)} nor "):
        Checkpoint.open(d)


# ------------------------------------------------------------------------------------ 4. modules_to_not_convert
@pytest.mark.parametrize("entry,module", [
    ("model.language_model.layers.3.self_attn.q_proj", "model.language_model.layers.3.self_attn.q_proj"),
    ("model.layers.0.mlp.down_proj", "model.language_model.layers.0.mlp.down_proj"),  # canonical spelling
    ("in_proj_qkv", "model.language_model.layers.0.linear_attn.in_proj_qkv"),  # short name, HF style
    ("mtp.layers.0", "mtp.layers.0.self_attn.q_proj"),  # a parent module
], ids=["stored", "canonical", "suffix", "parent"])
def test_modules_to_not_convert_listing_an_fp8_module_is_refused(tiny_ckpt, tmp_path, entry, module):
    cj = _tiny_config(tiny_ckpt)
    cj["quantization_config"]["modules_to_not_convert"].append(entry)
    d = _dir(tiny_ckpt, tmp_path / "ck", cj)
    with pytest.raises(CheckpointConfigError) as e:
        Checkpoint.open(d)
    assert str(e.value).startswith(f"{d / 'config.json'}: config field 'quantization_config.modules_to_not_convert' "
                                   f"lists {entry!r}, which covers {module!r} (1 such entry); the engine loads that "
                                   "module as fp8 e4m3"), str(e.value)


def test_modules_to_not_convert_bf16_entries_and_absent_key_are_fine(tiny_ckpt, tmp_path):
    cj = _tiny_config(tiny_ckpt)
    keep = cj["quantization_config"]["modules_to_not_convert"]
    assert "lm_head" in keep and "mtp.fc" in keep  # the synthetic list: every bf16 module by full name
    keep += ["model.visual.blocks.0.attn.qkv", "q_norm", "layers.1", "model.language_model.layers.1.mlp.gate"]
    Checkpoint.open(_dir(tiny_ckpt, tmp_path / "a", cj))
    del cj["quantization_config"]["modules_to_not_convert"]
    Checkpoint.open(_dir(tiny_ckpt, tmp_path / "b", cj))


@pytest.mark.parametrize("value,got", [("lm_head", "a JSON string"), (["lm_head", 3], "entry 3")],
                         ids=["string", "non_string_entry"])
def test_modules_to_not_convert_must_be_a_list_of_names(tiny_ckpt, value, got):
    cj = _tiny_config(tiny_ckpt)
    cj["quantization_config"]["modules_to_not_convert"] = value
    with pytest.raises(ConfigError, match=rf"^cfg\.json: config field 'quantization_config\.modules_to_not_convert': "
                                          rf"expected a list of module names \(strings\), got {got}$"):
        ModelConfig.from_dict(cj, source="cfg.json")
