"""Checkpoint-anchored chunking of the fast CPU model (``host/cpu_fast.py``, executor kind ``cpu``): after any
sequence of prefill / decode / snapshot-restore / verify-rollback calls, a prefill leaves logits (of the rows
asked), GDN recurrent and conv state and the K/V cache bit-identical to ONE prefill of the whole history
(GDN chunks of 64 anchored at the sequence start; docs/INTERFACES.md §2). Compared as uint views, bit for bit.
Negative controls: chunks anchored at the call's first token (``prefill(..., anchored=False)``) differ.
"""
from __future__ import annotations

import numpy as np
import pytest

TOTAL = 300          # tokens of the one-pass reference history (crosses four 64-boundaries)
CAP = 400


@pytest.fixture(scope="module")
def weights(tiny_ckpt):
    from loader.checkpoint import Checkpoint
    return Checkpoint.open(tiny_ckpt)


@pytest.fixture(scope="module")
def ex(weights):
    """One ``cpu`` executor of two slots for the module (tests reset the slots they use)."""
    from host.executors import CpuExecutor
    return CpuExecutor(weights, capacity=CAP, slots=2)


@pytest.fixture(scope="module")
def model(ex):
    return ex.model


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(23).integers(0, 248000, TOTAL).astype(np.int64)


def _bits(st, logits=None) -> dict:
    """Every part of the state a later call reads, as integer views (copies), plus the given logits rows."""
    out = {"pos": st.pos}
    for i in st.rec:
        out[f"rec{i}"] = st.rec[i].view(np.uint32).copy()
        out[f"conv{i}"] = st.conv[i].view(np.uint32).copy()
    for i in st.k:
        out[f"k{i}"] = st.k[i][:, :st.pos].view(np.uint32).copy()
        out[f"v{i}"] = st.v[i][:, :st.pos].view(np.uint32).copy()
    if logits is not None:
        out["logits"] = np.asarray(logits).view(np.uint16).copy()
    return out


def _diff(a: dict, b: dict) -> list[str]:
    """Names of the parts that differ (empty: bit-identical)."""
    assert a.keys() == b.keys()
    return [k for k in a if not np.array_equal(a[k], b[k])]


def _one_pass(model, hist):
    """State bits (final-normed rows included) and the last row's logits after one prefill of ``hist``."""
    st = model.new_state(CAP)
    lg = model.prefill(st, hist, logit_rows=[len(hist) - 1])
    return {**_bits(st, lg), "hid": st.hid[:st.pos].view(np.uint32).copy()}, st


@pytest.fixture(scope="module")
def whole(model, ids):
    """One prefill of all TOTAL ids: (bits, state)."""
    return _one_pass(model, ids)


def _with_hid(st, logits):
    return {**_bits(st, logits), "hid": st.hid[:st.pos].view(np.uint32).copy()}


@pytest.mark.parametrize("split", [1, 63, 64, 65, 127, 200])
def test_two_prefills_equal_one(model, ids, whole, split):
    """prefill(first) then prefill(rest) ≡ prefill(all): last-row logits, final-normed rows of every position
    (the lm_head is row-invariant, so every row's logits), GDN state, K/V."""
    want, one = whole
    st = model.new_state(CAP)
    model.prefill(st, ids[:split], logit_rows="none")
    assert st.anchor == split // 64 * 64
    got = _with_hid(st, model.prefill(st, ids[split:], logit_rows=[TOTAL - split - 1]))
    assert _diff(got, want) == []
    assert st.anchor == one.anchor == TOTAL // 64 * 64 and np.array_equal(st.toks[:TOTAL], ids)


def test_many_small_prefills_equal_one(model, ids, whole):
    """Seven calls of uneven sizes (some ending on a multiple of 64) ≡ one call."""
    st = model.new_state(CAP)
    cuts = [0, 5, 64, 70, 128, 191, 250, TOTAL]
    for s, e in zip(cuts, cuts[1:]):
        lg = model.prefill(st, ids[s:e], logit_rows=[e - s - 1])
    assert _diff(_with_hid(st, lg), whole[0]) == []


def test_call_anchored_append_differs(model, ids):
    """Negative control: the same two calls with chunks anchored at the second call's first token (the rule
    without the anchor) change the logits, the GDN state and the K/V written by the second call."""
    want, _ = _one_pass(model, ids[:140])
    st = model.new_state(CAP)
    model.prefill(st, ids[:100], logit_rows="none")
    got = _with_hid(st, model.prefill(st, ids[100:140], logit_rows=[39], anchored=False))
    bad = _diff(got, want)
    assert "logits" in bad and any(k.startswith("rec") for k in bad) and any(k.startswith("k") for k in bad), bad
    n = int((got["logits"] != want["logits"]).sum())
    print(f"call-anchored append 100 + 40: {n} of {got['logits'].size} last-row logits differ")


