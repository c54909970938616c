"""Negative controls of every check of the oracle envelope (assembler/ref/envelope.py, docs/tolerance.md), on
candidates built from the goldens themselves: an exact copy of the oracle's prefill path passes, and a copy with a
planted defect fails exactly the check it targets. No model runs: each test takes well under a second."""
from pathlib import Path

import numpy as np
import pytest

from assembler.ref.envelope import BUCKETS, Envelope, load_goldens, margin_bucket, score, sign_test_p

GOLDENS = load_goldens(Path(__file__).resolve().parents[1] / "golden")
pytestmark = pytest.mark.skipif(not GOLDENS, reason="no oracle goldens recorded (python3 -m tests.golden.record)")


@pytest.fixture(scope="module")
def env():
    return Envelope.calibrate(GOLDENS)


def _copy():
    """The oracle's prefill path as a candidate: logits at its top-32 ids (fp32) and argmax, per prompt."""
    return {n: (g["pre_top_vals"].astype(np.float32), g["pre_argmax"].copy()) for n, g in GOLDENS.items()}


def _scores(cand):
    return [score(n, vals, am, GOLDENS[n], "pre") for n, (vals, am) in cand.items()]


def _flip(cand, n, t):
    """Make the candidate's top-1 at (prompt n, position t) the oracle's runner-up."""
    cand[n][1][t] = GOLDENS[n]["pre_top_ids"][t, 1]


def _eligible(env, bucket: int):
    """(prompt, t) where the oracle's paths agree and the margin is in BUCKETS[bucket], in prompt order."""
    out = []
    for n, g in GOLDENS.items():
        p = score(n, g["pre_top_vals"].astype(np.float32), g["pre_argmax"], g, "pre")
        b = margin_bucket(p.margin, p.ulp, env.tie_margin + p.ulp)
        out += [(n, int(t)) for t in np.flatnonzero((b == bucket) & p.self_agree)]
    return out


def _first_rejected(c: int, alpha: float) -> int:
    b = c + 1
    while sign_test_p(b, c) >= alpha:
        b += 1
    return b


def test_sign_test_values():
    assert sign_test_p(3, 0) == 1 / 8 and sign_test_p(0, 7) == 1.0
    assert sign_test_p(10, 0) < 1e-3 <= sign_test_p(9, 0)
    assert 0.5 < sign_test_p(20, 20) < 0.6


def test_exact_copy_passes(env):
    ok, fails = env.check(_scores(_copy()))
    assert ok, fails


@pytest.mark.parametrize("stat", ["max", "p99", "p50", "mean"])
def test_d32_statistic_rejects(env, stat):
    """Shift the candidate's logits at chosen positions of one prompt so that one d32 statistic (after the
    one-ulp allowance) exceeds its bound."""
    cand = _copy()
    vals, _ = cand["prose"]
    T, u = len(vals), np.float32(0.125)
    assert np.all(score("prose", vals, cand["prose"][1], GOLDENS["prose"], "pre").ulp == u)
    b = {k: np.float32(v) for k, v in env.d32.items()}
    if stat == "max":
        vals[T // 2] += b["max"] + 2 * u
    elif stat == "p99":
        vals[: T * 3 // 100] += b["p99"] + 2 * u
    elif stat == "p50":
        vals[: T * 52 // 100] += b["p50"] + 2 * u
    else:
        vals[: T * 49 // 100] += b["p50"] + 2 * u
        vals[T * 49 // 100:] += b["p50"] + u
    fails = env.check_d32(_scores(cand))
    assert any(f"d32 {stat} " in f for f in fails), fails
    assert not env.check_top1(_scores(cand))


def test_top1_clear_position_rejects(env):
    """(a): one flip where the oracle's margin exceeds the tie bound."""
    cand = _copy()
    n, t = _eligible(env, BUCKETS.index("clear"))[0]
    _flip(cand, n, t)
    fails = env.check_top1(_scores(cand))
    assert len(fails) == 1 and fails[0].startswith("(a)"), fails


@pytest.mark.parametrize("bucket", [0, 1, 2, 3])
def test_top1_bucket_rejects(env, bucket):
    """(b): in one margin bucket, the fewest candidate-only misses the sign test rejects; one fewer passes."""
    c = next(r["c"] for r in env.top1_table(_scores(_copy())) if r["bucket"] == BUCKETS[bucket])
    need = _first_rejected(c, env.alpha)
    sites = _eligible(env, bucket)
    assert len(sites) >= need
    cand = _copy()
    for n, t in sites[:need - 1]:
        _flip(cand, n, t)
    assert not env.check_top1(_scores(cand))
    _flip(cand, *sites[need - 1])
    fails = env.check_top1(_scores(cand))
    assert any(f.startswith(f"(b) bucket {BUCKETS[bucket]}:") for f in fails), fails


def test_top1_pooled_rejects(env):
    """(c): in every bucket one miss fewer than the bucket test rejects; pooled, the excess is significant."""
    cand = _copy()
    table = {r["bucket"]: r for r in env.top1_table(_scores(cand))}
    for k in range(4):
        for n, t in _eligible(env, k)[:_first_rejected(table[BUCKETS[k]]["c"], env.alpha) - 1]:
            _flip(cand, n, t)
    fails = env.check_top1(_scores(cand))
    assert fails and all(f.startswith("(c) pooled") for f in fails), fails


def test_calibration_refuses_clear_self_flips():
    """Rule (a) demands 100 %: calibrating on an oracle that flips above its own tie margin must fail."""
    g = dict(GOLDENS["prose"])
    top = g["pre_top_vals"].astype(np.float32)
    t = int(np.flatnonzero(top[:, 0] - top[:, 1] > 1.0)[0])
    g["dec_argmax"] = g["dec_argmax"].copy()
    g["dec_argmax"][t] = g["pre_top_ids"][t, 1]
    with pytest.raises(ValueError, match="flips above the tie margin"):
        Envelope.calibrate({**GOLDENS, "prose": g})
