"""A dict-backed WeightSource with random weights in the checkpoint's stored format (tests of the reference
before / besides ``loader.synthetic``). Not a checkpoint generator: draws from numpy's PCG64, not the hash."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from loader.config import ModelConfig

BF16, FP8 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn


class DictWeights:
    """WeightSource over a dict name → array (INTERFACES §1). ``get`` raises KeyError naming the tensor."""

    def __init__(self, config: ModelConfig, tensors: dict[str, np.ndarray]):
        self.config, self.tensors = config, tensors

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def get(self, name: str) -> np.ndarray:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"DictWeights: no tensor {name!r}") from None


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 128×128 block s = bf16(amax/448), q = e4m3(w / s) (spec §5, DeepSeek convention)."""
    N, K = w.shape
    blk = w.reshape(N // 128, 128, K // 128, 128)
    s = (np.abs(blk).max(axis=(1, 3)) / 448.0).astype(np.float32).astype(BF16)
    sf = np.maximum(s.astype(np.float32), np.float32(1e-30))
    q = np.clip(blk / sf[:, None, :, None], -448, 448).astype(np.float32).astype(FP8)
    return q.reshape(N, K), s


def random_weights(cfg: ModelConfig, seed: int = 0, fp8: bool = True) -> DictWeights:
    """Every tensor of the text model + MTP in stored dtypes, N(0, 1/K) linears, small zero-centred norms."""
    rng = np.random.default_rng(seed)
    t: dict[str, np.ndarray] = {}
    H, F = cfg.hidden_size, cfg.intermediate_size
    bf = lambda a: np.asarray(a, np.float32).astype(BF16)

    def lin(name, n, k, quant=True):
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        if quant and fp8:
            t[name + ".weight"], t[name + ".weight_scale_inv"] = quantize_fp8(w)
        else:
            t[name + ".weight"] = bf(w)

    def norm(name, d):
        t[name] = bf(rng.standard_normal(d) * 0.1)

    def attn_layer(p):
        norm(p + "input_layernorm.weight", H); norm(p + "post_attention_layernorm.weight", H)
        lin(p + "self_attn.q_proj", cfg.q_proj_rows, H); lin(p + "self_attn.k_proj", cfg.kv_rows, H)
        lin(p + "self_attn.v_proj", cfg.kv_rows, H); lin(p + "self_attn.o_proj", H, cfg.attn_out_dim)
        norm(p + "self_attn.q_norm.weight", cfg.head_dim); norm(p + "self_attn.k_norm.weight", cfg.head_dim)
        mlp(p)

    def mlp(p):
        lin(p + "mlp.gate_proj", F, H); lin(p + "mlp.up_proj", F, H); lin(p + "mlp.down_proj", H, F)

    t["model.embed_tokens.weight"] = bf(rng.standard_normal((cfg.vocab_size, H)))
    t["lm_head.weight"] = bf(rng.standard_normal((cfg.vocab_size, H)) / np.sqrt(H) * 4)
    norm("model.norm.weight", H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if i in cfg.linear_layers:
            norm(p + "input_layernorm.weight", H); norm(p + "post_attention_layernorm.weight", H)
            a = p + "linear_attn."
            lin(a + "in_proj_qkv", cfg.gdn_conv_dim, H); lin(a + "in_proj_z", cfg.gdn_value_dim, H)
            lin(a + "in_proj_a", cfg.linear_num_value_heads, H, False); lin(a + "in_proj_b", cfg.linear_num_value_heads, H, False)
            lin(a + "out_proj", H, cfg.gdn_value_dim)
            t[a + "conv1d.weight"] = bf(rng.standard_normal((cfg.gdn_conv_dim, 1, cfg.linear_conv_kernel_dim)) * 0.5)
            t[a + "A_log"] = bf(np.log(rng.uniform(0.01, 16, cfg.linear_num_value_heads)))
            t[a + "dt_bias"] = bf(np.ones(cfg.linear_num_value_heads))
            t[a + "norm.weight"] = bf(1 + rng.standard_normal(cfg.linear_value_head_dim) * 0.1)
            mlp(p)
        else:
            attn_layer(p)
    if cfg.mtp_num_hidden_layers:
        lin("mtp.fc", H, 2 * H, False)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            norm(f"mtp.{n}.weight", H)
        attn_layer("mtp.layers.0.")
    return DictWeights(cfg, t)


class OverlayWeights:
    """WeightSource = ``base`` with some tensors replaced (constructed-weight tests, planted faults)."""

    def __init__(self, base, overrides: dict[str, np.ndarray]):
        self.config, self.base, self.overrides = base.config, base, dict(overrides)

    def names(self) -> list[str]:
        return sorted(set(self.base.names()) | set(self.overrides))

    def get(self, name: str) -> np.ndarray:
        return self.overrides[name] if name in self.overrides else self.base.get(name)


def to_torch(x: np.ndarray):
    """bf16/fp32 NumPy → torch tensor with the same bits (tests against transformers)."""
    import torch  # deferred: torch is the oracle's optional dependency (pyproject extra "oracle")
    if x.dtype == BF16:
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x).copy())


def from_torch(t) -> np.ndarray:
    import torch  # deferred, as in to_torch
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).view(BF16).copy()
    return t.numpy().copy()
