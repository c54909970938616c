"""What makes a directory a checkpoint, index entries and fp8 coverage: fp8 shards under a config.json without
``quantization_config`` are blamed on config.json; an index entry that leaves the checkpoint directory is refused
(one in a subdirectory is allowed and named as written, quoted); an absolute, empty, ``.``, directory or non-string
entry is refused naming the index, the tensor and the entry; hidden files do not count in the one-file search; no
``modules_to_not_convert`` entry may cover a module the engine loads as fp8, by HF's rule (a substring of its
dotted name), while every bf16 module name of the real checkpoint passes. Built on the cached tiny checkpoint
(symlinked, never modified); config.json's dtype and the set of shard files: test_checkpoint_config.py."""
from __future__ import annotations

import json
import os
import re

import pytest

from loader.checkpoint import (BF16, INDEX_FILE, SCALE_SUFFIX, Checkpoint, CheckpointConfigError, CheckpointError,
                               expected_tensors, stored_name)
from loader.config import ConfigError, ModelConfig, preset
from tests.helpers import SHARD, checkpoint_dir, tiny_config_json


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
    cj = tiny_config_json(tiny_ckpt)
    del cj["quantization_config"]
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck", cj)
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
@pytest.mark.parametrize("entry", ["../outside.safetensors", "sub/../../outside.safetensors",
                                   "link/outside.safetensors"], ids=["dotdot", "sub_dotdot", "dir_link"])
def test_index_entry_outside_the_directory_is_refused(tiny_ckpt, tmp_path, entry):
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck")
    os.symlink(tiny_ckpt / SHARD, tmp_path / "outside.safetensors")  # exists: a loader that follows the entry opens it
    (d / "sub").mkdir()
    os.symlink(tmp_path, d / "link")  # a directory link leading out of the checkpoint
    name = _remap(d, entry)
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d)
    assert str(e.value) == (f"{d / INDEX_FILE}: tensor {name!r} is mapped to {entry!r}, which is outside the "
                            f"checkpoint directory {d}; expected a shard file name relative to it")


def test_index_entry_in_a_subdirectory(tiny_ckpt, tmp_path):
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck", shards=())
    (d / "sub").mkdir()
    os.symlink(tiny_ckpt / SHARD, d / "sub" / SHARD)
    _remap(d, f"sub/{SHARD}")
    n = "model.layers.3.self_attn.q_proj.weight"
    assert Checkpoint.open(d).file_of(n) == (d / "sub" / SHARD, "model.language_model.layers.3.self_attn.q_proj.weight")
    name = _remap(d, "sub/missing.safetensors")  # absent: named as written, not by its base name
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d)
    assert str(e.value).startswith(f"{d}: incomplete checkpoint: 1 of 1 shard file(s) listed in {INDEX_FILE} is "
                                   f"missing: 'sub/missing.safetensors' (") and repr(name) in str(e.value), str(e.value)


def _refused(d, entry, why):
    """Checkpoint.open(d) after pointing every index entry at ``entry`` fails naming the index, the first
    tensor and the entry (repr) with ``why``, then what a good entry is."""
    name = _remap(d, entry)
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d)
    assert str(e.value) == (f"{d / INDEX_FILE}: tensor {name!r} is mapped to {entry!r}, {why}; expected a shard "
                            f"file name relative to the checkpoint directory {d}")


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_index_entry_absolute_path_is_refused_as_absolute(tiny_ckpt, tmp_path, where):
    """An absolute entry is refused for being absolute, wherever it points (not "outside the checkpoint
    directory", even when it names the directory's own shard)."""
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck")
    os.symlink(tiny_ckpt / SHARD, tmp_path / "outside.safetensors")
    entry = str(d / SHARD if where == "inside" else tmp_path / "outside.safetensors")
    _refused(d, entry, "an absolute path (absolute paths are not allowed)")


@pytest.mark.parametrize("entry", ["", ".", "./", "sub/.."], ids=["empty", "dot", "dot_slash", "sub_dotdot"])
def test_index_entry_naming_the_directory_itself_is_refused(tiny_ckpt, tmp_path, entry):
    """"" and "." name the checkpoint directory, not a file (not a missing shard named by
    nothing or a bare dot)."""
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck")
    (d / "sub").mkdir()
    _refused(d, entry, "which names the checkpoint directory itself, not a shard file")


def test_index_entry_naming_a_subdirectory_or_holding_nul_is_refused(tiny_ckpt, tmp_path):
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck")
    (d / "sub").mkdir()
    _refused(d, "sub", "which is a directory, not a shard file")
    _refused(d, "sub\0/model.safetensors", "which holds a NUL character")  # not a ValueError from realpath


