"""The replay benchmark's accounting (``bench.replay``) on the trained model, cpu executor, a tiny subset of the
committed trajectory fixture: fixed-count generation (EOS does not stop it), resident prefix reuse, stateless
re-prefill, totals that add up; and negative controls showing the check fails when the accounting is broken."""
from __future__ import annotations

import copy

import pytest

from bench import replay
from bench.trajectories.record import FIXTURE, load
from loader.config import IM_END_ID

CUT = 4  # generated ids kept per step: a prefix of a greedy reply is what greedy replay generates


@pytest.fixture(scope="module")
def eng():
    from host.engine import Engine
    return Engine.load(executor="cpu", capacity=4096, slots=2, quiet=True)


@pytest.fixture(scope="module")
def traj():
    """The smallest trajectory's first two steps, each reply cut to its first CUT ids."""
    t = min(load(FIXTURE)["trajectories"], key=lambda t: t["context"])
    t = copy.deepcopy(t)
    t["steps"] = [dict(s, generated=s["generated"][:CUT]) for s in t["steps"][:2]]
    return t


def test_fixture_is_well_formed():
    doc = load(FIXTURE)
    assert doc["meta"]["model"] == "qwen3.5-tiny-trained" and doc["trajectories"]
    for t in doc["trajectories"]:
        n = sum(len(s["append"]) + len(s["generated"]) for s in t["steps"])
        assert n == t["context"], t["name"]
        assert all(s["generated"] and s["append"] for s in t["steps"]), t["name"]


@pytest.fixture(scope="module")
def runs(eng, traj):
    """(resident, stateless) replays of ``traj``."""
    return replay.replay_one(eng, traj, "resident"), replay.replay_one(eng, traj, "stateless")


def test_resident_and_stateless_accounting(runs):
    res, sta = copy.deepcopy(runs)
    assert replay.check_accounting(res) == [] and replay.check_accounting(sta) == []
    r0, r1 = res["steps"]
    assert [r["generated_tokens"] for r in res["steps"] + sta["steps"]] == [CUT] * 4
    # step 0 is the recorded conversation (a cut greedy reply is its prefix); step 1 follows a cut reply, so the
    # model's answer to it may differ from the recording, which only its ids_match reports
    assert res["steps"][0]["ids_match"] and sta["steps"][0]["ids_match"]
    assert r1["reused_tokens"] == r1["prompt_tokens"] - r1["appended_tokens"] - 1  # all but the new ids
    assert r1["prefilled_tokens"] == r1["appended_tokens"] + 1 and r1["re_prefilled_tokens"] == 0
    s1 = sta["steps"][1]
    assert s1["reused_tokens"] == 0 and s1["prefilled_tokens"] == s1["prompt_tokens"]
    assert s1["re_prefilled_tokens"] == s1["prompt_tokens"] - s1["appended_tokens"] - 1
    for run in (res, sta):
        t = run["totals"]
        assert t["wall_ms"] == pytest.approx(t["prefill_ms"] + t["decode_ms"] + t["host_ms"], abs=0.01)
        assert t["prefilled_tokens"] == sum(r["prefilled_tokens"] for r in run["steps"])
        assert all(r["host_ms"] >= 0 for r in run["steps"])
    res["executor"] = sta["executor"] = "cpu"
    sp = replay.speedups([res, sta])["cpu"]
    assert sp["total"] == pytest.approx(sta["totals"]["wall_ms"] / res["totals"]["wall_ms"], rel=1e-3)


def test_fixed_count_runs_past_eos(eng, traj):
    """A recorded count past the reply's EOS is generated in full: the replay disables the stop ids."""
    t = copy.deepcopy(traj)
    full = load(FIXTURE)["trajectories"]
    src = next(x for x in full if x["name"] == t["name"])["steps"][0]["generated"]
    assert src[-1] == IM_END_ID  # the first reply ended by itself
    t["steps"] = [dict(t["steps"][0], generated=src + [IM_END_ID, IM_END_ID])]
    run = replay.replay_one(eng, t, "grammar_off")
    assert run["steps"][0]["generated_tokens"] == len(src) + 2


def test_check_fails_on_broken_accounting(runs):
    """Negative controls: a replay that kept no state reported as resident, a wrong generated count, totals that
    do not add up: each must be reported."""
    res, sta = runs
    assert any("resident prefilled" in p for p in replay.check_accounting(dict(sta, config="resident")))
    assert any("stateless reused" in p for p in replay.check_accounting(dict(res, config="stateless")))
    bad = copy.deepcopy(sta)
    bad["steps"][1]["generated_tokens"] -= 1
    assert any("generated" in p for p in replay.check_accounting(bad))
    bad = copy.deepcopy(sta)
    bad["totals"]["prefilled_tokens"] += 1
    assert any("totals" in p for p in replay.check_accounting(bad))
