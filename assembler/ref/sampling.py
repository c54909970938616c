"""Token selection with transformers' tie rules (``generation/logits_process.py`` of transformers 5.24).

Order as in ``GenerationMixin._get_logits_processor``: temperature, then top-k, then top-p, on fp32 logits
(``generate`` casts the bf16 logits of the last position to fp32 first).
- Temperature: ``scores / temperature`` in fp32, a temperature outside the fp32 range taken as the largest (or
  smallest positive) fp32: not inf (-inf / inf is nan) nor 0 (0 / 0 is nan). A score that overflows to +inf (a
  tiny temperature) takes the limit: the +inf scores share the probability equally. The host decodes greedily
  below 1e-5 anyway (``host.sampling.SAMPLING_EPS``, vLLM's rule).
- Top-k (``TopKLogitsWarper``): keep every score ≥ the k-th largest value, so ties at the threshold can make the
  kept set larger than k.
- Top-p (``TopPLogitsWarper``): sort ascending (stable: among equal scores the lower id comes first), softmax in
  fp32, cumulative sum (accumulated in float64 like torch's CPU cumsum, rounded to fp32 per element), remove the
  prefix with cumulative ≤ 1 − top_p, always keep the last (largest) entry. Among tied scores the lowest ids are
  removed first: the highest tied id survives. (transformers calls ``torch.sort`` without ``stable=True``; on
  long rows its order among equal scores is implementation-defined, so at the top-p boundary transformers may
  keep a different one of several tied ids. Ours is the stated, deterministic rule.)
"""
from __future__ import annotations

import numpy as np

from assembler.ref.dense import argmax
from assembler.ref.numerics import f32, need


_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).smallest_subnormal)


def _softmax32(x: np.ndarray) -> np.ndarray:
    m = np.max(x, -1, keepdims=True)
    if np.isposinf(m).any():  # overflowed scores (inf - inf is nan): the limit keeps only the +inf entries
        x = np.where(np.isposinf(m), np.where(np.isposinf(x), np.float32(0), np.float32(-np.inf)), x)
        m = np.max(x, -1, keepdims=True)
    e = np.exp((x - m).astype(np.float32).astype(np.float64)).astype(np.float32)
    s = e.astype(np.float64).sum(-1, keepdims=True).astype(np.float32)
    return (e / s).astype(np.float32)


def filter_logits(logits: np.ndarray, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> np.ndarray:
    """Warped fp32 scores with removed entries set to −inf. logits [V] or [M, V] (bf16 or fp32) → fp32 same shape.

    temperature > 0; top_k None/0 = off, else a positive int; top_p None/1.0 = off, else in (0, 1).
    Raises ValueError for out-of-range arguments."""
    need(temperature is not None and temperature > 0, f"filter_logits: temperature must be > 0, got {temperature}")
    need(top_k is None or (isinstance(top_k, (int, np.integer)) and top_k >= 0), f"filter_logits: bad top_k {top_k!r}")
    need(top_p is None or 0.0 < top_p <= 1.0, f"filter_logits: top_p must be in (0, 1], got {top_p}")
    s = np.atleast_2d(f32(logits)).astype(np.float32)
    if temperature != 1.0:
        with np.errstate(over="ignore"):  # an overflow to +inf is handled by _softmax32
            s = (s / np.float32(min(max(temperature, _F32_TINY), _F32_MAX))).astype(np.float32)
    V = s.shape[-1]
    if top_k:
        kth = -np.partition(-s, min(top_k, V) - 1, axis=-1)[:, min(top_k, V) - 1:min(top_k, V)]
        s = np.where(s < kth, np.float32(-np.inf), s).astype(np.float32)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(s, axis=-1, kind="stable")                    # ascending, ties: lower id first
        srt = np.take_along_axis(s, order, -1)
        cum = np.cumsum(_softmax32(srt).astype(np.float64), -1).astype(np.float32)
        rm = cum <= np.float32(1 - top_p)
        rm[:, -1] = False
        remove = np.zeros_like(rm)
        np.put_along_axis(remove, order, rm, -1)
        s = np.where(remove, np.float32(-np.inf), s).astype(np.float32)
    return s.reshape(np.shape(logits))


def sample(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None,
           rng: np.random.Generator):
    """Draw one token per row. temperature 0 (or None) → greedy argmax (lowest id on ties).

    Otherwise p = softmax(filter_logits(...)) in fp32 and one ``rng.random()`` draw u per row (row order):
    the token is the first id, in ascending id order, whose float64 cumulative probability exceeds u·Σp.
    logits [V] → int; [M, V] → int64 [M]."""
    if not temperature:
        return argmax(logits) if np.ndim(logits) == 2 else int(argmax(logits))
    s = np.atleast_2d(filter_logits(logits, temperature, top_k, top_p))
    p = _softmax32(s).astype(np.float64)
    out = np.empty(s.shape[0], np.int64)
    for i in range(s.shape[0]):
        c = np.cumsum(p[i])
        out[i] = min(int(np.searchsorted(c, rng.random() * c[-1], side="right")), s.shape[1] - 1)
        while p[i, out[i]] == 0:                                         # never land on a removed id
            out[i] -= 1
    return out if np.ndim(logits) == 2 else int(out[0])