def test_missing_shard_entries_are_quoted(tiny_ckpt, tmp_path):
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck")
    _remap(d, "model .safetensors ")  # the blanks show
    names = sorted(json.loads((d / INDEX_FILE).read_text())["weight_map"])
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d)
    assert str(e.value) == (f"{d}: incomplete checkpoint: 1 of 1 shard file(s) listed in {INDEX_FILE} is missing: "
                            f"'model .safetensors ' ({len(names)} tensor(s), e.g. {names[0]!r})")


@pytest.mark.parametrize("entry,shown", [(3, "3 (a JSON number)"), (None, "null (a JSON null)"),
                                         ([SHARD], f'["{SHARD}"] (a JSON list)')], ids=["int", "null", "list"])
def test_index_entry_that_is_not_a_string_names_the_tensor(tiny_ckpt, tmp_path, entry, shown):
    """Not the malformed-index error quoting TypeError("unsupported operand type(s) for /: ...")."""
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck")
    name = _remap(d, entry)
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d)
    assert str(e.value) == f"{d / INDEX_FILE}: tensor {name!r} is mapped to {shown}; expected a shard file name string"


# ---------------------------------------------------------------------------------------------- 3. hidden files
def test_hidden_files_do_not_count_in_the_single_file_search(tiny_ckpt, tmp_path):
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck", shards=["model.safetensors"], index=False)
    (d / "._model.safetensors").write_bytes(b"\0" * 4096)  # a macOS AppleDouble copy: not a shard
    (d / ".partial.safetensors").symlink_to(tiny_ckpt / SHARD)
    ck = Checkpoint.open(d)
    assert {ck.file_of(n)[0] for n in ck.names()} == {d / "model.safetensors"}
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(d))}: neither {re.escape(INDEX_FILE)} nor "):
        Checkpoint.open(d)


# ------------------------------------------------------------------------------------ 4. modules_to_not_convert
L = "model.language_model.layers."
COVERING = [  # (entry, the first fp8 module it covers, as stored)
    (L + "3.self_attn.q_proj", L + "3.self_attn.q_proj"),  # stored full name
    ("model.layers.0.mlp.down_proj", L + "0.mlp.down_proj"),  # canonical spelling
    ("in_proj_qkv", L + "0.linear_attn.in_proj_qkv"),  # short name, HF style
    ("mtp.layers.0", "mtp.layers.0.self_attn.q_proj"),  # a parent module
    ("gate_proj", L + "0.mlp.gate_proj"), ("mlp.gate_proj", L + "0.mlp.gate_proj"),
    ("layers.0.mlp.gate_proj", L + "0.mlp.gate_proj"), (L + "0.mlp", L + "0.mlp.gate_proj"),
    ("model", L + "0.linear_attn.in_proj_qkv"), ("mtp", "mtp.layers.0.self_attn.q_proj"),
    # substrings a prefix / suffix match would let through although HF leaves the modules unquantised
    ("mlp", L + "0.mlp.gate_proj"), ("layers.0.mlp", L + "0.mlp.gate_proj"),
    ("self_attn", L + "3.self_attn.q_proj"), ("linear_attn", L + "0.linear_attn.in_proj_qkv"),
    ("language_model", L + "0.linear_attn.in_proj_qkv"), ("layers", L + "0.linear_attn.in_proj_qkv"),
    ("proj", L + "0.linear_attn.in_proj_qkv"), ("layers.1", L + "1.linear_attn.in_proj_qkv"),
    (L + "1.mlp.gate", L + "1.mlp.gate_proj"), ("s.7.self_att", L + "7.self_attn.q_proj"),
    ("", L + "0.linear_attn.in_proj_qkv"),  # the empty string is in every name
    ("model.layers", L + "0.linear_attn.in_proj_qkv"),  # only in the canonical name
]


@pytest.mark.parametrize("entry,module", COVERING, ids=[repr(e) for e, _ in COVERING])
def test_modules_to_not_convert_covering_an_fp8_module_is_refused(tiny_ckpt, tmp_path, entry, module):
    """HF's FP8 integration keeps a linear unquantised when any entry is a substring of its dotted name
    (``any(key in current_key_name_str for key in modules_to_not_convert)``): each entry here covers an fp8 module,
    named in the error as stored (the first one in model order)."""
    cj = tiny_config_json(tiny_ckpt)
    cj["quantization_config"]["modules_to_not_convert"].append(entry)
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck", cj)
    with pytest.raises(CheckpointConfigError) as e:
        Checkpoint.open(d)
    assert str(e.value).startswith(f"{d / 'config.json'}: config field 'quantization_config.modules_to_not_convert' "
                                   f"lists {entry!r}, which covers {module!r} (1 such entry); the engine loads that "
                                   "module as fp8 e4m3"), str(e.value)


