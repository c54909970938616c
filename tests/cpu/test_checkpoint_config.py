"""What makes a directory a checkpoint, config.json and shard files: config.json's dtype and quantization_config
are checked (a clear error naming the file, the field, the value and what was expected; absent fields take the
real checkpoint's values), a checkpoint of one ``*.safetensors`` file without an index opens (several without one
are refused), and a partial ``make-checkpoint --max-shards`` write is refused as an incomplete checkpoint naming
the absent shard files. Built on the cached tiny checkpoint (symlinked, never modified); index entries and
``modules_to_not_convert``: test_checkpoint_index.py."""
from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from loader.checkpoint import INDEX_FILE, PARTIAL_KEY, Checkpoint, CheckpointConfigError, CheckpointError
from loader.config import ConfigError, ModelConfig, preset
from loader.synthetic import config_json
from tests.helpers import SHARD, checkpoint_dir, tiny_config_json

TINY = preset("tiny")


# ---------------------------------------------------------------------------------------------- 1. dtype, quantization
@pytest.mark.parametrize("where,key,value", [
    ("text_config", "dtype", "float16"),
    ("text_config", "torch_dtype", "float32"),
    ("", "torch_dtype", "float16"),
    ("", "dtype", "float8_e4m3fn"),
], ids=["text_dtype", "text_torch_dtype", "top_torch_dtype", "top_dtype"])
def test_unsupported_dtype_is_a_clear_config_error(tiny_ckpt, tmp_path, where, key, value):
    cj = tiny_config_json(tiny_ckpt)
    (cj[where] if where else cj)[key] = value
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck", cj)
    field = f"{where}.{key}" if where else key
    want = rf"{re.escape(str(d / 'config.json'))}: config field '{field}' is '{value}'; expected 'bfloat16'"
    with pytest.raises(ConfigError, match=want):
        ModelConfig.from_file(d)
    with pytest.raises(CheckpointConfigError, match=want):  # Checkpoint.open: the CLI's exit 6
        Checkpoint.open(d)


def test_dtype_of_a_text_only_config_and_the_accepted_values(tiny_ckpt):
    flat = config_json(TINY.replace(multimodal=False))
    assert flat["dtype"] == "bfloat16"  # what make-checkpoint writes (text_config.dtype in the multimodal layout)
    assert config_json(TINY)["text_config"]["dtype"] == "bfloat16"
    flat["torch_dtype"] = "float16"
    with pytest.raises(ConfigError, match=r"cfg\.json: config field 'torch_dtype' is 'float16'; expected 'bfloat16'"):
        ModelConfig.from_dict(flat, source="cfg.json")
    cj = tiny_config_json(tiny_ckpt)
    cj["torch_dtype"] = cj["dtype"] = cj["text_config"]["torch_dtype"] = "bfloat16"
    cj["vision_config"]["dtype"] = "float32"  # the vision tower is not run: not checked
    assert ModelConfig.from_dict(cj).replace(name="tiny") == TINY
    for k in ("dtype", "torch_dtype"):
        cj.pop(k), cj["text_config"].pop(k)
    assert ModelConfig.from_dict(cj).replace(name="tiny") == TINY  # absent: bfloat16


def test_quantization_config_absent_keys_take_the_real_values(tiny_ckpt, tmp_path):
    """A quantization_config without quant_method / fmt / weight_block_size / activation_scheme is the
    Qwen3.5-27B-FP8 one (not 'no quantisation', which would fail on every fp8 tensor)."""
    cj = tiny_config_json(tiny_ckpt)
    cj["quantization_config"] = {"modules_to_not_convert": cj["quantization_config"]["modules_to_not_convert"]}
    c = ModelConfig.from_dict(cj)
    assert (c.quant_method, c.quant_fmt, c.weight_block_size, c.activation_scheme) == ("fp8", "e4m3", (128, 128),
                                                                                       "dynamic")
    ck = Checkpoint.open(checkpoint_dir(tiny_ckpt, tmp_path / "ck", cj))
    assert ck.config.replace(name="tiny") == TINY
    cj["quantization_config"]["activation_scheme"] = "static"  # accepted (not used by the engine)
    assert ModelConfig.from_dict(cj).activation_scheme == "static"


@pytest.mark.parametrize("key,value,needle", [
    ("quant_method", None, "config field 'quantization_config.quant_method' is null; expected 'fp8'"),
    ("quant_method", "gptq", "config field 'quantization_config.quant_method': expected 'fp8', got 'gptq'"),
    ("fmt", "e5m2", "config field 'quantization_config.fmt': expected 'e4m3', got 'e5m2'"),
    ("weight_block_size", [64, 64], "config field 'quantization_config.weight_block_size': expected [128, 128], "
                                    "got [64, 64]"),
    ("weight_block_size", None, "config field 'quantization_config.weight_block_size': expected [128, 128]"),
], ids=["method_null", "method_gptq", "fmt", "block_64", "block_null"])
def test_unsupported_quantization_config_names_field_and_value(tiny_ckpt, tmp_path, key, value, needle):
    cj = tiny_config_json(tiny_ckpt)
    cj["quantization_config"][key] = value
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck", cj)
    with pytest.raises(CheckpointConfigError) as e:
        Checkpoint.open(d)
    msg = str(e.value)
    assert msg.startswith(f"{d / 'config.json'}: ") and needle in msg, msg


def test_engine_load_maps_a_bad_dtype_to_exit_6(tiny_ckpt, tmp_path):
    from host.engine import Engine
    from host.errors import ModelLoadError
    cj = tiny_config_json(tiny_ckpt)
    cj["text_config"]["dtype"] = "float16"
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck", cj)
    with pytest.raises(ModelLoadError, match="config field 'text_config.dtype' is 'float16'") as e:
        Engine.load(d, executor="cpu", quiet=True)
    assert e.value.exit_code == 6 and str(d / "config.json") in str(e.value)


