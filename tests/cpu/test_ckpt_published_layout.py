"""What the published Qwen3.5-27B-FP8 directory may hold beyond what the synthetic writer puts there, each planted
into a copy of the tiny checkpoint: vision tensors (``model.visual.*``, spec §2, any dtype) in their own shard and
the processor files beside the weights (ignored); ``chat_template.jinja`` beside tokenizer_config.json (used);
fp8 block scales stored F32 instead of BF16 (converted exactly, else refused naming the tensor); no ``mtp.*`` head
(loads with a warning, speculation off); ``rope_scaling`` / a RoPE type other than the native one (YaRN: refused
naming the field)."""
from __future__ import annotations

import json
import math
import shutil

import ml_dtypes
import numpy as np
import pytest

from host.engine import Engine
from host.errors import ModelLoadError
from loader.checkpoint import INDEX_FILE, ST_NAMES, Checkpoint, CheckpointConfigError, CheckpointError, expected_tensors
from loader.checkpoint import stored_name
from loader.config import ConfigError, ModelConfig, preset
from loader.synthetic import config_json

TINY = preset("tiny")
BIG = ("model.embed_tokens.weight", "lm_head.weight")
F_BIG, F_SMALL, F_VISION = "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", \
    "model-00003-of-00003.safetensors"
TOKENIZER_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")
SCALE = "model.language_model.layers.0.mlp.gate_proj.weight_scale_inv"


