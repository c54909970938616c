"""Reference ops (docs/INTERFACES.md §3): the executable definition of every op the engine runs.

NumPy + ml_dtypes. Inputs and outputs are in the engine's dtypes: bf16 arrays as ``ml_dtypes.bfloat16``,
fp8 weights as ``ml_dtypes.float8_e4m3fn``, fp32 state as ``np.float32``. Rounding points follow the published
model code (transformers 5.24 ``models/qwen3_5/modeling_qwen3_5.py``, spec §3) except where INTERFACES §2 fixes
the engine's own order (GEMV split-K, split-KV attention). Row-wise ops take M rows (the engine uses M ≤ 8);
every result row depends only on its own input row. The ops live in sibling modules by family (``dense``:
embed, norms, the GEMV family; ``attention``, ``gdn``, ``sampling``, ``mtp``) and are re-exported here; the
siblings import only ``dense``, never this module.
"""
from __future__ import annotations

from assembler.ref.attention import (attn_decode_group, attn_gate, attn_merge_stats, attn_merge_values,
                                     attn_part_scores, attn_part_stats, attn_part_values, attn_prefill, attn_prep,
                                     rope_cos_sin)
from assembler.ref.dense import _inv_rms  # noqa: F401 - the GPU norm test compares the kernel's rstd with it
from assembler.ref.dense import (argmax, dequantize_bf16, embed, gemv, gemv_partial, gemv_reduce, residual_add,
                                 rmsnorm, rmsnorm_gated, widen)
from assembler.ref.gdn import (gdn_conv_prefill, gdn_conv_step, gdn_gates, gdn_prefill_chunked, gdn_qk_norm,
                               gdn_step_head)
from assembler.ref.mtp import mtp_input, mtp_step
from assembler.ref.numerics import bf16  # noqa: F401 - the GPU norm tests build their (1+w) control with it
from assembler.ref.sampling import filter_logits, sample

__all__ = ["embed", "widen", "dequantize_bf16", "rmsnorm", "rmsnorm_gated", "gemv_partial", "gemv_reduce", "gemv", "residual_add", "argmax",
           "rope_cos_sin", "attn_prep", "attn_decode_group", "attn_part_scores", "attn_part_stats", "attn_merge_stats",
           "attn_part_values", "attn_merge_values", "attn_prefill", "attn_gate", "gdn_conv_step",
           "gdn_conv_prefill", "gdn_gates", "gdn_qk_norm", "gdn_step_head", "gdn_prefill_chunked", "filter_logits",
           "sample", "mtp_input", "mtp_step"]
