"""Fixed numerical choices that make the VM, the discrete path and the megakernel bit-identical
(docs/INTERFACES.md §2). Every choice depends on shapes only, never on the SM count.

The split-K rule is a first choice derived from the H200's 132 SMs × 16 resident warps (enough 16-row
warp tasks to keep loads in flight, article Part 4.4); it is to be re-chosen by measurement, and any change
changes results in the last bit (by design, everywhere at once).
"""
from __future__ import annotations

from loader.config import ModelConfig

K_BLOCK = 128          # reduction block = fp8 scale block width
ROW_TILE = 16          # output rows per warp task (mma m16)
TARGET_WARP_TASKS = 2048
H200_SMS = 132
GDN_CHUNK = 64         # GDN prefill chunk, anchored at the sequence start
MAX_ROWS = 8           # verify dimension: M <= 8 activation rows


def split_k(n_rows: int, k_cols: int) -> int:
    """Split-K factor for a projection with ``n_rows`` outputs and ``k_cols`` inputs.

    The smallest divisor d of the K-block count with (n_rows / 16) · d ≥ 2048, or the block count itself.
    Raises ValueError when k_cols is not a multiple of 128.
    """
    if k_cols % K_BLOCK:
        raise ValueError(f"split_k: k_cols={k_cols} is not a multiple of {K_BLOCK}")
    nkb = k_cols // K_BLOCK
    tiles = max(1, -(-n_rows // ROW_TILE))
    for d in range(1, nkb + 1):
        if nkb % d == 0 and tiles * d >= TARGET_WARP_TASKS:
            return d
    return nkb


def split_blocks(k_cols: int, split: int, s: int) -> range:
    """K-blocks owned by split ``s`` of ``split``."""
    nkb = k_cols // K_BLOCK
    per = nkb // split
    return range(s * per, (s + 1) * per)


def attn_partitions(cfg: ModelConfig) -> int:
    """Fixed split-KV partition count P (same at every context length)."""
    return max(1, H200_SMS // cfg.num_key_value_heads)


def attn_partition_range(ctx_len: int, parts: int, p: int) -> range:
    """Key positions of partition ``p`` for a context of ``ctx_len`` keys (may be empty)."""
    c = -(-ctx_len // parts)
    return range(min(p * c, ctx_len), min((p + 1) * c, ctx_len))
