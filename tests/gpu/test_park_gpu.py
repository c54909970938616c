"""Parking a session in pinned host memory on the GPU executors (``GraphExecutor.park`` / ``unpark``, shared by the
megakernel executor), tiny preset.

A slot parked after 300 prompt ids and 5 decode steps (KV rows on a full page and on a partial second page),
then poisoned (KV pool with large finite bf16 noise, GDN state and conv rings with NaN, activations with NaN) and
used by another prompt, then unparked,
must continue bit for bit as the slot did in place: the greedy tokens and the logits (bf16 bits) of 12 more
steps. A state snapshot parked with it comes back as a device snapshot that restores the same continuation.
Negative controls: one K row changed in the parked full page, and one in the parked partial page, each change
the logits. Then the same through ``Session.park`` / ``unpark``: a parked session's next turn equals a fresh
generation over the whole conversation.
"""
from __future__ import annotations

import numpy as np
import pytest

N_PROMPT, N_MORE, N_CHECK = 300, 5, 12
BF16_EIGHT = 0x4100  # bf16 bits of 8.0: a K row of it dominates its attention scores
KV_NOISE = 0x4780    # bf16 bits of 65536.0: what the KV pool holds past the rows unpark writes


@pytest.fixture(scope="module", params=["graph", "megakernel"])
def eng(request):  # tests/gpu/conftest.py skips every test here without a device
    from host.engine import Engine
    return Engine.load("tiny", executor=request.param, capacity=640, quiet=True)


def _steps(ex, tok: int, n: int) -> tuple[list[int], list[np.ndarray]]:
    """n greedy steps from ``tok``: (the device's tokens, each step's logits as uint16 bits)."""
    toks, bits = [], []
    for _ in range(n):
        out = ex.step(tok)
        bits.append(np.asarray(out.logits).view(np.uint16).copy())
        tok = out.token
        toks.append(tok)
    return toks, bits


def _poison(ex) -> None:
    """Poison the whole slot: KV pool (large finite noise, as stale rows of another session would be), GDN
    recurrent state and conv rings (NaN), activations (NaN, ``DecodeStep.poison``)."""
    d = ex.dstep
    with d.stream:
        d.kv.pool.fill(KV_NOISE)
        for a in d.rec.values():
            a.fill(np.nan)
        for a in d.ring.values():
            a.fill(0xFFFF)
    d.poison()
    d.stream.synchronize()


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_park_unpark_continues_bit_identically_and_corrupted_rows_do_not(gpu, eng):
    ex = eng.executor
    ex.reset(0)
    prompt = [(7 * i + 11) % 4000 + 100 for i in range(N_PROMPT)]
    tok0 = ex.prefill(prompt).token
    snap = ex.state_snapshot()  # at the prompt's end
    first_toks, first_bits = _steps(ex, tok0, N_MORE)
    parked = ex.park([snap])
    assert parked.position == N_PROMPT + N_MORE == ex.position
    assert parked.data["kv_full"].shape[0] == 1 and parked.data["kv_tail"].shape[3] == N_PROMPT + N_MORE - 256
    assert parked.nbytes == ex.park_nbytes([snap])
    ref_toks, ref_bits = _steps(ex, first_toks[-1], N_CHECK)  # in place: the reference

    _poison(ex)
    ex.reset(0)
    ex.prefill([5 + i for i in range(40)])  # another conversation used the slot
    _poison(ex)
    snaps = ex.unpark(parked, 0)
    assert ex.position == parked.position
    toks, bits = _steps(ex, first_toks[-1], N_CHECK)
    assert toks == ref_toks
    assert _same(bits, ref_bits), "logits differ after park / unpark"

    ex.state_restore(snaps[0])  # the parked snapshot, back on the device: the prompt's end again
    assert ex.position == N_PROMPT
    toks, bits = _steps(ex, tok0, N_MORE)
    assert toks == first_toks and _same(bits, first_bits), "the parked snapshot restores differently"

    full, tail = parked.data["kv_full"], parked.data["kv_tail"]
    for name, row in (("full page", full[0, 0, 0, :, 17, :]), ("partial page", tail[0, 0, :, 20, :])):
        keep = row.copy()
        row[...] = BF16_EIGHT
        ex.unpark(parked, 0)
        _, bad = _steps(ex, first_toks[-1], N_CHECK)
        row[...] = keep
        assert not _same(bad, ref_bits), f"a changed K row on the {name} did not change the logits"


def test_parked_session_next_turn_equals_fresh(gpu, eng):
    prompt = [(5 * i + 3) % 3000 + 200 for i in range(280)]
    a = eng.new_session()
    r1 = a.generate(prompt, max_new_tokens=8, stop_ids=[]).result()
    a.park()
    b = eng.new_session()  # the one slot, reused while a is parked
    b.generate([9 + i for i in range(50)], max_new_tokens=4, stop_ids=[]).result()
    b.close()
    a.unpark()
    whole = prompt + r1.ids + [321, 654, 987]
    r2 = a.generate(whole, max_new_tokens=8, stop_ids=[]).result()
    assert r2.timings.reused_tokens == len(prompt) + len(r1.ids) - 1  # the last reply id has not run yet
    a.close()
    ref = eng.generate(whole, max_new_tokens=8, stop_ids=[]).result()
    assert r2.ids == ref.ids
