"""GPU tests of the chunked prefill (``discrete/prefill.py``; ``qmk_gdn_prefill_in`` / ``_recur`` / ``_out``, ``qmk_gdn_ring_fill``,
``qmk_rmsnorm_rows_grid``; the projection GEMM; the decode attention kernels over row tiles).

Claim: bit identity, no tolerance. After a prompt, the GDN recurrent state and the whole conv ring (all 16 slots),
the KV pages of every position and the next decode step's logits are the same uint16/uint32 patterns whether the
prompt ran as eager 8-row decode passes or through ``Prefill`` (in one call, in several calls split anywhere,
in chunks smaller than the prompt). Every comparison reports its first mismatch. Scratch is poisoned before each
run. Negative control: one prompt id changed at a known position makes the same comparison fail.
"""
from __future__ import annotations

import numpy as np
import pytest

from loader.config import FIRST_PADDING_ID, preset
from loader.synthetic import SyntheticWeights
from tests.tolerance import assert_bits_equal

CAP_TINY = 4352   # room for the 4,097-token split plus the decode step (17 pages)


def _state(step) -> dict:
    """Host bit patterns of everything a prompt leaves: rec, the raw conv rings, K/V up to pos, the position."""
    step.stream.synchronize()
    out = {"pos": step.pos,
           "rec": {i: a.get().view(np.uint32) for i, a in step.rec.items()},
           "ring": {i: a.get() for i, a in step.ring.items()}, "k": {}, "v": {}}
    for j, i in enumerate(step.cfg.full_layers):
        k, v = step.kv.gather(step.sess, j, step.pos)
        out["k"][i], out["v"][i] = k.view(np.uint16), v.view(np.uint16)
    return out


def _next_logits(step, token: int) -> np.ndarray:
    step.run_eager([token])
    return step.buffer("logits", 1)[0].view(np.uint16)


def _compare(a: dict, b: dict) -> None:
    assert a["pos"] == b["pos"], f"positions differ: {a['pos']} vs {b['pos']}"
    for i in a["rec"]:
        assert_bits_equal(f"GDN state, layer {i}", a["rec"][i], b["rec"][i])
        assert_bits_equal(f"conv ring, layer {i}", a["ring"][i], b["ring"][i])
    for i in a["k"]:
        assert_bits_equal(f"K, layer {i}", a["k"][i], b["k"][i])
        assert_bits_equal(f"V, layer {i}", a["v"][i], b["v"][i])
    assert_bits_equal("next step's logits", a["logits"], b["logits"])


def _eager(step, ids, nxt) -> dict:
    step.reset()
    step.poison()
    step.prefill(ids)                 # eager passes of 8 rows
    s = _state(step)
    s["logits"] = _next_logits(step, nxt)
    return s


def _chunked(step, pre, ids, splits, nxt) -> dict:
    step.reset()
    step.poison()
    pre.poison()
    cuts = [0, *splits, len(ids)]
    for a, b in zip(cuts, cuts[1:]):
        pre.run(ids[a:b])
    s = _state(step)
    s["logits"] = _next_logits(step, nxt)
    return s


@pytest.fixture(scope="module")
def tiny_step():  # tests/gpu/conftest.py skips every test here without a device
    from discrete.prefill import Prefill
    from discrete.step import DecodeStep
    from discrete.weights_gpu import WeightsGPU
    cfg = preset("tiny")
    w = WeightsGPU.from_synthetic(SyntheticWeights(cfg, 3))
    step = DecodeStep(cfg, w, CAP_TINY, 1, debug_logits=True)
    # the third: attention launch groups of 24 rows (3 tiles; a chunk's last group and tile partial)
    return step, Prefill(step, chunk=2048), Prefill(step, chunk=64), Prefill(step, chunk=2048, att_rows=24)


def _ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, FIRST_PADDING_ID, size=n)


@pytest.mark.parametrize("T", [1, 7, 8, 9, 63, 64, 65, 127, 300])
def test_one_call_equals_decode_passes(tiny_step, T):
    step, pre, _, pre24 = tiny_step
    ids = _ids(T + 1, T)
    ref = _eager(step, ids[:T], int(ids[T]))
    _compare(ref, _chunked(step, pre, ids[:T], [], int(ids[T])))
    _compare(ref, _chunked(step, pre24, ids[:T], [], int(ids[T])))


@pytest.mark.parametrize("split", [1, 63, 64, 65, 127])
def test_split_calls_and_small_chunks_equal_decode_passes(tiny_step, split):
    """Incremental prefill (two calls) ≡ one pass ≡ decode passes; chunk 64 < prompt runs several chunks;
    attention groups of 24 rows run several attention launches per chunk."""
    step, pre, pre64, pre24 = tiny_step
    ids = _ids(301, 1000 + split)
    ref = _eager(step, ids[:300], int(ids[300]))
    _compare(ref, _chunked(step, pre, ids[:300], [split], int(ids[300])))
    _compare(ref, _chunked(step, pre64, ids[:300], [split], int(ids[300])))
    _compare(ref, _chunked(step, pre24, ids[:300], [split], int(ids[300])))


def test_long_prompt_splits_4095_4097(tiny_step):
    step, pre, _, _ = tiny_step
    ids = _ids(4301, 4095)
    ref = _eager(step, ids[:4300], int(ids[4300]))
    for split in (4095, 4097):
        _compare(ref, _chunked(step, pre, ids[:4300], [split], int(ids[4300])))


def test_negative_control_changed_id_fails(tiny_step):
    step, pre, _, _ = tiny_step
    ids = _ids(101, 5)
    ref = _eager(step, ids[:100], int(ids[100]))
    bad = ids.copy()
    bad[70] = (bad[70] + 1) % FIRST_PADDING_ID
    with pytest.raises(AssertionError):
        _compare(ref, _chunked(step, pre, bad[:100], [], int(ids[100])))


def test_bad_input(tiny_step):
    step, pre, _, _ = tiny_step
    step.reset()
    with pytest.raises(ValueError, match="no ids"):
        pre.run([])
    with pytest.raises(ValueError, match="token ids"):
        pre.run([FIRST_PADDING_ID])
    with pytest.raises(ValueError, match="capacity"):
        pre.run(np.zeros(CAP_TINY + 1, np.int64))
    assert step.pos == 0
    with pytest.raises(ValueError, match="chunk"):
        type(pre)(step, chunk=12)
    with pytest.raises(ValueError, match="att_rows"):
        type(pre)(step, chunk=64, att_rows=12)


def test_27b_prefill_equals_decode_passes(gpu):
    """The 27B's shapes (GEMM split-K factors, 48 value heads, GQA 24:4, head dim 256): 300 ids with one split."""
    from discrete.prefill import Prefill
    from discrete.step import DecodeStep
    from discrete.weights_gpu import WeightsGPU
    cfg = preset("qwen3.5-27b")
    w = WeightsGPU.from_synthetic(SyntheticWeights(cfg, 0))
    step = DecodeStep(cfg, w, 512, 1, debug_logits=True)
    pre = Prefill(step, chunk=256)
    ids = _ids(301, 27)
    ref = _eager(step, ids[:300], int(ids[300]))
    _compare(ref, _chunked(step, pre, ids[:300], [], int(ids[300])))
    _compare(ref, _chunked(step, pre, ids[:300], [65], int(ids[300])))
    _compare(ref, _chunked(step, Prefill(step, chunk=256, att_rows=16), ids[:300], [65], int(ids[300])))
    del pre, step, w