@pytest.mark.parametrize("a,n", [(100, 5), (60, 10), (128, 3)], ids=["A100+5", "A60+10-crosses-64", "A128+3"])
def test_prefill_decode_prefill_equals_one_prefill(ex, ids, a, n):
    """Executor level: prefill A, n tokens through step() (recurrent rule), prefill B ≡ one prefill of
    A + decoded + B (the decoded tokens are re-run from the anchor); the control without the re-run differs."""
    hist = ids[:a + n + 40]
    ex.reset(0)
    ex.prefill(hist[:a])
    for t in hist[a:a + n]:
        ex.step(int(t))
    assert ex._state.anchor == a // 64 * 64 and ex.position == a + n
    got = _with_hid(ex._state, ex.prefill(hist[a + n:]).logits)
    want, _ = _one_pass(ex.model, hist)
    assert _diff(got, {**want, "logits": want["logits"][-1]}) == []
    ex.reset(0)                                                       # control: the append alone after the steps
    ex.prefill(hist[:a])
    for t in hist[a:a + n]:
        ex.step(int(t))
    st = ex._state
    lg = ex.model.prefill(st, hist[a + n:], logit_rows=[39], anchored=False)
    assert "logits" in _diff(_with_hid(st, lg), want)


def test_snapshot_restore_mid_history(ex, ids):
    """Snapshot after prefill + steps (anchor behind the position); a diverging continuation (prefill, steps);
    restore: steps give the bits they gave straight after the snapshot, and a prefill then equals one prefill of
    the restored history + the new ids. The arrays are restored in place (the slot's own storage)."""
    ex.reset(0)
    ex.prefill(ids[:100])
    for t in ids[100:103]:
        ex.step(int(t))
    snap = ex.state_snapshot()
    st = ex._state
    arrays = [id(x) for d in (st.rec, st.conv, st.ck_rec, st.ck_conv, st.k, st.v) for x in d.values()]
    after = [ex.step(int(t)).logits.view(np.uint16).copy() for t in (7, 8)]
    ex.prefill(ids[200:290])                                          # re-runs from 64: rewrites K/V rows 64..
    for t in (9, 10, 11):
        ex.step(t)
    ex.state_restore(snap)
    assert ex.position == 103 and st.anchor == 64
    assert [id(x) for d in (st.rec, st.conv, st.ck_rec, st.ck_conv, st.k, st.v) for x in d.values()] == arrays
    again = [ex.step(int(t)).logits.view(np.uint16).copy() for t in (7, 8)]
    assert all(np.array_equal(x, y) for x, y in zip(again, after))
    ex.state_restore(snap)
    got = _with_hid(st, ex.prefill(ids[103:160]).logits)
    want, _ = _one_pass(ex.model, ids[:160])
    assert _diff(got, {**want, "logits": want["logits"][-1]}) == []


def test_slots_keep_their_own_anchor(ex, ids):
    """Two slots interleaved, each prefill / step / prefill, each equal to its own one-pass history."""
    hist = {0: ids[:150], 1: ids[150:][::-1][:150]}
    for s in (0, 1):
        ex.reset(s)
        ex.prefill(hist[s][:70 + 10 * s])
    for j in range(3):
        for s in (0, 1):
            ex.select(s)
            ex.step(int(hist[s][70 + 10 * s + j]))
    out = {}
    for s in (0, 1):
        ex.select(s)
        out[s] = _with_hid(ex._state, ex.prefill(hist[s][73 + 10 * s:]).logits)
    for s in (0, 1):
        want, _ = _one_pass(ex.model, hist[s])
        assert _diff(out[s], {**want, "logits": want["logits"][-1]}) == [], s


@pytest.mark.parametrize("keep", [1, 3, 5])
def test_verify_rollback_then_prefill(model, ids, keep):
    """Speculative decoding's verify pass (``decode(record=True)`` of 5 rows) rolled back to ``keep`` rows
    (``keep_rows``): the ids since the anchor roll back with the position, so a prefill then equals one prefill
    of the kept history + the new ids."""
    st = model.new_state(CAP)
    model.prefill(st, ids[:90], logit_rows="none")
    model.decode(st, ids[90:91])
    model.decode(st, np.r_[ids[91:91 + keep], [5] * (5 - keep)], record=True)   # rejected rows: other ids
    model.keep_rows(st, keep)
    assert st.pos == 91 + keep
    got = _with_hid(st, model.prefill(st, ids[91 + keep:150], logit_rows=[150 - 92 - keep]))
    want, _ = _one_pass(model, ids[:150])
    assert _diff(got, want) == []


def test_bad_call_leaves_the_state(model, ids):
    """A refused prefill (id out of range, past the capacity) changes nothing, anchor included."""
    st = model.new_state(100)
    model.prefill(st, ids[:70], logit_rows="none")
    model.decode(st, ids[70:71])
    before = _bits(st)
    with pytest.raises(ValueError, match="ids in"):
        model.prefill(st, [1, 248320])
    with pytest.raises(ValueError, match="capacity"):
        model.prefill(st, ids[:40])
    assert _diff(_bits(st), before) == [] and st.anchor == 64
