"""Paged KV cache for the full-attention layers (article Part 6.5): one page pool allocated at start-up, a free
list of page ids, and per-session page tables on the device.

Pool layout (bf16 bits as uint16): ``pool[n_pages, n_attn_layers, 2, n_kv, PAGE, head_dim]``; index 2 is
K (after q/k norm and RoPE) then V. Key position j of a session lives in page ``table[j // PAGE]``, slot
``j % PAGE``. ``attention.cuh`` addresses it as ``layer_base + page * page_stride + ((kv * n_kv + h) * PAGE +
slot) * head_dim``. Nothing here allocates device memory after construction: sessions take and return page
ids (host-side list operations plus a small copy into the session's preallocated device page table).
"""
from __future__ import annotations

import numpy as np

from loader.config import ModelConfig

PAGE = 256  # tokens per page (DESIGN.md: 256-token pages)


def need(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless cond (contract checks; the message names the argument)."""
    if not cond:
        raise ValueError(msg)


def check_array(a, name: str, dtype, shape=None, align: int = 16) -> None:
    """Assert a CuPy array's type, dtype, C-contiguity, alignment and (optional) shape; ValueError names it."""
    import cupy as cp
    need(isinstance(a, cp.ndarray), f"{name}: expected a cupy.ndarray, got {type(a).__name__}")
    need(a.dtype == np.dtype(dtype), f"{name}: expected dtype {np.dtype(dtype)}, got {a.dtype}")
    need(a.flags.c_contiguous, f"{name}: must be C-contiguous")
    need(a.data.ptr % align == 0, f"{name}: must be {align}-byte aligned (address {a.data.ptr:#x})")
    if shape is not None:
        need(tuple(a.shape) == tuple(shape), f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")


class KVSession:
    """One sequence's page table: ``table`` int32 [max_pages] on the device (entries past ``n_pages`` are -1)."""

    def __init__(self, cache: "PagedKVCache", max_pages: int):
        import cupy as cp
        self.cache = cache
        self.pages: list[int] = []
        self.table = cp.full((max_pages,), -1, dtype=np.int32)

    @property
    def capacity(self) -> int:
        """Tokens the session can hold without taking more pages."""
        return len(self.pages) * PAGE

    def reserve(self, n_tokens: int) -> None:
        """Take pages from the free list until ``n_tokens`` positions fit. Raises ValueError when the table or the
        pool is full (message says how many pages were needed and available)."""
        need_pages = -(-n_tokens // PAGE)
        need(need_pages <= self.table.shape[0],
             f"KVSession.reserve: {n_tokens} tokens need {need_pages} pages > table size {self.table.shape[0]}")
        extra = need_pages - len(self.pages)
        if extra <= 0:
            return
        need(extra <= len(self.cache.free), f"KVSession.reserve: need {extra} free pages, pool has {len(self.cache.free)}")
        start = len(self.pages)
        new = [self.cache.free.pop() for _ in range(extra)]
        self.pages += new
        self.table[start:start + extra].set(np.asarray(new, np.int32))

    def release(self) -> None:
        """Return every page to the pool's free list."""
        self.cache.free.extend(reversed(self.pages))
        self.pages = []
        self.table.fill(-1)


class PagedKVCache:
    """The page pool of all full-attention layers. ``n_pages`` pages of PAGE tokens; raises ValueError on bad sizes."""

    def __init__(self, cfg: ModelConfig, n_pages: int, *, n_layers: int | None = None):
        import cupy as cp
        need(n_pages > 0, f"PagedKVCache: n_pages must be positive, got {n_pages}")
        self.cfg = cfg
        self.n_layers = len(cfg.full_layers) if n_layers is None else n_layers
        need(self.n_layers > 0, "PagedKVCache: the config has no full-attention layer")
        self.shape = (n_pages, self.n_layers, 2, cfg.num_key_value_heads, PAGE, cfg.head_dim)
        self.pool = cp.zeros(self.shape, dtype=np.uint16)
        self.page_stride = int(np.prod(self.shape[1:]))
        self.layer_stride = int(np.prod(self.shape[2:]))
        self.free: list[int] = list(range(n_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first

    def session(self, max_tokens: int) -> KVSession:
        """A new session able to grow to ``max_tokens`` (its page table is allocated here, once)."""
        return KVSession(self, -(-max_tokens // PAGE))

    def layer_base(self, layer: int):
        """Device pointer (int) of page 0, K, head 0 of attention layer ``layer`` (0-based among attention layers)."""
        need(0 <= layer < self.n_layers, f"PagedKVCache.layer_base: layer {layer} not in [0, {self.n_layers})")
        return self.pool.data.ptr + layer * self.layer_stride * 2

    def gather(self, sess: KVSession, layer: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of K and V for positions [0, length): two uint16 (bf16 bits) [length, n_kv, head_dim]
        arrays in the reference layout (ModelState)."""
        need(0 < length <= sess.capacity, f"PagedKVCache.gather: length {length} outside (0, {sess.capacity}]")
        pool = self.pool[:, layer]                                  # [pages, 2, n_kv, PAGE, hd]
        import cupy as cp
        pages = cp.asarray(np.asarray(sess.pages[: -(-length // PAGE)], np.int64))
        blk = pool[pages].get()                                     # [np, 2, n_kv, PAGE, hd]
        kv = blk.transpose(1, 0, 3, 2, 4).reshape(2, -1, self.shape[3], self.shape[5])[:, :length]
        return np.ascontiguousarray(kv[0]), np.ascontiguousarray(kv[1])

    def scatter(self, sess: KVSession, layer: int, K: np.ndarray, V: np.ndarray) -> None:
        """Write K, V (uint16 bf16 bits [L, n_kv, head_dim], reference layout) into positions [0, L)."""
        import cupy as cp
        L = K.shape[0]
        need(K.shape == V.shape == (L, self.shape[3], self.shape[5]),
             f"PagedKVCache.scatter: K{K.shape} V{V.shape}, expected [L, {self.shape[3]}, {self.shape[5]}]")
        sess.reserve(L)
        for pi in range(-(-L // PAGE)):
            lo, hi = pi * PAGE, min((pi + 1) * PAGE, L)
            blk = np.stack([K[lo:hi], V[lo:hi]]).transpose(0, 2, 1, 3)  # [2, n_kv, t, hd]
            self.pool[sess.pages[pi], layer, :, :, : hi - lo, :] = cp.asarray(blk)
