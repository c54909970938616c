"""MTP speculative decoding on the cpu executor: draft k tokens with the MTP head, verify them in one M = k + 1 pass
of the main model, accept, roll the state back exactly (docs/speculation.md).

A round starts with the pending token x (chosen, emitted, not yet run): the MTP head drafts d_1..d_k
(``host.cpu_mtp``), the main model runs [x, d_1..d_k] in one recorded step pass (``FastModel.decode(record=True)``,
each row the bits of plain one-token decode), and the accept rule gives the tokens to emit:
- greedy: the longest prefix of drafts equal to the target argmax, then the target's token at the first mismatch
  (correction) or after the last draft (bonus);
- sampling: draft d_i ~ q_i, accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection a token
  ~ norm(max(p_i − q_i, 0)) and the round ends; all accepted: a bonus ~ p_{k+1}. The emitted tokens are
  distributed exactly as plain sampling's (Leviathan et al. 2023), drawn from the Sampler's seeded generator.
The caller then keeps the first n rows (``commit``): all accepted rows, or fewer when a stop ends the generation
inside the run; the GDN state comes from the replay ring, the KV cursor moves back.

k: fixed (``speculate=K``) or chosen per round by ``KChooser`` from the measured verify cost per M, the measured
draft cost and the running acceptance per position (``speculate="auto"``).
"""
from __future__ import annotations

import time

import numpy as np

from assembler.ref import ops
from host.cpu_mtp import FastMtp, WorkingVocab
from host.errors import InvalidArgument
from host.sampling import Sampler, mask_padding
from loader.config import FIRST_PADDING_ID

MAX_K = 7                  # drafts per round at most (M = k + 1 ≤ 8 verify rows)
DEFAULT_SPECULATE = "off"  # the API's and CLI's default (docs/speculation.md says why: measured)
DRAFT_CORE = 32768         # static core of the pruned draft head: ids [0, DRAFT_CORE) + the added tokens
PRIOR_ALPHA, PRIOR_N = 0.7, 2.0   # Beta prior of the acceptance per position (weight of 2 observations)
EMA = 0.2                  # weight of a new cost measurement
EXPLORE_EVERY = 6          # auto: every this many rounds, try a k whose round cost is not measured yet (or k* + 1)


def parse_speculate(v) -> str | int:
    """``off`` | ``auto`` | K (0..MAX_K; a str of digits too, from the CLI) → "off", "auto" or the int K (0 = off).
    None = DEFAULT_SPECULATE. Raises InvalidArgument otherwise."""
    if v is None:
        v = DEFAULT_SPECULATE
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v)
    if isinstance(v, str) and v in ("off", "auto"):
        return v
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 0 <= v <= MAX_K:
        return "off" if v == 0 else int(v)
    raise InvalidArgument(f"speculate: expected 'off', 'auto' or a number of drafts 0..{MAX_K}, got {v!r}")


def unavailable(engine) -> str | None:
    """Why ``engine`` cannot speculate (a phrase), or None when it can: the cpu executor with an MTP head only."""
    ex = engine.executor
    if ex.name == "cpu-vm":
        return "the cpu-vm executor (the bit-exact reference) has no MTP draft; --executor cpu speculates"
    if ex.name != "cpu":
        return (f"the {ex.name} executor has no MTP draft yet (speculation runs on the cpu executor; the GPU paths "
                "hold no MTP weights, issue #26)")
    if getattr(engine, "weights", None) is None or "mtp.fc.weight" not in set(engine.weights.names()):
        return "the model has no MTP head (no mtp.* tensors)"
    return None


def speculator(engine) -> "Speculator":
    """The engine's Speculator, built at first use (MTP weights widened once; costs and acceptance kept across
    generations so ``auto`` learns)."""
    sp = getattr(engine, "_speculator", None)
    if sp is None:
        sp = engine._speculator = Speculator(engine.executor)
    return sp


