"""Token selection for the host loop: padding mask, greedy argmax, seeded sampling.

The math lives in the reference ops (``assembler.ref.ops.argmax``: lowest id wins ties;
``assembler.ref.ops.sample``: transformers' temperature → top-k (value threshold) → top-p tie rules);
this module only validates parameters, routes a temperature below SAMPLING_EPS (1e-5, vLLM's rule) to the
argmax, masks the padding rows and owns the seeded generator
(``numpy.random.Generator(PCG64(seed))``), so a (prompt, params, seed) triple always gives the same tokens.
It also holds the argument checks the Python API and the CLI share (``check_generation_args``, ``check_text``).
"""
from __future__ import annotations

import os
import secrets
import sys
import warnings
from dataclasses import dataclass

import numpy as np

from assembler.ref import ops
from host.errors import IgnoredArgumentWarning, InvalidArgument
from host.limits import DEFAULT_MAX_NEW_TOKENS, EPS_TEXT, SAMPLING_EPS  # noqa: F401 (re-exported)
from loader.config import FIRST_PADDING_ID

_HOST_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _real(v) -> bool:
    """A real number of Python or NumPy (``np.float32(0.5)``, ``np.int64(1)``), not a bool (``True`` is an int to
    Python, never a sampling value)."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _integer(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _as_python(v):
    """A NumPy scalar as the Python int / float of the same value (results and ``--json`` hold plain numbers)."""
    return int(v) if isinstance(v, np.integer) else float(v) if isinstance(v, np.floating) else v


def _shown(v) -> str:
    """``repr(v)``, cut short when long (an int such as 10**400 has 401 digits)."""
    r = repr(v)
    return r if len(r) <= 40 else f"{r[:20]}... ({len(r)} characters)"


def _finite(v) -> bool:
    """``v`` converts to a finite float (an int too large for a float, such as 10**400, does not)."""
    try:
        return bool(np.isfinite(float(v)))
    except OverflowError:
        return False


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy, and so is any temperature below 1e-5 (SAMPLING_EPS, vLLM's rule: dividing the
    logits by a smaller one overflows); top_k None/0, top_p None/1.0 and min_p None/0.0 disable those filters
    (min_p: drop every token whose probability is below min_p times the most likely one's, after top-k and top-p,
    transformers' order); seed None = fresh
    entropy (the seed actually drawn is recorded in the result, so any run can be replayed). Numbers may be Python
    or NumPy scalars (stored as Python numbers); booleans are refused. Raises InvalidArgument."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        if not _real(t) or not _finite(t) or t < 0:
            raise InvalidArgument(f"temperature: expected a finite number >= 0, got {_shown(t)}")
        if k is not None and (not _integer(k) or k < 0):
            raise InvalidArgument(f"top_k: expected an integer >= 0 (0 = off), got {k!r}")
        if p is not None and (not _real(p) or not 0.0 < p <= 1.0):
            raise InvalidArgument(f"top_p: expected a number in (0, 1], got {_shown(p)}")
        if seed is not None and (not _integer(seed) or seed < 0):
            raise InvalidArgument(f"seed: expected an integer >= 0, got {seed!r}")
        m = self.min_p
        if m is not None and (not _real(m) or not 0.0 <= m <= 1.0):
            raise InvalidArgument(f"min_p: expected a number in [0, 1] (0 = off), got {_shown(m)}")
        for name in ("temperature", "top_k", "top_p", "seed", "min_p"):
            object.__setattr__(self, name, _as_python(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        """Greedy decoding: temperature below SAMPLING_EPS (0 included)."""
        return self.temperature < SAMPLING_EPS


def check_generation_args(params: SamplingParams, max_new_tokens: int | None, capacity: int,
                          context: int | None = None, *, context_of: str = "max_position_embeddings",
                          cli: bool = False) -> int:
    """The checks of generation arguments that ``Session.generate`` (so ``Engine.generate`` / ``chat``) and the
    CLI's ``generate`` / ``chat`` (before the model loads) share. Returns ``max_new_tokens``, or for None
    DEFAULT_MAX_NEW_TOKENS lowered to ``capacity`` - 1 (and ``context`` - 1) when smaller.

    ``capacity``: the tokens a session holds, prompt and reply together (``Engine.load(capacity=)``,
    ``--capacity``); ``context``: the model's max_position_embeddings, None where not known yet (the CLI's
    ``--model DIR`` before loading); ``context_of`` says in the message where ``context`` comes from; ``cli``:
    messages name CLI flags (``--capacity``) instead of Python arguments.

    Raises InvalidArgument when ``max_new_tokens`` is not an integer >= 1 or exceeds ``context`` - 1 or
    ``capacity`` - 1 (a ``capacity`` < 2, which leaves no room for a reply, is refused by ``Engine.load`` and the
    CLI's ``--capacity`` type before this runs). The arithmetic is vLLM's prompt + generated <= max_model_len (the
    session loop's too) with the shortest prompt, one token: the prompt itself is not counted here, since a
    session's prompt is the whole conversation (earlier turns included), unknown to the CLI before the model
    loads, and a reply that fills the session ends with finish_reason ``length``, finish_detail ``capacity``.

    Warns (``warnings.warn``, IgnoredArgumentWarning naming the arguments, attributed to the first caller outside
    ``host/``) when decoding is greedy (temperature below SAMPLING_EPS, 0 included) and top_k (other than 0 =
    off), top_p (other than 1.0 = off) or seed is given: they have no effect there (vLLM ignores them too).
    """
    n = max_new_tokens
    if n is None:
        n = max(1, min([DEFAULT_MAX_NEW_TOKENS, capacity - 1] + ([context - 1] if context else [])))
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 1:
        raise InvalidArgument(f"max_new_tokens: expected an integer >= 1, got {n!r}")
    n = int(n)
    if context is not None and n >= context:
        raise InvalidArgument(f"max_new_tokens: {n} exceeds {context - 1}, the most the model's context of {context} "
                              f"tokens ({context_of}) leaves after a prompt of at least 1 token")
    if n >= capacity >= 1:
        raise InvalidArgument(
            f"max_new_tokens: {n} exceeds {capacity - 1}, the most --capacity {capacity} leaves for the reply (the "
            f"session holds prompt and reply together, the prompt at least 1 token); lower --max-new-tokens or "
            f"raise --capacity" if cli else
            f"max_new_tokens: {n} exceeds {capacity - 1}, the most the session capacity of {capacity} tokens leaves "
            f"for the reply (prompt and reply together, the prompt at least 1 token); lower max_new_tokens or load "
            f"the engine with a larger capacity (Engine.load(..., capacity=N))")
    if params.greedy:
        names = [name for name, v, off in (("top_k", params.top_k, 0), ("top_p", params.top_p, 1.0),
                                           ("min_p", params.min_p, 0.0), ("seed", params.seed, None))
                 if v is not None and v != off]
        if names:
            shown = ["--" + x.replace("_", "-") for x in names] if cli else names
            listed = shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]
            t = "--temperature" if cli else "temperature"
            why = f"{t} 0" if params.temperature == 0 else f"{t} {params.temperature!r}, below {EPS_TEXT}"
            msg = (f"{listed} {'has' if len(shown) == 1 else 'have'} no effect under greedy decoding "
                   + (f"({why}); give {t} >= {EPS_TEXT} to sample" if cli else
                      f"({why}) and {'is' if len(shown) == 1 else 'are'} ignored; pass {t} >= {EPS_TEXT} "
                      "to sample"))
            warnings.warn(IgnoredArgumentWarning(msg, tuple(names)), stacklevel=_outside_host_stacklevel())
    return n


def check_text(text: str, what: str) -> None:
    """InvalidArgument naming ``what`` when ``text`` cannot be UTF-8 encoded: bytes that are not UTF-8 on the
    command line or stdin (Python keeps them as lone surrogates), which the tokenizer refuses. Used by
    ``Engine.encode`` and by the CLI before the model loads."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(f"{what}: not valid UTF-8 (undecodable byte at character {e.start}); pass UTF-8 "
                              f"text") from None


def _outside_host_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` made in a function that calls this one directly: the first frame
    whose code is not under ``host/`` (the user's call, not the engine's internals)."""
    f, level = sys._getframe(1), 1
    while f.f_back is not None and f.f_code.co_filename.startswith(_HOST_DIR):
        f, level = f.f_back, level + 1
    return level


def mask_padding(logits: np.ndarray) -> np.ndarray:
    """Copy of ``logits`` ([V] or [M, V], any float dtype) with ids >= FIRST_PADDING_ID set to -inf, so no
    padding id can ever win (ids 248077.. are unused model rows, spec §7)."""
    out = np.array(logits, copy=True)
    out[..., FIRST_PADDING_ID:] = -np.inf
    return out


class Sampler:
    """Chooses the next token from one row of logits ([V] bf16, as the executors return them): the argmax when
    ``params.greedy`` (temperature below SAMPLING_EPS), else a seeded draw of ``ops.sample``."""

    def __init__(self, params: SamplingParams):
        self.params = params
        # greedy decoding draws nothing: no seed to record; sampling records the seed used so runs replay
        self.seed = params.seed if (params.seed is not None or params.greedy) else secrets.randbits(63)
        self.rng = np.random.Generator(np.random.PCG64(self.seed))

    def choose(self, out, allowed: np.ndarray | None = None) -> int:
        """Next token for a step's output ``out`` (a ``StepOutput``): the device's greedy token when decoding is
        greedy and the executor chose one; a draw on the device when the executor offers one
        (``out.sample_on_device``, the same rules and the same draw u as the host's); else the host's choice from
        ``out.logits``. ``allowed``: a grammar's bool [V] mask (``host.grammar.Constraint.allowed``); when given,
        the choice is always the host's, from ``out.logits`` with every other id at -inf (on a GPU executor that
        fetches the logits row from the device). Raises ValueError when the output holds neither logits nor a
        token, or the mask admits no id."""
        p = self.params
        if allowed is not None:
            if out.logits is None:
                raise ValueError("a grammar needs the step's logits, and the step returned none")
            return self(out.logits, allowed)
        if p.greedy and getattr(out, "token", None) is not None:
            return int(out.token)
        dev = getattr(out, "sample_on_device", None)
        if dev is not None and not p.greedy and not p.min_p:  # the device draw has no min-p filter
            return int(dev(float(p.temperature), p.top_k or 0, p.top_p, float(self.rng.random())))
        if out.logits is None:
            raise ValueError("the step returned neither logits nor a token")
        return self(out.logits)

    def __call__(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> int:
        """Next token id for ``logits`` [V] (bf16 or fp32); never a padding id; with ``allowed`` (bool [V]) never
        an id it excludes (ValueError when it admits none)."""
        if logits.ndim != 1:
            raise ValueError(f"Sampler: expected logits of shape [V], got {logits.shape}")
        x = mask_padding(logits)
        if allowed is not None:
            if allowed.shape != x.shape or not allowed[:FIRST_PADDING_ID].any():
                raise ValueError(f"Sampler: the grammar mask (shape {allowed.shape}) admits no id of the "
                                 f"{x.shape[0]} logits")
            x[~allowed] = -np.inf
        p = self.params
        if p.greedy:
            tok = int(ops.argmax(x))
        else:
            top_k = p.top_k if p.top_k else 0
            top_p = p.top_p if p.top_p is not None else 1.0
            if p.min_p:  # after temperature, top-k and top-p (transformers' MinPLogitsWarper comes last)
                s = ops.filter_logits(x, float(p.temperature), top_k, top_p)
                s[s < s.max() + np.float32(np.log(p.min_p))] = -np.inf  # p_i < min_p * p_max (the max is kept)
                tok = int(ops.sample(s, 1.0, 0, None, self.rng))   # the same draw on the filtered scores
            else:
                tok = int(ops.sample(x, float(p.temperature), top_k, top_p, self.rng))
        assert tok < FIRST_PADDING_ID, f"sampler chose padding id {tok}"  # the mask makes this impossible
        return tok



def token_logprobs(logits: np.ndarray, token: int, top: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of ``token``, the ``top`` most likely (id, log-probability) pairs, most likely first, ties
    by lower id) under the model's own distribution: log-softmax of the fp32 logits [V] with the padding rows
    masked, before any temperature or filter (vLLM's default ``raw_logprobs``, what OpenAI's ``logprobs`` reports).
    """
    x = mask_padding(np.asarray(logits, dtype=np.float32)).astype(np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    lp = x - lse
    pairs: list[tuple[int, float]] = []
    if top > 0:
        k = min(int(top), FIRST_PADDING_ID)
        cand = np.argpartition(-lp, k - 1)[:k]
        cand = cand[np.lexsort((cand, -lp[cand]))]
        pairs = [(int(i), float(lp[i])) for i in cand]
    return float(lp[int(token)]), pairs
