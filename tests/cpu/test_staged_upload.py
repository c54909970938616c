"""The staged upload (loader.staging, behind discrete.weights_gpu.WeightsGPU.from_source) on the CPU: NumPy buffers
stand in for the device ones (a CuPy shim) and a fake device whose copies land only when their event completes,
so a buffer refilled before its copy landed shows up as wrong bytes in the assembled weights."""
from __future__ import annotations

import math
import os
import shutil
import sys
import threading
import types

import numpy as np
import pytest

from discrete import weights_gpu
from discrete.weights_gpu import Proj, WeightsGPU
from loader.checkpoint import SCALE_SUFFIX, Checkpoint
from loader.staging import StagedUpload, Transfer, UploadError, plan


class FakeDevice:
    """Copies are deferred: ``copy`` keeps a reference to the staging view and the bytes move only when an event
    covering it completes (``done`` after ``lag`` queries, ``wait``, ``sync``), as a DMA reads pinned memory
    later. Counts host buffers allocated/freed and the most copies pending at once."""

    def __init__(self, lag: int | None = None):
        self.lag, self.pending, self.events = lag, [], []
        self.allocated = self.freed = 0
        self.max_pending_events = 0

    def host_buffer(self, nbytes):
        self.allocated += 1
        return np.full(nbytes, 0xA5, np.uint8)  # poisoned

    def free_host_buffer(self, buf):
        self.freed += 1

    def copy(self, dest, offset, view):
        self.pending.append((dest, offset, view))

    def record(self):
        ev = {"upto": len(self.pending), "queries": 0}
        self.events.append(ev)
        live = sum(1 for e in self.events if e.get("upto", 0) > self._landed)
        self.max_pending_events = max(self.max_pending_events, live)
        return ev

    _landed = 0

    def _land(self, upto):
        for dest, off, view in self.pending[self._landed:upto]:
            d = dest.reshape(-1).view(np.uint8)
            d[off:off + view.nbytes] = view
        self._landed = max(self._landed, upto)

    def done(self, ev):
        ev["queries"] += 1
        if self.lag is not None and ev["queries"] > self.lag:
            self._land(ev["upto"])
        return self._landed >= ev["upto"]

    def wait(self, ev):
        self._land(ev["upto"])

    def sync(self):
        self._land(len(self.pending))


class EagerRecycle(StagedUpload):
    """Negative control: hands a buffer back without waiting for its copy."""

    def _wait(self, event):
        pass


@pytest.fixture
def numpy_cupy(monkeypatch):
    """``import cupy`` inside weights_gpu gives NumPy arrays; returns a holder whose ``.dev`` is the FakeDevice of
    the last upload (``.lag`` and ``.cls`` choose the next one's lag and pipeline class)."""
    cp = types.ModuleType("cupy")
    cp.empty, cp.uint8, cp.uint16 = np.empty, np.uint8, np.uint16
    cp.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(synchronize=lambda: None))
    cp.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    h = types.SimpleNamespace(dev=None, lag=None, cls=StagedUpload)

    def make(_cp):
        h.dev = FakeDevice(h.lag)
        return h.dev
    monkeypatch.setattr(weights_gpu, "_CupyStaging", make)
    monkeypatch.setattr(weights_gpu, "StagedUpload", lambda *a, **k: h.cls(*a, **k))
    return h


def bits(a) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint16)


def first_mismatch(w: WeightsGPU, src) -> str | None:
    """The first device tensor of ``w`` that differs from ``src``'s parts (fused rows in order), or None."""
    def cat(names):
        return np.concatenate([bits(src.get(n)) for n in names])
    checks = [("embed", w.embed, ["model.embed_tokens.weight"]), ("lm_head", w.lm_head, ["lm_head.weight"]),
              ("final_norm", w.final_norm, ["model.norm.weight"])]
    for i, L in enumerate(w.layers):
        for k, v in L.items():
            if isinstance(v, Proj):
                checks.append((f"layers.{i}.{k}.w", v.w, list(v.parts)))
                if v.scale is not None:
                    checks.append((f"layers.{i}.{k}.scale", v.scale, [n + SCALE_SUFFIX for n in v.parts]))
    for label, got, names in checks:
        if not np.array_equal(got, cat(names).reshape(got.shape)):
            return label
    p = "model.layers.0.linear_attn."
    if not np.array_equal(w.layers[0]["ba"], cat([p + "in_proj_b.weight", p + "in_proj_a.weight"])):
        return "layers.0.ba"
    return None