def write_st(path, tensors: dict) -> None:
    """A safetensors file: stored name -> NumPy array, or (dtype string, shape, raw bytes) for a dtype NumPy lacks."""
    hdr, off, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for n, a in tensors.items():
        st, shape, raw = a if isinstance(a, tuple) else (ST_NAMES[a.dtype.name], a.shape, np.ascontiguousarray(a).tobytes())
        hdr[n] = {"dtype": st, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    raw = json.dumps(hdr).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        for b in blobs:
            fh.write(b)


@pytest.fixture(scope="module")
def parts(tmp_path_factory, tiny_ckpt):
    """(the tiny checkpoint's two 127 MB tables as one shard, shared by symlink; the other tensors, copied)."""
    d = tmp_path_factory.mktemp("tables")
    ck = Checkpoint.open(tiny_ckpt)
    write_st(d / F_BIG, {stored_name(TINY, n): ck.get(n) for n in BIG})
    return d / F_BIG, {stored_name(TINY, n): np.array(ck.get(n)) for n in ck.names() if n not in BIG}


def build(parts, tiny_ckpt, out, edit=None, vision=None, cfg_edit=None):
    """A checkpoint in ``out``: the tables shard, the other tensors after ``edit(dict)``, an optional vision shard,
    config and tokenizer files of the tiny checkpoint (config.json after ``cfg_edit(dict)``)."""
    big, small = parts
    out.mkdir(exist_ok=True)
    (out / F_BIG).symlink_to(big)
    t = dict(small)
    if edit:
        edit(t)
    write_st(out / F_SMALL, t)
    wm = {**{stored_name(TINY, n): F_BIG for n in BIG}, **{n: F_SMALL for n in t}}
    if vision:
        write_st(out / F_VISION, vision)
        wm.update({n: F_VISION for n in vision})
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": dict(sorted(wm.items()))}))
    cj = json.loads((tiny_ckpt / "config.json").read_text())
    if cfg_edit:
        cfg_edit(cj)
    (out / "config.json").write_text(json.dumps(cj))
    for f in TOKENIZER_FILES:
        shutil.copy(tiny_ckpt / f, out / f)
    return out


def greedy(engine, n=3):
    return list(engine.generate(engine.encode("def f(x):"), max_new_tokens=n, stop_ids=[]).result().ids)


@pytest.fixture(scope="module")
def ref_ids(tiny_ckpt):
    return greedy(Engine.load(tiny_ckpt, executor="cpu", quiet=True))


# ---------------------------------------------------------------------------------------------- vision, processor
def test_vision_tensors_and_processor_files_are_ignored(parts, tiny_ckpt, tmp_path, ref_ids):
    bf = ml_dtypes.bfloat16
    vision = {"model.visual.patch_embed.proj.weight": np.ones((16, 3, 2, 4, 4), bf),
              "model.visual.patch_embed.proj.bias": np.zeros(16, np.float32),
              "model.visual.blocks.0.attn.qkv.weight": np.ones((48, 16), bf),
              "model.visual.pos_embed.weight": ("F64", (4, 16), bytes(8 * 64)),  # a dtype the engine never reads
              "model.visual.merger.linear_fc2.weight": ("I64", (2,), bytes(16))}
    d = build(parts, tiny_ckpt, tmp_path / "mm", vision=vision)
    for f, text in {"preprocessor_config.json": '{"image_processor_type": "Qwen2VLImageProcessorFast"}',
                    "video_preprocessor_config.json": '{"video_processor_type": "Qwen3VLVideoProcessor"}',
                    "chat_template.json": '{"chat_template": "{{ not used }}"}',
                    "vocab.json": "{}", "merges.txt": "#version: 0.2\n"}.items():
        (d / f).write_text(text)
    ck = Checkpoint.open(d)
    assert ck.names() == list(expected_tensors(TINY)) and ck.warnings == []
    assert not any("visual" in n for n in ck.names())
    assert greedy(Engine.load(d, executor="cpu", quiet=True)) == ref_ids


def test_an_unknown_dtype_outside_the_vision_tower_is_still_refused(parts, tiny_ckpt, tmp_path):
    n = "model.language_model.layers.0.input_layernorm.weight"

    def edit(t):
        t[n] = ("F64", (TINY.hidden_size,), bytes(8 * TINY.hidden_size))
    with pytest.raises(CheckpointError, match=rf"{F_SMALL}: tensor '{n}' has dtype 'F64'"):
        Checkpoint.open(build(parts, tiny_ckpt, tmp_path / "c", edit=edit))


# ---------------------------------------------------------------------------------------------- chat_template.jinja
def test_chat_template_jinja_beside_tokenizer_config_is_used(parts, tiny_ckpt, tmp_path):
    d = build(parts, tiny_ckpt, tmp_path / "t")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert "chat_template" in tc
    (d / "chat_template.jinja").write_text("JINJA|{% for m in messages %}{{ m.content }}{% endfor %}|{{ eos_token }}")
    msgs = [{"role": "user", "content": "Hi"}]
    e = Engine.load(d, executor="cpu", quiet=True)  # both present: the .jinja file wins, as in transformers
    assert e.template.origin == str(d / "chat_template.jinja")
    assert e.template.render(msgs) == "JINJA|Hi|<|im_end|>"
    del tc["chat_template"]  # newer releases keep the template only in the .jinja file
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    e = Engine.load(d, executor="cpu", quiet=True)
    assert e.template.render(msgs) == "JINJA|Hi|<|im_end|>" and e.tokenizer.decode(e.render_chat(msgs)) == \
        "JINJA|Hi|<|im_end|>"


# ---------------------------------------------------------------------------------------------- fp32 scales
def _scales_to_f32(t):
    for n in [n for n in t if n.endswith("_scale_inv")]:
        t[n] = t[n].astype(np.float32)


def test_fp32_scales_that_bf16_holds_are_converted_exactly(parts, tiny_ckpt, tmp_path, ref_ids):
    d = build(parts, tiny_ckpt, tmp_path / "f32", edit=_scales_to_f32)
    ck, ref = Checkpoint.open(d), Checkpoint.open(tiny_ckpt)
    scales = [n for n in ck.names() if n.endswith("_scale_inv")]
    assert scales and ck.file_of(scales[0])[0] == d / F_SMALL
    for n in scales:
        a = ck.get(n)
        assert a.dtype == np.dtype(ml_dtypes.bfloat16) and not a.flags.writeable
        assert np.array_equal(a.view(np.uint16), ref.get(n).view(np.uint16)), n
    assert greedy(Engine.load(d, executor="cpu", quiet=True)) == ref_ids


def test_fp32_scale_that_bf16_cannot_hold_is_refused_naming_it(parts, tiny_ckpt, tmp_path):
    def edit(t):
        _scales_to_f32(t)
        v = t[SCALE].copy()
        v.view(np.uint32)[0, 1] += 1  # one float32 ulp off a bf16 value: not representable in bf16
        t[SCALE] = v
    d = build(parts, tiny_ckpt, tmp_path / "bad", edit=edit)
    n = math.prod(expected_tensors(TINY)["model.layers.0.mlp.gate_proj.weight_scale_inv"][0])
    with pytest.raises(CheckpointError, match=rf"{d / F_SMALL}: scale tensor '{SCALE}' is F32 and 1 of its {n} "
                                              r"value\(s\) are not exactly representable in bfloat16, first .* at "
                                              r"block \(0, 1\) \(bfloat16 rounds it to .*\); expected BF16 scales"):
        Checkpoint.open(d)
    with pytest.raises(ModelLoadError, match=f"scale tensor '{SCALE}' is F32") as e:
        Engine.load(d, executor="cpu", quiet=True)
    assert e.value.exit_code == 6


def test_fp32_scale_that_is_not_finite_is_refused_as_non_finite(parts, tiny_ckpt, tmp_path):
    def edit(t):
        _scales_to_f32(t)
        t[SCALE] = t[SCALE].copy()
        t[SCALE][1, 0] = np.inf
    with pytest.raises(CheckpointError, match=rf"scale tensor '{SCALE}' holds 1 non-finite value\(s\), first inf at "
                                              r"block \(1, 0\)"):
        Checkpoint.open(build(parts, tiny_ckpt, tmp_path / "inf", edit=edit))


# ---------------------------------------------------------------------------------------------- no MTP head
def _drop_mtp(t):
    for n in [n for n in t if n.startswith("mtp.")]:
        del t[n]


def test_missing_mtp_head_loads_with_a_warning_and_speculation_off(parts, tiny_ckpt, tmp_path, capsys, ref_ids):
    d = build(parts, tiny_ckpt, tmp_path / "nomtp", edit=_drop_mtp)
    ck = Checkpoint.open(d)
    assert ck.config.mtp_num_hidden_layers == 0 and not any(n.startswith("mtp.") for n in ck.names())
    assert ck.warnings == [f"{d}: no mtp.* tensors (config.json's mtp_num_hidden_layers 1 expects the MTP head's 22): "
                           "loaded without the MTP head; speculative decoding is off"]
    capsys.readouterr()
    e = Engine.load(d, executor="cpu")
    assert f"qwen-mk: warning: {ck.warnings[0]}" in capsys.readouterr().err
    r = e.generate(e.encode("def f(x):"), max_new_tokens=3, stop_ids=[], speculate=2).result()
    assert r.timings.speculate == "off (the model has no MTP head (no mtp.* tensors); plain decode)"
    assert list(r.ids) == ref_ids  # the main model is untouched
    Engine.load(d, executor="cpu", quiet=True)
    assert capsys.readouterr().err == ""


def test_a_partial_mtp_head_is_an_incomplete_checkpoint(parts, tiny_ckpt, tmp_path):
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint: missing tensor 'mtp\.norm\.weight'"):
        Checkpoint.open(build(parts, tiny_ckpt, tmp_path / "part", edit=lambda t: t.pop("mtp.norm.weight")))


# ---------------------------------------------------------------------------------------------- rope scaling
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}