# ---------------------------------------------------------------------------------------------- 2. one file, no index
@pytest.mark.parametrize("name", ["model.safetensors", SHARD, "weights.safetensors"])
def test_single_safetensors_file_without_index_opens(tiny_ckpt, tmp_path, name):
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck", shards=[name], index=False)
    ck, ref = Checkpoint.open(d), Checkpoint.open(tiny_ckpt)
    assert ck.names() == ref.names()
    n = "model.layers.3.self_attn.q_proj.weight"
    assert ck.file_of(n) == (d / name, "model.language_model.layers.3.self_attn.q_proj.weight")
    assert (ck.get(n).view("uint8") == ref.get(n).view("uint8")).all()


def test_several_safetensors_files_without_index_are_refused(tiny_ckpt, tmp_path):
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck", shards=["model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors"], index=False)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(d))}: 2 \*\.safetensors files \(model-00001-of-00002"
                                              rf"\.safetensors, model-00002-of-00002\.safetensors\) but no "
                                              rf"{re.escape(INDEX_FILE)}"):
        Checkpoint.open(d)
    e = tmp_path / "empty"
    e.mkdir()
    (e / "config.json").write_text(json.dumps(config_json(TINY)))
    with pytest.raises(CheckpointError, match="exactly one \\*.safetensors file"):
        Checkpoint.open(e)


def test_index_naming_missing_files_lists_them(tiny_ckpt, tmp_path):
    d = checkpoint_dir(tiny_ckpt, tmp_path / "ck")
    idx = json.loads((d / INDEX_FILE).read_text())
    wm = idx["weight_map"]
    names = sorted(wm)
    for n in names[:5]:
        wm[n] = "model-00002-of-00003.safetensors"
    for n in names[5:7]:
        wm[n] = "model-00003-of-00003.safetensors"
    (d / INDEX_FILE).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d)
    msg = str(e.value)
    assert msg.startswith(f"{d}: incomplete checkpoint: 2 of 3 shard file(s) listed in {INDEX_FILE} are missing: "
                          f"'model-00002-of-00003.safetensors' (5 tensor(s), e.g. {names[0]!r}); "
                          f"'model-00003-of-00003.safetensors' (2 tensor(s), e.g. {names[5]!r})"), msg
    assert "partial" not in msg


# ---------------------------------------------------------------------------------------------- 3. --max-shards
def test_partial_make_checkpoint_is_refused_as_incomplete(tmp_path):
    from host.cli import main
    from host.engine import Engine
    from host.errors import ModelLoadError
    out = tmp_path / "part"
    r = CliRunner().invoke(main, ["make-checkpoint", "--preset", "tiny", "--out", str(out), "--no-tokenizer",
                                  "--shard-bytes", "40000000", "--max-shards", "1", "--workers", "1"])
    assert r.exit_code == 0, r.output
    files = sorted(p.name for p in out.glob("*.safetensors"))
    idx = json.loads((out / INDEX_FILE).read_text())
    total = len(set(idx["weight_map"].values()))
    assert files == [f"model-00001-of-{total:05d}.safetensors"] and total >= 3
    assert f"wrote PARTIAL tiny checkpoint (seed 0) to {out}: 1 of {total} shards" in r.stdout
    assert f"qwen-mk: warning: --max-shards 1 left out {total - 1} of {total} shards" in r.stderr
    assert idx["metadata"][PARTIAL_KEY] == f"only 1 of {total} shards were written (qwen-mk make-checkpoint " \
                                           "--max-shards 1)"
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(out)
    msg = str(e.value)
    assert msg.startswith(f"{out}: incomplete checkpoint: {total - 1} of {total} shard file(s) listed in "
                          f"{INDEX_FILE} are missing: 'model-00002-of-{total:05d}.safetensors' ("), msg
    assert msg.endswith(f"(a partial write: only 1 of {total} shards were written (qwen-mk make-checkpoint "
                        "--max-shards 1))"), msg
    with pytest.raises(ModelLoadError, match="incomplete checkpoint") as e:
        Engine.load(out, executor="cpu", quiet=True)
    assert e.value.exit_code == 6
    # an index that lists only the shards present (its partial marker kept): named incomplete
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v == files[0]}
    (out / INDEX_FILE).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(out))}: incomplete checkpoint: missing tensor "
                                              r"'model\.language_model\.layers\.0\.[\w.]+' \(expected .*\); \d+ of the "
                                              r"\d+ expected tensors are missing, the last 'mtp\.norm\.weight'"):
        Checkpoint.open(out)


def test_max_shards_covering_every_shard_is_not_partial(tmp_path, monkeypatch):
    import host.commands.make_checkpoint as mc
    from host.cli import main

    def fake(cfg, out, seed, **kw):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return {"seconds": 0.1, "bytes": 16, "shards": 1, "total_shards": 1, "tokenizer": False}
    monkeypatch.setattr(mc, "write_checkpoint", fake)
    r = CliRunner().invoke(main, ["make-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "c"),
                                  "--no-tokenizer", "--max-shards", "3"])
    assert r.exit_code == 0, r.output
    assert "wrote tiny checkpoint (seed 0)" in r.output and "partial" not in r.output.lower()


def test_max_shards_help_says_partial():
    from host.cli import main
    r = CliRunner().invoke(main, ["make-checkpoint", "--help"])
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    assert "PARTIAL checkpoint that cannot be loaded" in text and "missing shard files" in text
