"""min_p sampling and per-token log-probabilities on the host path (``host.sampling``), with synthetic logits."""
from __future__ import annotations

import numpy as np
import pytest

from host.errors import InvalidArgument
from host.sampling import Sampler, SamplingParams, token_logprobs
from loader.config import FIRST_PADDING_ID

V = FIRST_PADDING_ID + 243  # a row as long as the real vocabulary, padding rows included


def _logits(seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(0, 1, V).astype(np.float32)
    x[FIRST_PADDING_ID:] = 50.0  # padding rows would win if they were not masked
    return x


def test_min_p_one_is_the_argmax_and_zero_is_off():
    x = _logits(0)
    best = int(np.argmax(x[:FIRST_PADDING_ID]))
    s = Sampler(SamplingParams(temperature=1.5, min_p=1.0, seed=3))
    assert {s(x) for _ in range(20)} == {best}
    a = Sampler(SamplingParams(temperature=1.0, seed=5))
    b = Sampler(SamplingParams(temperature=1.0, seed=5, min_p=0.0))
    assert [a(x) for _ in range(10)] == [b(x) for _ in range(10)]


def test_min_p_drops_exactly_the_tokens_below_the_threshold():
    x = np.full(V, -30.0, np.float32)
    x[[10, 11, 12]] = [0.0, np.log(0.5), np.log(0.2)]  # p relative to the best: 1, 0.5, 0.2
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.3, seed=11))
    draws = {s(x) for _ in range(300)}
    assert draws == {10, 11}  # 12 (0.2 < 0.3) never; both above it do come up
    loose = Sampler(SamplingParams(temperature=1.0, min_p=0.1, seed=11))
    assert 12 in {loose(x) for _ in range(300)}


def test_token_logprobs_is_the_log_softmax_without_padding():
    x = _logits(1)
    tok = 123
    lp, top = token_logprobs(x, tok, 5)
    ref = x[:FIRST_PADDING_ID].astype(np.float64)
    ref = ref - (ref.max() + np.log(np.exp(ref - ref.max()).sum()))
    assert lp == pytest.approx(ref[tok], abs=1e-9)
    assert [i for i, _ in top] == list(np.argsort(-ref, kind="stable")[:5])
    assert all(i < FIRST_PADDING_ID for i, _ in top)
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert token_logprobs(x, tok, 0)[1] == []


def test_bad_values_are_refused():
    with pytest.raises(InvalidArgument, match="min_p"):
        SamplingParams(temperature=1.0, min_p=1.5)
    with pytest.raises(InvalidArgument, match="min_p"):
        SamplingParams(temperature=1.0, min_p=True)