class KChooser:
    """Picks k in 0..MAX_K minimising expected ms per emitted token: cost(k) / tokens(k), tokens(k) = 1 +
    Σ_{i ≤ k} Π_{j ≤ i} α_j. cost(k): the EMA of the measured wall time of a whole round of k drafts (draft, verify
    pass of M = k + 1 rows, accept, commit; k = 0: a plain step and its token choice); where k is not measured yet,
    the measured verify pass time of M rows (a line through the measured M where that is missing too) + k · the
    measured draft step time + the mean measured overhead of a round. α_i: acceptance of draft i given drafts < i
    accepted, counted over every round (Beta prior PRIOR_ALPHA, weight PRIOR_N)."""

    def __init__(self):
        self.verify_ms = np.full(MAX_K + 2, np.nan)   # index M = 1..8: the verify pass alone
        self.round_ms = np.full(MAX_K + 1, np.nan)    # index k = 0..7: a whole round
        self.draft_ms = np.nan
        self.overhead_ms = np.nan
        self.acc = np.zeros(MAX_K + 1)                # index i = 1..7: drafts accepted at position i
        self.tried = np.zeros(MAX_K + 1)              # drafts proposed at position i (previous ones accepted)
        self.rounds = 0

    @staticmethod
    def _ema(old: float, new: float) -> float:
        return new if np.isnan(old) else (1 - EMA) * old + EMA * new

    def observe(self, k: int, accepted: int, verify_ms: float, draft_ms: float, round_ms: float | None = None) -> None:
        """Record a round of k drafts (``accepted`` of them): its verify pass and draft times and, when known, the
        wall time of the whole round."""
        self.verify_ms[k + 1] = self._ema(self.verify_ms[k + 1], verify_ms)
        if round_ms is not None:
            self.round_ms[k] = self._ema(self.round_ms[k], round_ms)
            self.overhead_ms = self._ema(self.overhead_ms, max(round_ms - verify_ms - draft_ms, 0.0))
        if k:
            self.draft_ms = self._ema(self.draft_ms, draft_ms / k)
            n = min(accepted + 1, k)                  # positions 1..n were tried
            self.tried[1:n + 1] += 1
            self.acc[1:accepted + 1] += 1
        self.rounds += 1

    def alpha(self) -> np.ndarray:
        """α_1..α_MAX_K (index 1..)."""
        return (self.acc + PRIOR_ALPHA * PRIOR_N) / (self.tried + PRIOR_N)

    def verify_cost(self) -> np.ndarray:
        """Estimated verify ms per M (index 1..8): measured where measured, else a line through the measured ones
        (or a constant with one)."""
        v = self.verify_ms.copy()
        m = np.flatnonzero(~np.isnan(v))
        if m.size == 0:
            return np.where(np.arange(v.size) > 0, 1.0, np.nan)
        if m.size == 1:
            fit = np.full(v.size, v[m[0]])
        else:
            b, a = np.polyfit(m, v[m], 1)
            fit = a + b * np.arange(v.size)
        return np.where(np.isnan(v), np.maximum(fit, 1e-3), v)

    def expected(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens per round, ms per token) for k = 0..MAX_K."""
        a = self.alpha()[1:]
        tokens = 1 + np.concatenate([[0.0], np.cumsum(np.cumprod(a))])
        d = 0.0 if np.isnan(self.draft_ms) else self.draft_ms
        o = 0.0 if np.isnan(self.overhead_ms) else self.overhead_ms
        est = self.verify_cost()[1:] + np.arange(MAX_K + 1) * d + o
        cost = np.where(np.isnan(self.round_ms), est, self.round_ms)
        return tokens, cost / tokens

    def choose(self, cap: int) -> int:
        """k for the next round, at most ``cap``: the minimiser of expected ms per token, except every
        EXPLORE_EVERY-th round a k whose round time is unmeasured (else k* + 1), so estimates stay current."""
        if cap <= 0:
            return 0
        _, ms = self.expected()
        best = int(np.argmin(ms[:cap + 1]))
        if self.rounds % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            missing = [k for k in range(cap + 1) if np.isnan(self.round_ms[k])]
            return missing[0] if missing else min(best + 1, cap)
        return best


def probs(logits: np.ndarray, sampler: Sampler) -> np.ndarray:
    """The sampler's distribution over ``logits`` [n] (padding masked when n is the full vocabulary): temperature,
    top-k, top-p of ``ops.filter_logits``, softmax; float64 [n] summing to 1."""
    p = sampler.params
    x = mask_padding(logits) if logits.shape[-1] > FIRST_PADDING_ID else logits
    s = ops.filter_logits(x, float(p.temperature), p.top_k or None, p.top_p).astype(np.float64)
    e = np.exp(s - s.max())
    return e / e.sum()


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """An index ~ p (float64, sums to 1) from one ``rng.random()`` draw; never an index of probability 0."""
    c = np.cumsum(p)
    i = min(int(np.searchsorted(c, rng.random() * c[-1], side="right")), p.size - 1)
    while p[i] == 0:
        i -= 1
    return i


class Speculator:
    """Draft / verify / accept / commit on a CpuExecutor's selected slot; ``chooser`` keeps the measurements.

    ``core_size``: the pruned draft head's static core (None = the full head); ``swap``: the MTP input halves in
    the wrong order (negative control). ``corrupt``: test hook, a function (drafts list) → drafts list applied
    before the verify (forces accept counts whatever the weights)."""

    def __init__(self, executor, core_size: int | None = DRAFT_CORE, swap: bool = False):
        self.ex, self.model = executor, executor.model
        self.mtp = FastMtp(self.model, swap=swap)
        self.core_size = core_size
        self.vocab: dict[int, object] = {}
        self.chooser = KChooser()
        self.corrupt = None
        self.last_ms = (0.0, 0.0)   # (verify, draft) ms of the last round

    def begin(self) -> None:
        """Start a generation on the selected slot: MTP cache allocated, working vocabulary = core + the ids in
        the state."""
        st = self.ex._state
        self.mtp.ensure_state(st)
        slot = self.ex._cur
        if slot not in self.vocab:
            self.vocab[slot] = WorkingVocab(self.model.lm_head, self.core_size, st.capacity)
        v = self.vocab[slot]
        v.reset()
        v.add(st.toks[:st.pos])

    def draft(self, x: int, k: int, sampler: Sampler) -> tuple[list[int], list]:
        """k drafts after the pending token x: (ids, per draft (working ids, q) when sampling, else None)."""
        st, mtp, voc = self.ex._state, self.mtp, self.vocab[self.ex._cur]
        pos = st.pos
        mtp.catch_up(st, pos - 1)
        hn = mtp.forward(st, np.asarray([x], np.int64), st.hid[pos - 1:pos], pos - 1)
        st.mtp_pos = pos
        drafts, qs = [], []
        for i in range(k):
            if i:
                hn = mtp.forward(st, np.asarray([drafts[-1]], np.int64), hn, pos + i - 1)
            ids, lg = voc.logits(hn)
            if sampler.params.greedy:
                drafts.append(int(ids[int(np.argmax(lg[0]))]))
                qs.append(None)
            else:
                q = probs(lg[0], sampler)
                drafts.append(int(ids[draw(q, sampler.rng)]))
                qs.append((ids, q))                                    # q over the working ids (unsorted)
        return drafts, qs

    def accept(self, logits: np.ndarray, drafts: list[int], qs: list, sampler: Sampler) -> list[int]:
        """Tokens to emit from the verify logits [k + 1, V]: accepted drafts, then the correction or bonus."""
        out = []
        for i, d in enumerate(drafts):
            if sampler.params.greedy:
                t = sampler(logits[i])
                if t != d:
                    return out + [t]
            else:
                p = probs(logits[i], sampler)
                ids, q = qs[i]
                w = np.flatnonzero(ids == d)
                qd = float(q[w[0]]) if w.size else 0.0
                if sampler.rng.random() * qd >= p[d]:                 # rejected: p(d)/q(d) ≤ u
                    qf = np.zeros_like(p)
                    qf[ids] = q
                    r = np.maximum(p - qf, 0)
                    return out + [draw(r / r.sum() if r.sum() > 0 else p, sampler.rng)]
            out.append(d)
        return out + [sampler(logits[len(drafts)]) if sampler.params.greedy else draw(probs(logits[-1], sampler), sampler.rng)]

    def round(self, x: int, k: int, sampler: Sampler) -> tuple[list[int], np.ndarray, int]:
        """Draft k, verify [x, drafts] in one recorded pass, accept. Returns (tokens to emit, verify logits
        [k + 1, V], drafts accepted); the state holds all k + 1 rows until ``commit``."""
        t0 = time.perf_counter()
        drafts, qs = self.draft(x, k, sampler)
        if self.corrupt is not None:
            drafts = list(self.corrupt(list(drafts)))
        t1 = time.perf_counter()
        logits = self.model.decode(self.ex._state, [x] + drafts, record=True)
        t2 = time.perf_counter()
        emit = self.accept(logits, drafts, qs, sampler)
        self.last_ms = ((t2 - t1) * 1e3, (t1 - t0) * 1e3)
        return emit, logits, len(emit) - 1

    def commit(self, rows: int, emitted: list[int]) -> None:
        """Keep the first ``rows`` rows of the last round (pending token + rows − 1 drafts); the emitted ids join the
        working vocabulary."""
        self.model.keep_rows(self.ex._state, rows)
        self.vocab[self.ex._cur].add(np.asarray(emitted, np.int64))

    def observed(self, k: int, accepted: int, round_ms: float) -> None:
        """The caller's wall time of a whole round of k drafts (k = 0: a plain step and its token choice) for the
        chooser, with the verify and draft times the last ``round`` measured."""
        verify, draft = (round_ms, 0.0) if k == 0 else self.last_ms
        self.chooser.observe(k, accepted, verify, draft, round_ms)
