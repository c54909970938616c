"""The tiny synthetic checkpoint through the oracle: transformers' Qwen3_5ForCausalLM loads it with no missing or
unexpected keys, dequantises the fp8 weights exactly as loader.checkpoint.dequantize, and the synthetic
initialisation keeps activations in a realistic range (64 tokens, bf16, eager attention).

Loading note (transformers 5.24): ``Qwen3_5ForCausalLM.from_pretrained(dir)`` on the multimodal config takes
``text_config`` and drops the top-level ``quantization_config``, so the fp8 payloads would be loaded as plain
numbers and every ``weight_scale_inv`` reported unexpected. The oracle therefore passes the text config with the
checkpoint's ``quantization_config`` attached (``oracle_config``); transformers then dequantises to bf16 on load
(no GPU).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from loader.checkpoint import Checkpoint, dequantize
from loader.config import preset
from tests.tolerance import bf16_ulp

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.oracle

TINY = preset("tiny")
N_TOKENS = 64
# Bounds for the activation statistics (measured on the tiny preset, seed 0: hidden RMS 1.00 → 1.44 over the
# 8 layers, logits std 5.0, top-1/top-2 gap > 1 ulp at 57 of 64 positions). The gap fraction depends on the CPU's
# bf16 matmul (a CPU with AMX-BF16: 47 of 64 = 73 %; the same model upcast to fp32: 80 %), so the bound
# sits well below both and well above the tied-logits control (logits rounded to multiples of 4: 27 %).
RMS_RANGE = (0.3, 5.0)
LOGIT_STD_RANGE = (2.5, 10.0)
MIN_CLEAR_TOP1 = 0.6


def oracle_config(path):
    cfg = transformers.AutoConfig.from_pretrained(path).text_config
    cfg.quantization_config = json.loads((path / "config.json").read_text())["quantization_config"]
    return cfg


@pytest.fixture(scope="module")
def loaded(tiny_ckpt):
    model, info = transformers.Qwen3_5ForCausalLM.from_pretrained(
        tiny_ckpt, config=oracle_config(tiny_ckpt), dtype=torch.bfloat16, output_loading_info=True,
        attn_implementation="eager")
    return model.eval(), info


def test_no_missing_or_unexpected_keys(loaded):
    _, info = loaded
    assert not info["missing_keys"], sorted(info["missing_keys"])[:10]
    assert not [k for k in info["unexpected_keys"] if not k.startswith("mtp.")], sorted(info["unexpected_keys"])[:10]
    assert not info["mismatched_keys"] and not info["error_msgs"]


def _bf16_bits(t) -> np.ndarray:
    return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("name", ["model.layers.0.linear_attn.in_proj_qkv.weight",
                                  "model.layers.3.self_attn.q_proj.weight",
                                  "model.layers.7.mlp.down_proj.weight", "model.layers.1.linear_attn.A_log",
                                  "model.layers.2.linear_attn.conv1d.weight", "model.embed_tokens.weight",
                                  "model.norm.weight"])
def test_weights_as_loaded_by_the_oracle(loaded, tiny_ckpt, name):
    model, _ = loaded
    ck = Checkpoint.open(tiny_ckpt)
    got = _bf16_bits(model.state_dict()[name])
    w = ck.get(name)
    if name + "_scale_inv" in ck.names():  # fp8: the oracle holds bf16(fp32(w) · scale)
        import ml_dtypes
        want = dequantize(w, ck.get(name + "_scale_inv")).astype(ml_dtypes.bfloat16).view(np.uint16)
    else:
        want = np.asarray(w).view(np.uint16)
    assert got.shape == want.shape and np.array_equal(got, want)


def activation_problems(hidden_rms: list[float], finite: bool, logits: np.ndarray) -> list[str]:
    """What is out of the realistic range (empty when all is well). logits: fp32 [T, V] from bf16."""
    bad = [f"layer {i}: hidden RMS {r:.3g} outside {RMS_RANGE}" for i, r in enumerate(hidden_rms)
           if not RMS_RANGE[0] <= r <= RMS_RANGE[1]]
    if not finite:
        bad.append("NaN/Inf in hidden states or logits")
    std = float(logits.std(axis=-1).mean())
    if not LOGIT_STD_RANGE[0] <= std <= LOGIT_STD_RANGE[1]:
        bad.append(f"logits std {std:.3g} outside {LOGIT_STD_RANGE}")
    top = -np.sort(-logits, axis=-1)[:, :2]
    ulp = bf16_ulp(top[:, 0])  # bf16 ulp at the top logit
    clear = float(np.mean(top[:, 0] - top[:, 1] > ulp))
    if clear < MIN_CLEAR_TOP1:
        bad.append(f"top-1/top-2 gap > 1 bf16 ulp at only {clear:.0%} of positions (need {MIN_CLEAR_TOP1:.0%})")
    return bad


def test_activation_statistics(loaded):
    model, _ = loaded
    ids = torch.from_numpy(np.random.default_rng(64).integers(0, 248044, (1, N_TOKENS)))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    hs = out.hidden_states[:-1]  # the last entry is after the final norm
    rms = [float(h.float().pow(2).mean().sqrt()) for h in hs]
    finite = all(bool(torch.isfinite(h).all()) for h in out.hidden_states) and bool(torch.isfinite(out.logits).all())
    logits = out.logits[0].float().numpy()
    assert activation_problems(rms, finite, logits) == []
    # negative controls: an exploding residual, collapsed logits and tied logits must each be caught
    assert activation_problems([r * 100 for r in rms], finite, logits)
    assert activation_problems(rms, finite, logits * 0.05)
    assert activation_problems(rms, finite, np.round(logits / 4) * 4)
    assert activation_problems(rms, False, logits)