@pytest.fixture(scope="module")
def ck(tiny_ckpt):
    return Checkpoint.open(tiny_ckpt)


class InMemory:
    """The tiny checkpoint as a source without ``byte_range`` (as SyntheticWeights): staged from ``get``."""

    def __init__(self, ck):
        self.config, self._t = ck.config, {n: np.array(ck.get(n)) for n in ck.names()}

    def names(self):
        return list(self._t)

    def get(self, n):
        return self._t[n]


@pytest.fixture(scope="module")
def mem(ck):
    return InMemory(ck)


# ---------------------------------------------------------------------------------------------- the plan
def test_plan_splits_packs_and_orders():
    """Every byte of every transfer is in exactly one piece, in order; loads hold at most one buffer and all but the
    last are full; a transfer of n bytes spans ceil(n / buffer) loads at most + 1; ``where`` orders by file/offset."""
    rng = np.random.default_rng(0)
    sizes = [int(x) for x in rng.integers(1, 40, size=12)]
    ts = [Transfer(f"t{i}", (n,), np.dtype(np.uint8), None) for i, n in enumerate(sizes)]
    where = {f"t{i}": ("b" if i % 2 else "a", -i) for i in range(len(ts))}
    for buf in (1, 7, 16, 1000):
        loads = plan(ts, buf, where.get)
        assert all(sum(p.nbytes for p in ld) <= buf for ld in loads)
        assert all(sum(p.nbytes for p in ld) == buf for ld in loads[:-1])
        for ld in loads:  # pieces tile their buffer from 0
            assert [p.buf_off for p in ld] == list(np.cumsum([0] + [p.nbytes for p in ld])[:-1])
        seen = [p.t for ld in loads for p in ld]
        order = list(dict.fromkeys(seen))
        assert order == sorted(range(len(ts)), key=lambda i: where[f"t{i}"])
        for i, n in enumerate(sizes):
            ps = [p for ld in loads for p in ld if p.t == i]
            assert [p.src_off for p in ps] == list(np.cumsum([0] + [p.nbytes for p in ps])[:-1])
            assert sum(p.nbytes for p in ps) == n and len(ps) <= math.ceil(n / buf) + 1
    with pytest.raises(ValueError):
        plan(ts, 0)


# ---------------------------------------------------------------------------------------------- assembly
@pytest.mark.parametrize("lag", [None, 0, 2])
@pytest.mark.parametrize("buffers,buffer_bytes", [(1, 1 << 20), (2, (3 << 20) - 12345), (3, 1 << 30)])
def test_source_without_byte_ranges_assembles_byte_exact(numpy_cupy, mem, lag, buffers, buffer_bytes):
    """Fused q|k|v, gate|up, qkv|z, b|a and their scales hold the source's bytes exactly, whatever the ring;
    at most ``buffers`` copies are pending at once; every staging buffer is freed."""
    numpy_cupy.lag = lag
    src = mem
    w = WeightsGPU.from_source(src, buffers=buffers, buffer_bytes=buffer_bytes)
    assert first_mismatch(w, src) is None
    d = numpy_cupy.dev
    assert d.allocated == d.freed == w.load_stats["buffers"] <= buffers
    assert d.max_pending_events <= buffers
    assert w.load_stats["bytes"] == sum(t.nbytes for t in _transfers_of(w))
    if buffer_bytes == 1 << 20:
        assert w.load_stats["loads"] > 10 * buffers  # the ring was recycled many times


def _transfers_of(w):
    """Device tensors of w (each byte once) as pseudo transfers, for the byte count."""
    out = [w.embed, w.final_norm, w.lm_head]
    for L in w.layers:
        for k, v in L.items():
            if isinstance(v, Proj):
                out += [v.w] + ([v.scale] if v.scale is not None else [])
            elif k not in ("a", "b"):
                out.append(v)
    return [Transfer("x", tuple(a.shape), np.dtype(a.dtype), None) for a in out]