def test_modules_to_not_convert_counts_every_covering_entry(tiny_ckpt, tmp_path):
    from host.engine import Engine
    from host.errors import ModelLoadError
    cj = tiny_config_json(tiny_ckpt)
    cj["quantization_config"]["modules_to_not_convert"] += ["mlp", "lm_head", "proj"]
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck", cj)
    with pytest.raises(ModelLoadError, match=re.escape(f"lists 'mlp', which covers '{L}0.mlp.gate_proj' (2 such "
                                                       "entries)")) as e:
        Engine.load(d, executor="cpu", quiet=True)
    assert e.value.exit_code == 6


def _bf16_module_names(cfg) -> list[str]:
    """Every name a real modules_to_not_convert may use for a bf16 module of ``cfg``, from the loader's own table:
    each bf16 tensor of expected_tensors stripped of ``.weight``, stored and canonical, their short names, and the
    vision modules (spec §2) the loader never reads."""
    mods = [n.removesuffix(".weight") for n, (_, dt) in expected_tensors(cfg).items() if dt == BF16
            and not n.endswith(SCALE_SUFFIX)]
    names = mods + [stored_name(cfg, m) for m in mods] + sorted({m.rsplit(".", 1)[-1] for m in mods})
    names += ["mtp.fc", "visual", "model.visual", "model.visual.patch_embed.proj", "model.visual.pos_embed"]
    names += [f"model.visual.merger.{m}" for m in ("norm", "linear_fc1", "linear_fc2")]
    names += [f"model.visual.blocks.{b}.{m}" for b in range(27)
              for m in ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    return names


def test_modules_to_not_convert_real_bf16_names_are_never_refused(tiny_ckpt, tmp_path):
    """The real list (651 full names: lm_head, embeddings, norms, in_proj_a/b, conv1d, mtp.fc, vision) must load:
    no bf16 module's name is inside an fp8 module's name, for the tiny layer count and the 27B one."""
    cj = tiny_config_json(tiny_ckpt)
    names = _bf16_module_names(preset("tiny"))
    keep = cj["quantization_config"]["modules_to_not_convert"]
    assert set(keep) <= set(names) and {"lm_head", "in_proj_a", "conv1d", L + "0.linear_attn.in_proj_b",
                                        "model.language_model.embed_tokens", "mtp.fc"} <= set(names)
    cj["quantization_config"]["modules_to_not_convert"] = names
    ck = Checkpoint.open(checkpoint_dir(tiny_ckpt, tmp_path / "a", cj))
    assert ck.config.modules_to_not_convert == tuple(names)
    big = preset("qwen3.5-27b")
    big = big.replace(modules_to_not_convert=tuple(_bf16_module_names(big)))
    Checkpoint(tmp_path, big, {})._check_quantization(expected_tensors(big))  # 64 layers: layers.1.* vs layers.10.*


def test_modules_to_not_convert_bf16_entries_and_absent_key_are_fine(tiny_ckpt, tmp_path):
    cj = tiny_config_json(tiny_ckpt)
    keep = cj["quantization_config"]["modules_to_not_convert"]
    assert "lm_head" in keep and "mtp.fc" in keep  # the synthetic list: every bf16 module by full name
    keep += ["model.visual.blocks.0.attn.qkv", "q_norm", "layers.1.input_layernorm", "in_proj_b", "mtp.norm",
             "model.language_model.norm", "dt_bias"]
    Checkpoint.open(checkpoint_dir(tiny_ckpt, tmp_path / "a", cj))
    del cj["quantization_config"]["modules_to_not_convert"]
    Checkpoint.open(checkpoint_dir(tiny_ckpt, tmp_path / "b", cj))


@pytest.mark.parametrize("value,got", [("lm_head", "a JSON string"), (["lm_head", 3], "entry 3")],
                         ids=["string", "non_string_entry"])
def test_modules_to_not_convert_must_be_a_list_of_names(tiny_ckpt, value, got):
    cj = tiny_config_json(tiny_ckpt)
    cj["quantization_config"]["modules_to_not_convert"] = value
    with pytest.raises(ConfigError, match=rf"^cfg\.json: config field 'quantization_config\.modules_to_not_convert': "
                                          rf"expected a list of module names \(strings\), got {got}$"):
        ModelConfig.from_dict(cj, source="cfg.json")
