"""Token selection for the host loop: padding mask, greedy argmax, seeded sampling.

The math lives in the reference ops (``assembler.ref.ops.argmax``: lowest id wins ties;
``assembler.ref.ops.sample``: transformers' temperature → top-k (value threshold) → top-p tie rules);
this module only validates parameters, masks the padding rows and owns the seeded generator
(``numpy.random.Generator(PCG64(seed))``), so a (prompt, params, seed) triple always gives the same tokens.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

from assembler.ref import ops
from host.errors import InvalidArgument
from loader.config import FIRST_PADDING_ID


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k None/0 and top_p None/1.0 disable those filters; seed None = fresh entropy
    (the seed actually drawn is recorded in the result, so any run can be replayed). Raises InvalidArgument."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if not isinstance(t, (int, float)) or not np.isfinite(t) or t < 0:
            raise InvalidArgument(f"temperature: expected a finite number >= 0, got {t!r}")
        if k is not None and (not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 0):
            raise InvalidArgument(f"top_k: expected an integer >= 0 (0 = off), got {k!r}")
        if p is not None and (not isinstance(p, (int, float)) or not 0.0 < p <= 1.0):
            raise InvalidArgument(f"top_p: expected a number in (0, 1], got {p!r}")
        if self.seed is not None and (not isinstance(self.seed, (int, np.integer)) or self.seed < 0):
            raise InvalidArgument(f"seed: expected an integer >= 0, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def mask_padding(logits: np.ndarray) -> np.ndarray:
    """Copy of ``logits`` ([V] or [M, V], any float dtype) with ids >= FIRST_PADDING_ID set to -inf, so no
    padding id can ever win (ids 248077.. are unused model rows, spec §7)."""
    out = np.array(logits, copy=True)
    out[..., FIRST_PADDING_ID:] = -np.inf
    return out


class Sampler:
    """Chooses the next token from one row of logits ([V] bf16, as the executors return them)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        # greedy decoding draws nothing: no seed to record; sampling records the seed used so runs replay
        self.seed = params.seed if (params.seed is not None or params.greedy) else secrets.randbits(63)
        self.rng = np.random.Generator(np.random.PCG64(self.seed))

    def __call__(self, logits: np.ndarray) -> int:
        """Next token id for ``logits`` [V] (bf16 or fp32); never a padding id."""
        if logits.ndim != 1:
            raise ValueError(f"Sampler: expected logits of shape [V], got {logits.shape}")
        x = mask_padding(logits)
        p = self.params
        if p.greedy:
            tok = int(ops.argmax(x))
        else:
            top_k = p.top_k if p.top_k else 0
            top_p = p.top_p if p.top_p is not None else 1.0
            tok = int(ops.sample(x, float(p.temperature), top_k, top_p, self.rng))
        assert tok < FIRST_PADDING_ID, f"sampler chose padding id {tok}"  # the mask makes this impossible
        return tok