@pytest.mark.parametrize("lag", [None, 1])
def test_checkpoint_files_assemble_byte_exact(numpy_cupy, ck, lag):
    """From the shards (preadv into the staging buffers, file order) with a tiny ring: the same bytes as get()."""
    numpy_cupy.lag = lag
    w = WeightsGPU.from_source(ck, buffers=2, buffer_bytes=1 << 20)
    assert first_mismatch(w, ck) is None
    assert numpy_cupy.dev.allocated == numpy_cupy.dev.freed == 2


def test_negative_control_recycling_before_the_copy_landed_is_caught(numpy_cupy, ck):
    """A pipeline that refills a buffer without waiting for its copy assembles wrong bytes (the check can fail);
    the same ring with the real pipeline assembles them right."""
    src = ck
    numpy_cupy.cls = EagerRecycle
    bad = WeightsGPU.from_source(src, buffers=2, buffer_bytes=1 << 20)
    assert first_mismatch(bad, src) is not None
    numpy_cupy.cls = StagedUpload
    assert first_mismatch(WeightsGPU.from_source(src, buffers=2, buffer_bytes=1 << 20), src) is None


# ---------------------------------------------------------------------------------------------- errors
class Tampered:
    """A source whose tensor ``name`` comes back as ``fn(array)``."""

    def __init__(self, src, name, fn):
        self.src, self.name, self.fn, self.config = src, name, fn, src.config

    def names(self):
        return self.src.names()

    def get(self, n):
        a = self.src.get(n)
        return self.fn(a) if n == self.name else a


BAD = "model.layers.1.mlp.down_proj.weight"
BAD_NORM = "model.layers.2.input_layernorm.weight"


@pytest.mark.parametrize("name,fn,what", [
    (BAD, lambda a: a.T, "shape"),
    (BAD, lambda a: a.astype(np.float32)[:, : a.shape[1] // 4], "dtype"),
    (BAD_NORM, lambda a: a.astype(np.float16), "dtype (same width)"),
])
def test_reader_error_names_the_tensor_and_frees_everything(numpy_cupy, ck, name, fn, what):
    """A wrong shape or dtype found by the reader thread is raised here, naming the tensor; staging buffers are
    freed and the reader thread has ended. Control: the untampered source loads."""
    before = {t.ident for t in threading.enumerate()}
    src = ck
    with pytest.raises(UploadError) as e:
        WeightsGPU.from_source(Tampered(src, name, fn), buffers=2, buffer_bytes=1 << 20)
    assert repr(name) in str(e.value) and "expected" in str(e.value), what
    d = numpy_cupy.dev
    assert d.allocated == d.freed > 0
    assert {t.ident for t in threading.enumerate() if t.name == "staging-reader"} - before == set()
    assert first_mismatch(WeightsGPU.from_source(src, buffers=2, buffer_bytes=1 << 20), src) is None


def test_shard_truncated_after_open_is_a_named_error(numpy_cupy, tiny_ckpt, tmp_path):
    """A shard cut short after the headers were checked (a file changing under the loader): the read comes up short
    and the error names the file, the tensor and "truncated" instead of a SIGBUS on a memory map."""
    d = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, d)
    ck = Checkpoint.open(d)
    last = max((n for n in ck.names() if not n.startswith("mtp.")), key=lambda n: ck.byte_range(n)[2])  # uploaded
    f, b, e = ck.byte_range(last)
    os.truncate(f, (b + e) // 2)
    with pytest.raises(UploadError) as err:
        WeightsGPU.from_source(ck, buffers=2, buffer_bytes=1 << 20)
    msg = str(err.value)
    assert "truncated" in msg and str(f) in msg and repr(last) in msg, msg
    assert numpy_cupy.dev.allocated == numpy_cupy.dev.freed


def test_fp32_scales_take_the_converting_path(numpy_cupy, tiny_ckpt):
    """byte_range is None exactly where get() converts (F32 scales), so those are staged from get()."""
    ck = Checkpoint.open(tiny_ckpt)
    ranges = {n: ck.byte_range(n) for n in ck.names()}
    assert all(r is not None for r in ranges.values())  # the tiny checkpoint stores bf16 scales
    for n, (f, b, e) in list(ranges.items())[:20]:
        assert e - b == np.asarray(ck.get(n)).nbytes
    with pytest.raises(KeyError):
        ck.byte_range("no.such.tensor")
