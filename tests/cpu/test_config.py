"""ModelConfig: presets, derived sizes against the spec's byte table, parsing both config layouts, and
clear errors for configurations the engine does not implement."""
import json

import pytest

from loader.config import FULL, LINEAR, ConfigError, ModelConfig, preset


def test_27b_derived_sizes_match_spec():
    c = preset("qwen3.5-27b")
    # shared/spec/h200.md: 383.8 MB per GDN layer, 372.3 MB per attention layer, 26.92 GB per token
    assert c.gdn_layer_weight_bytes == 383_862_848
    assert c.attn_layer_weight_bytes == 372_311_424
    assert abs(c.weight_bytes_per_token / 1e9 - 26.92) < 0.01
    assert c.kv_bytes_per_token == 64 * 1024
    assert c.gdn_state_bytes_per_layer == 3 * 2**20
    assert c.full_layers == tuple(range(3, 64, 4))
    assert c.q_proj_rows == 12288 and c.kv_rows == 1024 and c.gdn_conv_dim == 10240
    assert c.rotary_dim == 64 and c.gqa_group == 6 and c.gdn_head_group == 3


def test_tiny_is_same_structure():
    t = preset("tiny")
    assert t.vocab_size == 248320
    assert t.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 2
    assert t.rotary_dim == 64 and t.gqa_group == 6 and t.gdn_head_group == 3
    assert t.mtp_num_hidden_layers == 1


def _real_config():
    c = preset("qwen3.5-27b")
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": c.to_text_config(),
            "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": [128, 128]}}


def test_parse_multimodal_and_text_only_layouts():
    d = _real_config()
    a = ModelConfig.from_dict(d)
    assert a.multimodal and a.hidden_size == 5120 and a.quant_method == "fp8"
    flat = dict(d["text_config"], quantization_config=d["quantization_config"])
    b = ModelConfig.from_dict(flat)
    assert not b.multimodal
    assert a.replace(multimodal=False, name=b.name) == b


def test_from_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_real_config()))
    assert ModelConfig.from_file(tmp_path).num_hidden_layers == 64


@pytest.mark.parametrize("field,value,needle", [
    ("layer_types", ["full_attention"] * 64, "pattern"),
    ("num_key_value_heads", 5, "multiple of num_key_value_heads"),
    ("linear_conv_kernel_dim", 3, "kernel size 4"),
    ("hidden_size", 5000, "multiples of 128"),
    ("mamba_ssm_dtype", "bfloat16", "float32"),
])
def test_bad_fields_name_the_field(field, value, needle):
    d = _real_config()
    d["text_config"][field] = value
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(d)
    assert needle in str(e.value)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="known"):
        preset("nope")
