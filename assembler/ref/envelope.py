"""Tolerance envelope against the transformers oracle, calibrated on the oracle's own disagreement between its
prompt path (one forward) and its generation path (one cached forward per token), under teacher forcing.
Numbers and reasoning: docs/tolerance.md. Goldens: tests/golden/oracle_<prompt>.npz (tests/golden/record.py).

Per position t of a prompt, with the oracle's top-32 ids I_t of the path compared against:
  d32[t] = max_{i ∈ I_t} |cand[t, i] − oracle[t, i]|   (logit units; bf16 logits)
  top-1 agreement = cand argmax (full vocabulary, lowest id on ties) == oracle argmax.
Bounds (``Envelope.calibrate``): the oracle's self-disagreement (its decode path scored against its prefill path
with the same metrics), worst prompt per statistic; see ``Envelope`` for the one-ulp allowance and the near-tie
rule of the top-1 criterion.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from assembler.ref.numerics import BF16

STATS = ("max", "p99", "p50", "mean")


def load_golden(path: str | Path) -> dict:
    """One prompt's golden arrays (npz → dict; bf16 stored as uint16 come back as bf16)."""
    z = np.load(path)
    out = {k: z[k] for k in z.files}
    for k in list(out):
        if k.endswith(("_vals", "_full")) or k in ("pre_conv0", "pre_conv6", "dec_conv0", "dec_conv6", "pre_k", "pre_v", "dec_k", "dec_v"):
            out[k] = out[k].view(BF16)
    return out


def _stats(d: np.ndarray) -> dict[str, float]:
    return {"max": float(d.max()), "p99": float(np.percentile(d, 99)), "p50": float(np.percentile(d, 50)),
            "mean": float(d.mean())}


def _ulp(v: np.ndarray) -> np.ndarray:
    """bf16 spacing at |v| (8 significant bits)."""
    return np.exp2(np.floor(np.log2(np.maximum(np.abs(v), 1e-30))) - 7).astype(np.float32)


@dataclass
class PromptScore:
    """Per-position scores of one candidate path on one prompt against one oracle path."""
    name: str
    d32: np.ndarray        # [T] max |cand − oracle| over the oracle's top-32 ids
    ulp: np.ndarray        # [T] bf16 spacing at the oracle's top-1 logit
    agree: np.ndarray      # [T] bool, argmax equal
    margin: np.ndarray     # [T] oracle top-1 minus top-2 logit

    @property
    def top1(self) -> float:
        return float(self.agree.mean())

    def summary(self, tie_margin: float = 0.0) -> dict:
        clear = self.margin > tie_margin
        return {"positions": int(self.agree.size), "top1": self.top1, "top1_clear": float(self.agree[clear].mean()) if clear.any() else 1.0,
                "clear_positions": int(clear.sum()), **{f"d32_{k}": v for k, v in _stats(self.d32).items()}}


def _margin(top_vals: np.ndarray) -> np.ndarray:
    return (top_vals[:, 0] - top_vals[:, 1]).astype(np.float32)


def score(name: str, cand_at_top: np.ndarray, cand_argmax: np.ndarray, golden: dict, path: str) -> PromptScore:
    """Score a candidate on one prompt. cand_at_top [T, 32] = the candidate's logits at the oracle's top-32 ids of
    ``path`` ('pre' or 'dec') at each position (any float dtype); cand_argmax [T] int (full-vocabulary argmax)."""
    top_vals = golden[f"{path}_top_vals"].astype(np.float32)
    d32 = np.abs(np.asarray(cand_at_top, np.float32) - top_vals).max(-1)
    return PromptScore(name, d32, _ulp(top_vals[:, 0]), np.asarray(cand_argmax) == golden[f"{path}_argmax"],
                       _margin(top_vals))


def oracle_self_score(name: str, golden: dict) -> PromptScore:
    """The oracle's decode path scored against its prefill path (recorded by tests/golden/record.py)."""
    top_vals = golden["pre_top_vals"].astype(np.float32)
    return PromptScore(name, golden["self_d32"].astype(np.float32), _ulp(top_vals[:, 0]),
                       golden["pre_argmax"] == golden["dec_argmax"], _margin(top_vals))


@dataclass
class Envelope:
    """Bounds of the check (``calibrate`` derives them from goldens; docs/tolerance.md explains each).

    d32: worst-prompt max / p99 / p50 / mean of the oracle's self-disagreement; a candidate's per-position d32 is
    first reduced by one bf16 ulp of the logit (its own independent final rounding, absent between the oracle's
    two paths, which share every GEMM). tie_margin: positions whose oracle top-2 margin is ≤ this (the d32 p99
    bound; for a candidate, plus the same one ulp) are near-ties, where a top-1 flip is rounding; top1_min: the oracle's pooled self-agreement on the
    other positions; the sanity prompt must agree at all of them."""
    d32: dict[str, float]
    tie_margin: float
    top1_min: float
    top1_raw: float
    sanity: str = "sanity"
    source: dict = field(default_factory=dict)

    @classmethod
    def calibrate(cls, goldens: dict[str, dict]) -> "Envelope":
        sc = [oracle_self_score(n, g) for n, g in goldens.items()]
        d = {s: max(_stats(p.d32)[s] for p in sc) for s in STATS}
        tie = d["p99"]
        clear = np.concatenate([p.agree[p.margin > tie] for p in sc])
        raw = np.concatenate([p.agree for p in sc])
        return cls(d, tie, float(clear.mean()), float(raw.mean()), source={p.name: p.summary(tie) for p in sc})

    def check(self, scores: list[PromptScore]) -> tuple[bool, list[str]]:
        """(ok, failure messages) for a candidate's scores on every prompt of one path comparison."""
        fails = []
        for p in scores:
            st = _stats(np.maximum(p.d32 - p.ulp, 0))
            for s in STATS:
                if st[s] > self.d32[s]:
                    fails.append(f"{p.name}: d32 {s} (less 1 ulp) {st[s]:.4g} > bound {self.d32[s]:.4g}")
            clear = p.margin > self.tie_margin + p.ulp                     # the candidate's own ulp, as for d32
            if p.name == self.sanity and not p.agree[clear].all():
                fails.append(f"{p.name}: sanity prompt top-1 differs at {int((~p.agree[clear]).sum())} non-tie positions")
        clear = np.concatenate([p.agree[p.margin > self.tie_margin + p.ulp] for p in scores])
        top1 = float(clear.mean()) if clear.size else 1.0
        if top1 < self.top1_min:
            fails.append(f"pooled top-1 agreement (non-tie positions) {top1:.4f} < oracle self-agreement {self.top1_min:.4f}")
        return not fails, fails

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def load_goldens(golden_dir: str | Path, names=None) -> dict[str, dict]:
    """All (or the named) oracle goldens under ``golden_dir``, keyed by prompt name."""
    out = {}
    for p in sorted(Path(golden_dir).glob("oracle_*.npz")):
        n = p.stem[len("oracle_"):]
        if names is None or n in names:
            out[n] = load_golden(p)
    return out