def _cfg(edit) -> dict:
    cj = config_json(TINY)
    edit(cj)
    return cj


@pytest.mark.parametrize("edit,field,what", [
    (lambda c: c["text_config"].__setitem__("rope_scaling", YARN), "text_config.rope_scaling", "YaRN"),
    (lambda c: c.__setitem__("rope_scaling", YARN), "rope_scaling", "YaRN"),
    (lambda c: c["text_config"]["rope_parameters"].update(YARN), "rope_parameters", "YaRN"),
    (lambda c: c["text_config"].__setitem__("rope_scaling", {"type": "linear", "factor": 2.0}),
     "text_config.rope_scaling", "'linear'"),
], ids=["text_config.rope_scaling", "top-level rope_scaling", "rope_parameters", "linear"])
def test_rope_scaling_is_refused_naming_the_field(edit, field, what):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(_cfg(edit), source="x/config.json")
    msg = str(e.value)
    assert msg.startswith(f"x/config.json: config field '{field}' asks for {what} RoPE scaling"), msg
    assert "the engine implements only the native RoPE (rope_type 'default'" in msg and "remove it" in msg
    if what == "YaRN":
        assert "(factor 4.0)" in msg


@pytest.mark.parametrize("value", [None, {"rope_type": "default", "mrope_section": [11, 11, 10],
                                          "mrope_interleaved": True}, {"type": "mrope", "mrope_section": [11, 11, 10]}],
                         ids=["null", "default-mrope", "type-mrope"])
def test_native_rope_scaling_entries_are_accepted(value):
    c = ModelConfig.from_dict(_cfg(lambda c: c["text_config"].__setitem__("rope_scaling", value)))
    assert c.rope_theta == TINY.rope_theta


def test_yarn_checkpoint_fails_to_load_with_exit_6(parts, tiny_ckpt, tmp_path):
    d = build(parts, tiny_ckpt, tmp_path / "yarn", cfg_edit=lambda c: c["text_config"].__setitem__("rope_scaling", YARN))
    with pytest.raises(CheckpointConfigError, match=r"config field 'text_config.rope_scaling' asks for YaRN"):
        Checkpoint.open(d)
    with pytest.raises(ModelLoadError, match="YaRN RoPE scaling") as e:
        Engine.load(d, executor="cpu", quiet=True)
    assert e.value.exit_code == 6
