"""The GPU executors' park / unpark addressing, checked on the CPU: ``GraphExecutor.park`` / ``unpark`` run against a
stand-in for CuPy whose "device" arrays are host arrays and whose async copies are ``ctypes.memmove`` (2-D copies
row by row, with their pitches), over a small page pool laid out as ``discrete/kv_cache.py`` lays it out
(``[pages, layers, K|V, heads, PAGE, head_dim]``) and a page table out of order.

For positions 0, inside the first page, at a page boundary, inside the second page and just past the second page:
the KV rows in use come back to the same (page, slot) places after the pool is poisoned, the rows past the
position keep the poison (only rows in use are copied), the GDN state, conv ring and a snapshot come back, and
``park_nbytes`` equals the bytes parked. The real copies run on the H200 in tests/gpu/test_park_gpu.py.
"""
from __future__ import annotations

import ctypes
import sys
import types

import numpy as np
import pytest

from discrete.kv_cache import PAGE
from host.executors import GraphExecutor
from tests.helpers import FakeStream

L, NKV, HD, CAP = 2, 2, 8, 3 * PAGE
NOISE = 0x4780


class _Dev(np.ndarray):
    """A host array standing in for a CuPy array: ``.data.ptr`` is its address."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def _dev(a) -> _Dev:
    return np.ascontiguousarray(a).view(_Dev)


def _memcpy2d(dst, dpitch, src, spitch, width, height, kind, stream):
    assert dpitch >= width and spitch >= width
    for r in range(height):
        ctypes.memmove(dst + r * dpitch, src + r * spitch, width)


@pytest.fixture
def fake_cupy(monkeypatch):
    rt = types.SimpleNamespace(memcpyDeviceToHost=2, memcpyHostToDevice=1, memcpy2DAsync=_memcpy2d,
                               memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n))
    cupy = types.ModuleType("cupy")
    cupy.cuda, cupy.ndarray = types.SimpleNamespace(runtime=rt), _Dev
    cupy.empty = lambda shape, dtype: _dev(np.empty(shape, dtype))
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda shape, dtype: np.empty(shape, dtype)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)


class _Step:
    """What park / unpark touch of a ``discrete.step.DecodeStep`` and its ``DeviceState``."""

    def __init__(self, rng):
        self.stream, self.pos, self.capacity = FakeStream(), 0, CAP
        shape = (3, L, 2, NKV, PAGE, HD)
        self.kv = types.SimpleNamespace(shape=shape, pool=_dev(rng.integers(0, 65535, shape).astype(np.uint16)),
                                        page_stride=int(np.prod(shape[1:])))
        self.sess = types.SimpleNamespace(pages=[2, 0, 1])  # out of order: rows are found through the table
        self.rec = {1: _dev(rng.random((3, 4, 4)).astype(np.float32))}
        self.ring = {1: _dev(rng.integers(0, 9, (4, 6)).astype(np.uint16))}
        self.ctrl = {"pos": 0}
        self.state = self  # DecodeStep.state (discrete.device_state.DeviceState): the same names here

    def reset(self, pos=0):
        self.pos = self.ctrl["pos"] = pos
        for a in (*self.rec.values(), *self.ring.values()):
            a[...] = 0

    def control(self):
        return dict(self.ctrl)

    def write_control(self, c):
        self.ctrl, self.pos = dict(c), c["pos"]


def _rows(d, pos) -> list[np.ndarray]:
    return [np.asarray(d.kv.pool[d.sess.pages[j // PAGE], :, :, :, j % PAGE, :]).copy() for j in range(pos)]


@pytest.mark.parametrize("pos", [0, 5, PAGE, PAGE + 37, 2 * PAGE + 1])
def test_park_unpark_moves_exactly_the_rows_in_use(fake_cupy, pos):
    rng = np.random.default_rng(pos)
    ex = GraphExecutor.__new__(GraphExecutor)  # no device: only the state the copies touch
    ex.dstep, ex.capacity, ex.slots = _Step(rng), CAP, 1
    d = ex.dstep
    d.pos = pos
    snap = {"pos": pos, "rec": {1: _dev(d.rec[1] + 1)}, "ring": {1: _dev(d.ring[1] + 1)}}
    want, rec, ring = _rows(d, pos), np.asarray(d.rec[1]).copy(), np.asarray(d.ring[1]).copy()
    parked = ex.park([snap])
    assert parked.position == pos and parked.nbytes == ex.park_nbytes([snap])
    d.kv.pool[...] = NOISE
    d.rec[1][...] = np.nan
    d.ring[1][...] = 7
    snaps = ex.unpark(parked, 0)
    assert d.pos == pos and d.ctrl["pos"] == pos
    got = _rows(d, pos)
    assert all(np.array_equal(a, b) for a, b in zip(want, got)) and len(got) == pos
    assert np.array_equal(d.rec[1], rec) and np.array_equal(d.ring[1], ring)
    assert np.array_equal(snaps[0]["rec"][1], snap["rec"][1]) and np.array_equal(snaps[0]["ring"][1], snap["ring"][1])
    if pos % PAGE:
        assert (np.asarray(d.kv.pool[d.sess.pages[pos // PAGE], :, :, :, pos % PAGE:, :]) == NOISE).all()
    untouched = [p for i, p in enumerate(d.sess.pages) if i * PAGE >= pos]
    assert all((np.asarray(d.kv.pool[p]) == NOISE).all() for p in untouched)


def test_a_row_off_by_one_page_slot_would_be_seen(fake_cupy):
    """Negative control: a parked tail whose rows are shifted by one slot does not restore the rows in use."""
    rng = np.random.default_rng(1)
    ex = GraphExecutor.__new__(GraphExecutor)
    ex.dstep, ex.capacity, ex.slots = _Step(rng), CAP, 1
    d = ex.dstep
    d.pos = PAGE + 37
    want = _rows(d, d.pos)
    parked = ex.park()
    tail = parked.data["kv_tail"]
    tail[..., 1:, :] = tail[..., :-1, :].copy()
    ex.unpark(parked, 0)
    assert not all(np.array_equal(a, b) for a, b in zip(want, _rows(d, d.pos)))
