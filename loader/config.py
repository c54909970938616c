"""Model configuration: one frozen dataclass from which every shape in the engine derives.

Parsed from a checkpoint's ``config.json`` (multimodal layout with the text fields nested under
``text_config`` and a top-level ``quantization_config``, or the text-only layout with fields at the
top level). Field meanings and the real values: ``shared/spec/qwen35-checkpoint.md`` §1. A ``dtype`` /
``torch_dtype`` must be ``bfloat16``; a ``quantization_config`` must be fp8 e4m3 with 128×128 blocks (its absent
keys take those values; no quantization_config at all = the all-bf16 release); its ``modules_to_not_convert`` is
kept for the checkpoint loader, which refuses one covering a module the engine loads as fp8.

Presets: ``qwen3.5-27b`` (the real dimensions) and ``tiny`` (same structure, small; the real
248,320-row vocabulary and special-token ids; every fp8 matrix dimension a multiple of 128).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LINEAR = "linear_attention"
FULL = "full_attention"

# Special token ids of the Qwen3.5 vocabulary (spec §7).
ENDOFTEXT_ID = 248044
IM_START_ID = 248045
IM_END_ID = 248046
TOOL_CALL_ID = 248058
TOOL_CALL_END_ID = 248059
THINK_ID = 248068
THINK_END_ID = 248069
FIRST_PADDING_ID = 248077  # ids 248077..vocab_size-1 are padding rows: never emitted, never decodable
# The dtype of the checkpoint's non-fp8 tensors (embeddings, norms, lm_head, block scales) and of the engine's
# activations. config.json names it ``dtype`` (transformers >= 4.56) or ``torch_dtype`` (older), at the top level
# and / or in ``text_config`` (the real checkpoint: ``text_config.dtype``, spec §1.1); absent = this value.
DTYPE = "bfloat16"


class ConfigError(ValueError):
    """A config.json (or preset override) the engine cannot run: names the field and what was expected."""


@dataclass(frozen=True)
class ModelConfig:
    """Text-decoder configuration of a Qwen3.5 hybrid (Gated DeltaNet + gated attention) model.

    All sizes are element counts unless the property name says ``bytes``. Invariants the engine relies on
    are checked in ``__post_init__``; a violation raises :class:`ConfigError` naming the field.
    """

    vocab_size: int = 248320
    hidden_size: int = 5120
    intermediate_size: int = 17408
    num_hidden_layers: int = 64
    layer_types: tuple[str, ...] = ()
    # gated full attention
    num_attention_heads: int = 24
    num_key_value_heads: int = 4
    head_dim: int = 256
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    attn_output_gate: bool = True
    # Gated DeltaNet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 48
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # misc
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 1
    mtp_use_dedicated_embeddings: bool = False
    mamba_ssm_dtype: str = "float32"
    hidden_act: str = "silu"
    bos_token_id: int = ENDOFTEXT_ID
    eos_token_ids: tuple[int, ...] = (IM_END_ID, ENDOFTEXT_ID)
    # fp8 quantisation (top-level quantization_config); None = bf16 checkpoint
    quant_method: str | None = "fp8"
    quant_fmt: str = "e4m3"
    weight_block_size: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"
    # quantization_config.modules_to_not_convert as written (full dotted names; the loader checks that none of
    # them is a substring of the name of a module it loads as fp8, HF's rule); not part of the model's identity
    modules_to_not_convert: tuple[str, ...] = field(default=(), compare=False, repr=False)
    # True when the checkpoint uses the multimodal prefix model.language_model.*
    multimodal: bool = True
    name: str = "custom"
    extra: tuple[tuple[str, Any], ...] = field(default=(), compare=False, repr=False)

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        if not self.layer_types:
            lt = tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", lt)
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        object.__setattr__(self, "weight_block_size", tuple(self.weight_block_size))
        object.__setattr__(self, "modules_to_not_convert", tuple(self.modules_to_not_convert))

        def need(cond: bool, fld: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"config field {fld!r}: {msg}")

        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                  "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f, f"expected a positive integer, got {v!r}")
        need(len(self.layer_types) == self.num_hidden_layers, "layer_types",
             f"expected {self.num_hidden_layers} entries (num_hidden_layers), got {len(self.layer_types)}")
        bad = [t for t in self.layer_types if t not in (LINEAR, FULL)]
        need(not bad, "layer_types", f"unknown layer type(s) {sorted(set(bad))}; expected {LINEAR!r} or {FULL!r}")
        want = tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(self.num_hidden_layers))
        need(self.layer_types == want, "layer_types",
             "the engine implements the pattern [linear, linear, linear, full] repeated; got "
             + ",".join("F" if t == FULL else "L" for t in self.layer_types))
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_attention_heads",
             f"must be a multiple of num_key_value_heads ({self.num_key_value_heads})")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0, "linear_num_value_heads",
             f"must be a multiple of linear_num_key_heads ({self.linear_num_key_heads})")
        need(self.attn_output_gate, "attn_output_gate", "the engine implements the gated attention only (true)")
        need(self.hidden_act == "silu", "hidden_act", f"expected 'silu', got {self.hidden_act!r}")
        need(self.mamba_ssm_dtype == "float32", "mamba_ssm_dtype", f"expected 'float32', got {self.mamba_ssm_dtype!r}")
        need(not self.tie_word_embeddings, "tie_word_embeddings", "expected false (untied lm_head)")
        need(self.mtp_num_hidden_layers in (0, 1), "mtp_num_hidden_layers", "expected 0 or 1")
        need(not self.mtp_use_dedicated_embeddings, "mtp_use_dedicated_embeddings", "expected false")
        need(self.linear_conv_kernel_dim == 4, "linear_conv_kernel_dim", "the engine implements kernel size 4")
        need(self.linear_key_head_dim == self.linear_value_head_dim == 128, "linear_key_head_dim",
             "the engine implements 128-wide GDN heads")
        need(self.head_dim % 2 == 0 and self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim,
             "partial_rotary_factor", f"gives rotary_dim {self.rotary_dim} for head_dim {self.head_dim}")
        need(self.vocab_size > FIRST_PADDING_ID, "vocab_size", f"must exceed {FIRST_PADDING_ID} (the real vocabulary)")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be positive")
        if self.quant_method is not None:
            why = ("the engine runs fp8 e4m3 weights with 128x128 block scales (Qwen3.5-27B-FP8), or a bf16 "
                   "checkpoint without quantization_config")
            need(self.quant_method == "fp8", "quantization_config.quant_method",
                 f"expected 'fp8', got {self.quant_method!r} ({why})")
            need(self.quant_fmt == "e4m3", "quantization_config.fmt", f"expected 'e4m3', got {self.quant_fmt!r} ({why})")
            need(self.weight_block_size == (128, 128), "quantization_config.weight_block_size",
                 f"expected [128, 128], got {list(self.weight_block_size)} ({why})")
            for fld, v in (("hidden_size", self.hidden_size), ("intermediate_size", self.intermediate_size),
                           ("q_proj rows", self.q_proj_rows), ("k/v_proj rows", self.kv_rows),
                           ("o_proj cols", self.attn_out_dim), ("GDN conv_dim", self.gdn_conv_dim),
                           ("GDN value_dim", self.gdn_value_dim)):
                need(v % 128 == 0, fld, f"fp8 block-scaled matrices need multiples of 128; got {v}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per q/k head (64 for the real model: 0.25 × 256)."""
        return int(round(self.head_dim * self.partial_rotary_factor))

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head (6 for the real model)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_proj_rows(self) -> int:
        """Rows of q_proj: per head [query(head_dim) | gate(head_dim)] → 2 × n_q × head_dim."""
        return 2 * self.num_attention_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def gate_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        """Rows of k_proj (and of v_proj)."""
        return self.num_key_value_heads * self.head_dim

    @property
    def attn_out_dim(self) -> int:
        """Input width of o_proj."""
        return self.num_attention_heads * self.head_dim

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the depthwise conv = rows of in_proj_qkv: q | k | v."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def gdn_head_group(self) -> int:
        """Value heads per key head: value head j uses key head j // gdn_head_group."""
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V over all full-attention layers, per token of context."""
        return len(self.full_layers) * 2 * self.kv_rows * 2

    @property
    def gdn_state_bytes_per_layer(self) -> int:
        """fp32 recurrent state [n_v, d_k, d_v] of one GDN layer."""
        return self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4

    @property
    def conv_state_bytes_per_layer(self) -> int:
        """bf16 conv ring [conv_dim, kernel-1] of one GDN layer."""
        return self.gdn_conv_dim * (self.linear_conv_kernel_dim - 1) * 2

    @property
    def state_bytes(self) -> int:
        """Per-session fixed state: recurrent + conv over all GDN layers."""
        return len(self.linear_layers) * (self.gdn_state_bytes_per_layer + self.conv_state_bytes_per_layer)

    def _w(self, rows: int, cols: int) -> int:
        """Bytes of a projection as stored: fp8 payload + bf16 block scales, or bf16."""
        if self.quant_method is None:
            return rows * cols * 2
        return rows * cols + (-(-rows // 128)) * (-(-cols // 128)) * 2

    @property
    def gdn_layer_weight_bytes(self) -> int:
        h = self.hidden_size
        return (self._w(self.gdn_conv_dim, h) + self._w(self.gdn_value_dim, h) + self._w(h, self.gdn_value_dim)
                + 2 * self.linear_num_value_heads * h * 2  # in_proj_a/b bf16
                + self.gdn_conv_dim * self.linear_conv_kernel_dim * 2
                + self._mlp_bytes() + 2 * h * 2 + self.linear_value_head_dim * 2 + 2 * self.linear_num_value_heads * 2)

    @property
    def attn_layer_weight_bytes(self) -> int:
        h = self.hidden_size
        return (self._w(self.q_proj_rows, h) + 2 * self._w(self.kv_rows, h) + self._w(h, self.attn_out_dim)
                + self._mlp_bytes() + 2 * h * 2 + 2 * self.head_dim * 2)

    def _mlp_bytes(self) -> int:
        h, f = self.hidden_size, self.intermediate_size
        return 2 * self._w(f, h) + self._w(h, f)

    @property
    def lm_head_bytes(self) -> int:
        return self.vocab_size * self.hidden_size * 2

    @property
    def weight_bytes_per_token(self) -> int:
        """Weight bytes one decode step streams (the embedding table is gathered, not streamed)."""
        return (len(self.linear_layers) * self.gdn_layer_weight_bytes
                + len(self.full_layers) * self.attn_layer_weight_bytes
                + self.lm_head_bytes + self.hidden_size * 2)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, cfg: dict, *, source: str = "config.json", name: str = "custom") -> "ModelConfig":
        """Parse a config.json dictionary (multimodal or text-only layout). Raises ConfigError naming ``source``
        and the field at fault: a missing required field (:data:`REQUIRED_FIELDS`), a value of the wrong type,
        or a configuration the engine does not implement."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"{source}: got a JSON {_json_kind(cfg)}; {LAYOUTS}")
        multimodal = "text_config" in cfg
        text = cfg["text_config"] if multimodal else cfg
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: 'text_config' must be a JSON object, got a JSON {_json_kind(text)}")
        mt = text.get("model_type")
        if mt not in (None, "qwen3_5_text", "qwen3_5"):
            raise ConfigError(f"{source}: model_type {mt!r} is not a Qwen3.5 text model ('qwen3_5_text')")
        missing = [k for k in REQUIRED_FIELDS if text.get(k) is None]
        if missing:
            where = "'text_config'" if multimodal else "the top level (text-only layout; no 'text_config')"
            raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)} in {where}; {LAYOUTS}")
        try:
            kw = _parse_fields(cfg, text, source)
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:  # a value of a wrong type the checks above do not name
            raise ConfigError(f"{source}: malformed field value ({e})") from None
        kw["multimodal"] = multimodal
        try:
            return cls(name=name, **kw)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except TypeError as e:  # wrong value types
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read ``path`` (a config.json, or a checkpoint directory holding one). Raises ConfigError naming the
        file: absent, unreadable, not JSON, not a JSON object, or any error of :meth:`from_dict`."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ConfigError(f"{p}: file not found" + ("" if p.name == "config.json" else " (expected a config.json)"))
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
        except OSError as e:
            raise ConfigError(f"{p}: cannot read ({e.strerror or e})") from None
        return cls.from_dict(data, source=str(p), name=p.parent.name or "custom")

    def to_text_config(self) -> dict:
        """The ``text_config`` object of a config.json for this configuration (HF key names)."""
        return {
            "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": self.attn_output_gate,
            "bos_token_id": self.bos_token_id, "dtype": DTYPE, "eos_token_id": ENDOFTEXT_ID,
            "full_attention_interval": 4, "head_dim": self.head_dim, "hidden_act": self.hidden_act,
            "hidden_size": self.hidden_size, "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size, "layer_types": list(self.layer_types),
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "linear_key_head_dim": self.linear_key_head_dim, "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_value_head_dim": self.linear_value_head_dim, "mamba_ssm_dtype": self.mamba_ssm_dtype,
            "max_position_embeddings": self.max_position_embeddings, "model_type": "qwen3_5_text",
            "mtp_num_hidden_layers": self.mtp_num_hidden_layers,
            "mtp_use_dedicated_embeddings": self.mtp_use_dedicated_embeddings,
            "num_attention_heads": self.num_attention_heads, "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads, "output_gate_type": "swish", "pad_token_id": None,
            "partial_rotary_factor": self.partial_rotary_factor, "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                                "partial_rotary_factor": self.partial_rotary_factor,
                                "rope_theta": self.rope_theta, "rope_type": "default"},
            "tie_word_embeddings": self.tie_word_embeddings, "use_cache": True, "vocab_size": self.vocab_size,
        }

    def replace(self, **kw: Any) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


