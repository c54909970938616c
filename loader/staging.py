"""A staged upload of a checkpoint's tensors: a reader thread fills a small ring of host staging buffers from the
shards while the caller's device copies the previous buffers out (``discrete.weights_gpu.WeightsGPU.from_source``
with CuPy pinned buffers and a stream; the CPU tests with NumPy buffers and a fake device).

The destinations are known before any byte is read (the fused device buffers exist, a :class:`Transfer` per
stored tensor points into them), so the plan is fixed: tensors in file order (shard, then byte offset, when the
source says where its bytes lie; else as given), each cut into pieces of at most one buffer, pieces packed into
buffers in that order. The reader reads piece by piece into a free buffer and hands it over when full; the
consumer issues one device copy per piece, records one event per buffer and gives the buffer back to the reader
only when that event has completed. Host memory held: the ring, never the model.

A tensor whose bytes the source can locate (``byte_range``: a shard file and offsets, bits as stored) is read with
``os.preadv`` straight into the buffer (no page faults on a memory map, a short read reports a truncated file
instead of a SIGBUS); any other (a synthetic source, a converted fp32 scale) is taken from ``source.get``.
Errors in the reader (dtype, shape, a short or failed read) are raised in the caller's thread, naming the tensor
and its file; staging buffers are freed on every exit.
"""
from __future__ import annotations

import math
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from loader.checkpoint import CheckpointError
from loader.progress import Progress

DEFAULT_BUFFERS, DEFAULT_BUFFER_BYTES = 3, 128 << 20
# accepted stored dtypes per destination bit dtype (fp8 e4m3 payloads as uint8, bf16 as uint16)
_ACCEPT = {np.dtype(np.uint8): (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.uint8)),
           np.dtype(np.uint16): (np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16))}


@dataclass(frozen=True)
class Transfer:
    """One stored tensor and where it goes: ``name`` (canonical), ``shape`` (stored), ``bits`` (np.uint8 for fp8
    e4m3, np.uint16 for bf16), ``dest`` (the device's handle of a contiguous destination of ``nbytes``)."""
    name: str
    shape: tuple[int, ...]
    bits: np.dtype
    dest: object

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.bits).itemsize


@dataclass(frozen=True)
class Piece:
    """Bytes ``[src_off, src_off + nbytes)`` of transfer ``t`` (index into the plan's transfers), staged at
    ``buf_off`` of its buffer and copied to ``dest`` byte ``src_off``."""
    t: int
    src_off: int
    nbytes: int
    buf_off: int


class UploadError(CheckpointError):
    """A tensor could not be staged (wrong dtype or shape, a short or failed read); names the tensor and file."""


def plan(transfers: list[Transfer], buffer_bytes: int, where=None) -> list[list[Piece]]:
    """The buffer loads, in reading order: each a list of pieces that fill one buffer of ``buffer_bytes`` at most.
    ``where(name)`` -> (file, byte offset) or None orders the tensors by file and offset (None: given order,
    stable). A tensor larger than a buffer is cut into ``ceil(nbytes / buffer_bytes)`` pieces; small tensors
    share a buffer. Raises ValueError for ``buffer_bytes`` < 1."""
    if buffer_bytes < 1:
        raise ValueError(f"staging: buffer_bytes must be >= 1, got {buffer_bytes}")
    order = list(range(len(transfers)))
    if where is not None:
        keys = [where(t.name) for t in transfers]
        order.sort(key=lambda i: (0, str(keys[i][0]), keys[i][1]) if keys[i] is not None else (1, "", i))
    loads: list[list[Piece]] = []
    cur: list[Piece] = []
    used = 0
    for i in order:
        off, n = 0, transfers[i].nbytes
        while off < n:
            if used == buffer_bytes:
                loads.append(cur)
                cur, used = [], 0
            k = min(n - off, buffer_bytes - used)
            cur.append(Piece(i, off, k, used))
            off, used = off + k, used + k
    if cur:
        loads.append(cur)
    return loads