# Fields every config.json must give (the shapes derive from them); the others default to the real model's.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                   "linear_key_head_dim", "linear_value_head_dim")
LAYOUTS = ("expected a Qwen3.5 config.json: a JSON object whose 'text_config' object holds the text-model fields "
           "(multimodal layout), or those fields at the top level (text-only layout)")


def _json_kind(v: Any) -> str:
    """JSON type name of a parsed value (for error messages)."""
    for t, n in ((bool, "boolean"), (dict, "object"), (list, "list"), (str, "string"), (int, "number"),
                 (float, "number")):
        if isinstance(v, t):
            return n
    return "null" if v is None else type(v).__name__


def _obj(v: Any, where: str, source: str) -> dict:
    if not isinstance(v, dict):
        raise ConfigError(f"{source}: {where!r} must be a JSON object, got a JSON {_json_kind(v)}")
    return v


def _number(v: Any, field: str, source: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{source}: config field {field!r}: expected a number, got {v!r}")
    return float(v)


def _check_dtypes(cfg: dict, text: dict, source: str) -> None:
    """Raise ConfigError naming ``source`` and the field for a ``dtype`` / ``torch_dtype`` other than bfloat16
    (top level or ``text_config``; the vision tower's is not read)."""
    spots = [("", cfg)] + ([("text_config.", text)] if text is not cfg else [])
    for where, obj in spots:
        for k in ("dtype", "torch_dtype"):
            v = obj.get(k)
            if v is not None and v != DTYPE:
                raise ConfigError(f"{source}: config field '{where}{k}' is {v!r}; expected {DTYPE!r} (the engine "
                                  "runs the Qwen3.5-27B-FP8 checkpoint: fp8 e4m3 weights with 128x128 block scales, "
                                  "every other tensor bfloat16; or the all-bfloat16 release)")


ROPE_NATIVE = ("default", "mrope")  # rope types that leave the native RoPE as it is (mrope: equal T/H/W positions)


def _check_rope_scaling(cfg: dict, text: dict, rope: dict, source: str) -> None:
    """Raise ConfigError naming ``source`` and the field for a RoPE scaling the engine does not implement: a
    ``rope_parameters.rope_type``, or a ``rope_scaling`` object (transformers v4's name, top level or in
    ``text_config``) whose ``rope_type`` / ``type`` is not the native RoPE (YaRN, linear, dynamic, ...). A
    ``rope_scaling`` of null, or one holding only the mrope keys with ``rope_type`` 'default', is accepted."""
    spots = [("rope_parameters", rope), ("rope_scaling", cfg.get("rope_scaling"))]
    if text is not cfg:
        spots.append(("text_config.rope_scaling", text.get("rope_scaling")))
    for field, v in spots:
        if v is None:
            continue
        v = _obj(v, field, source)
        kind = v.get("rope_type", v.get("type", "default"))
        if kind in ROPE_NATIVE or kind is None:
            continue
        factor = f" (factor {v['factor']!r})" if "factor" in v else ""
        what = "YaRN" if kind == "yarn" else repr(kind)
        raise ConfigError(f"{source}: config field '{field}' asks for {what} RoPE scaling{factor}; the engine "
                          "implements only the native RoPE (rope_type 'default', up to max_position_embeddings "
                          f"tokens): expected no {field.rsplit('.', 1)[-1]} entry, or rope_type 'default'; remove "
                          "it to run at the native context")


def _parse_fields(cfg: dict, text: dict, source: str) -> dict[str, Any]:
    """ModelConfig keyword arguments from the config.json objects (the text fields in ``text``)."""
    kw: dict[str, Any] = {}
    simple = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
              "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps",
              "max_position_embeddings", "tie_word_embeddings", "mtp_num_hidden_layers",
              "mtp_use_dedicated_embeddings", "mamba_ssm_dtype", "hidden_act", "attn_output_gate",
              "bos_token_id")
    for k in simple:
        if k in text and text[k] is not None:
            kw[k] = text[k]
    if "rms_norm_eps" in kw:
        kw["rms_norm_eps"] = _number(kw["rms_norm_eps"], "rms_norm_eps", source)
    if "layer_types" in text:
        if not isinstance(text["layer_types"], list):
            raise ConfigError(f"{source}: 'layer_types' must be a JSON list, "
                              f"got a JSON {_json_kind(text['layer_types'])}")
        kw["layer_types"] = tuple(text["layer_types"])
    elif "full_attention_interval" in text:
        n, iv = text.get("num_hidden_layers", 64), text["full_attention_interval"]
        if isinstance(iv, bool) or not isinstance(iv, int) or iv < 1:
            raise ConfigError(f"{source}: config field 'full_attention_interval': expected a positive integer, "
                              f"got {iv!r}")
        kw["layer_types"] = tuple(FULL if (i + 1) % iv == 0 else LINEAR for i in range(n))
    rope = text.get("rope_parameters")
    rope = {} if rope is None else _obj(rope, "rope_parameters", source)
    if "rope_theta" in rope or "rope_theta" in text:
        kw["rope_theta"] = _number(rope.get("rope_theta", text.get("rope_theta")), "rope_parameters.rope_theta", source)
    _check_rope_scaling(cfg, text, rope, source)
    prf = rope.get("partial_rotary_factor", text.get("partial_rotary_factor"))
    if prf is not None:
        kw["partial_rotary_factor"] = _number(prf, "rope_parameters.partial_rotary_factor", source)
    eos = text.get("eos_token_id")
    if eos is not None:
        eos_l = eos if isinstance(eos, list) else [eos]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos_l):
            raise ConfigError(f"{source}: config field 'eos_token_id': expected a token id or a list of them, "
                              f"got {eos!r}")
        kw["eos_token_ids"] = tuple(dict.fromkeys([IM_END_ID, *eos_l]))
    _check_dtypes(cfg, text, source)
    q = cfg.get("quantization_config", text.get("quantization_config"))
    if q is None:  # no quantization_config: the bf16 release (every tensor bf16, no block scales)
        kw["quant_method"] = None
    else:  # absent keys take the Qwen3.5-27B-FP8 values (spec §1.2); present ones are checked in __post_init__
        q = _obj(q, "quantization_config", source)
        kw["quant_method"] = q.get("quant_method", "fp8")
        if kw["quant_method"] is None:  # an explicit null would otherwise read as "no quantisation"
            raise ConfigError(f"{source}: config field 'quantization_config.quant_method' is null; expected 'fp8' "
                              "(a bf16 checkpoint has no quantization_config at all)")
        kw["quant_fmt"] = q.get("fmt", "e4m3")
        wbs = q.get("weight_block_size", [128, 128])
        if not isinstance(wbs, list):
            raise ConfigError(f"{source}: config field 'quantization_config.weight_block_size': expected [128, 128] "
                              f"(128x128 block scales; per-tensor or per-channel fp8 is not implemented), got {wbs!r}")
        kw["weight_block_size"] = tuple(wbs)
        kw["activation_scheme"] = q.get("activation_scheme", "dynamic")
        keep = q.get("modules_to_not_convert")
        if keep is not None:
            bad = [m for m in keep if not isinstance(m, str)] if isinstance(keep, list) else [keep]
            if bad:
                got = f"entry {bad[0]!r}" if isinstance(keep, list) else f"a JSON {_json_kind(keep)}"
                raise ConfigError(f"{source}: config field 'quantization_config.modules_to_not_convert': expected a "
                                  f"list of module names (strings), got {got}")
            kw["modules_to_not_convert"] = tuple(keep)
    return kw


PRESETS: dict[str, ModelConfig] = {
    "qwen3.5-27b": ModelConfig(name="qwen3.5-27b"),
    # Same structure as the real model, small: 8 layers (LLLF LLLF), GQA 6:1 with 2 KV heads,
    # head_dim 256 (so the partial RoPE is the real 64 dims), GDN 2 key / 6 value heads of 128,
    # the real vocabulary. Every fp8 matrix dimension is a multiple of 128.
    "tiny": ModelConfig(
        name="tiny", hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=12, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=2, linear_num_value_heads=6, max_position_embeddings=262144,
    ),
}


def preset(name: str) -> ModelConfig:
    """Return the named preset. Raises ConfigError listing the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