class StagedUpload:
    """Upload ``transfers`` from ``source`` (a WeightSource; optionally with ``byte_range(name)`` -> (path,
    start, end) or None) through ``device``, which provides:

    * ``host_buffer(nbytes)`` -> writable uint8 [nbytes] NumPy array (pinned memory on a GPU);
      ``free_host_buffer(buf)``;
    * ``copy(dest, offset, view)``: start copying uint8 ``view`` into ``dest`` at byte ``offset``;
    * ``record()`` -> an event completing when every copy started so far has; ``done(event)`` -> bool (no wait);
      ``wait(event)`` (blocks); ``sync()`` (blocks until every copy has landed).

    ``buffers`` (>= 1) × ``buffer_bytes`` is the host memory held (None: ``DEFAULT_BUFFERS`` ×
    ``DEFAULT_BUFFER_BYTES``, 3 × 128 MiB). ``progress``: a label to show a bar of the
    bytes uploaded with the rate on stderr (``loader.progress``: only on a terminal), or None.
    :meth:`run` returns statistics; it raises UploadError naming the tensor and file for a wrong dtype/shape or a
    short/failed read (a failed read of a checkpoint's file also names the stored name), after stopping the
    reader and freeing the buffers."""

    def __init__(self, source, transfers: list[Transfer], device, *, buffers: int | None = None,
                 buffer_bytes: int | None = None, progress: str | None = None):
        buffers = DEFAULT_BUFFERS if buffers is None else buffers  # None: the module's defaults, read at call time
        buffer_bytes = DEFAULT_BUFFER_BYTES if buffer_bytes is None else buffer_bytes
        if buffers < 1:
            raise ValueError(f"staging: buffers must be >= 1, got {buffers}")
        self.source, self.transfers, self.device = source, list(transfers), device
        self.buffers, self.buffer_bytes, self.progress = int(buffers), int(buffer_bytes), progress
        self._range = getattr(source, "byte_range", None)
        where = None
        if self._range is not None:
            def where(name):
                r = self._range(name)
                return None if r is None else (r[0], r[1])
        total = sum(t.nbytes for t in self.transfers)
        self.buffer_bytes = max(1, min(self.buffer_bytes, total))  # a small model needs no 128 MB buffers
        self.loads = plan(self.transfers, self.buffer_bytes, where)

    # ------------------------------------------------------------------ reader side
    def _tensor(self, t: Transfer):
        """(source array or None, (path, start) or None) of transfer ``t``, after checking its dtype and shape."""
        a = self.source.get(t.name)
        r = self._range(t.name) if self._range is not None else None
        dt = np.dtype(a.dtype)
        if dt not in _ACCEPT[np.dtype(t.bits)] or tuple(a.shape) != tuple(t.shape):
            want = "fp8 e4m3" if np.dtype(t.bits) == np.uint8 else "bf16"
            raise UploadError(f"{self._file(t.name)}: tensor {t.name!r}: source gives {dt} {tuple(a.shape)}, "
                              f"expected {want} {tuple(t.shape)}")
        if r is not None:
            return None, (r[0], r[1])
        return np.ascontiguousarray(a).reshape(-1).view(np.uint8), None

    def _file(self, name: str) -> str:
        f = getattr(self.source, "file_of", None)
        if f is not None:
            try:
                p, s = f(name)
                return f"{p} ({s})" if s != name else str(p)
            except KeyError:
                pass
        return str(getattr(self.source, "path", "source"))

    def _read(self, fds: dict, t: Transfer, loc, piece: Piece, out: np.ndarray) -> None:
        path, start = loc
        fd = fds.get(path)
        if fd is None:
            fd = fds[path] = os.open(path, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        mv, got = memoryview(out), 0
        while got < piece.nbytes:
            try:
                k = os.preadv(fd, [mv[got:]], start + piece.src_off + got)
            except OSError as e:
                raise UploadError(f"{self._file(t.name)}: tensor {t.name!r}: read failed at byte "
                                  f"{start + piece.src_off + got}: {e}") from None
            if k == 0:
                raise UploadError(f"{self._file(t.name)}: truncated: tensor {t.name!r} needs bytes {start}.."
                                  f"{start + t.nbytes} but the file ends at byte {start + piece.src_off + got} "
                                  f"({os.fstat(fd).st_size} bytes)")
            got += k

    def _reader(self, free: queue.Queue, ready: queue.Queue, stop: threading.Event, stats: dict) -> None:
        fds: dict[Path, int] = {}
        cur_t, cur = -1, None
        try:
            for load in self.loads:
                t0 = time.perf_counter()
                while True:
                    if stop.is_set():
                        return
                    try:
                        slot = free.get(timeout=0.05)
                        break
                    except queue.Empty:
                        continue
                stats["reader_wait_s"] += time.perf_counter() - t0
                buf = self._bufs[slot]
                for p in load:
                    t = self.transfers[p.t]
                    if p.t != cur_t:
                        cur_t, cur = p.t, self._tensor(t)
                    arr, loc = cur
                    out = buf[p.buf_off:p.buf_off + p.nbytes]
                    if loc is not None:
                        self._read(fds, t, loc, p, out)
                    else:
                        out[:] = arr[p.src_off:p.src_off + p.nbytes]
                ready.put((slot, load))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread, which raises it
            ready.put((None, e))
        finally:
            for fd in fds.values():
                os.close(fd)

    # ------------------------------------------------------------------ consumer side
    def run(self) -> dict:
        """Stage and copy every transfer; returns {"bytes", "seconds", "gbps", "buffers", "buffer_bytes",
        "loads", "pieces", "reader_wait_s", "copy_wait_s"} (the waits: reader for a free buffer, consumer for a
        filled one). Raises UploadError (see the class)."""
        dev, n = self.device, min(self.buffers, max(1, len(self.loads)))
        total = sum(t.nbytes for t in self.transfers)
        stats = {"reader_wait_s": 0.0, "copy_wait_s": 0.0}
        self._bufs: list[np.ndarray] = []
        free: queue.Queue = queue.Queue()
        ready: queue.Queue = queue.Queue()
        stop = threading.Event()
        th = None
        t_start = time.perf_counter()
        try:
            for i in range(n):
                self._bufs.append(dev.host_buffer(self.buffer_bytes))
                free.put(i)
            th = threading.Thread(target=self._reader, args=(free, ready, stop, stats), name="staging-reader",
                                  daemon=True)
            th.start()
            inflight: list[tuple[object, int]] = []  # (event, slot), oldest first
            with Progress(total, self.progress or "", self.progress is not None) as bar:
                for _ in range(len(self.loads)):
                    while inflight and dev.done(inflight[0][0]):
                        free.put(inflight.pop(0)[1])
                    if inflight and ready.empty():  # nothing to issue: recycle the oldest buffer
                        t0 = time.perf_counter()
                        self._wait(inflight[0][0])
                        stats["copy_wait_s"] += time.perf_counter() - t0
                        free.put(inflight.pop(0)[1])
                    t0 = time.perf_counter()
                    slot, load = ready.get()
                    stats["copy_wait_s"] += time.perf_counter() - t0
                    if slot is None:  # the reader's error; an UploadError without the reader's frames
                        raise load.with_traceback(None) if isinstance(load, CheckpointError) else load
                    buf = self._bufs[slot]
                    for p in load:
                        dev.copy(self.transfers[p.t].dest, p.src_off, buf[p.buf_off:p.buf_off + p.nbytes])
                    inflight.append((dev.record(), slot))
                    bar.update(sum(p.nbytes for p in load))
                dev.sync()
        finally:
            stop.set()
            if th is not None:
                th.join()
            try:
                dev.sync()  # no copy may still read a buffer being freed
            finally:
                for b in self._bufs:
                    dev.free_host_buffer(b)
                self._bufs = []
        s = time.perf_counter() - t_start
        return {"bytes": int(total), "seconds": round(s, 3), "gbps": round(total / s / 1e9, 3) if s > 0 else None,
                "buffers": n, "buffer_bytes": self.buffer_bytes, "loads": len(self.loads),
                "pieces": sum(len(x) for x in self.loads), "reader_wait_s": round(stats["reader_wait_s"], 3),
                "copy_wait_s": round(stats["copy_wait_s"], 3)}

    def _wait(self, event) -> None:
        """Block until ``event`` completes (the buffer it guards may then be refilled)."""
        self.device.wait(event)
