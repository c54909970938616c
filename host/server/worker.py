"""The engine's one thread: requests queue as :class:`Job`\\ s and run one at a time (the engine is batch-1).

A job's results go to its asyncio queue as ``("delta", Delta)``, then ``("done", GenerationResult)``,
``("cancelled", None)`` or ``("error", exception)``. A job whose client went away (``cancel()``) is skipped when
still queued, or closed at the next delta when running: ``Generation.close()`` stops the session's loop at a yield,
where its state is consistent (every id in ``session.ids`` has run), so the session stays resident and reusable.
The queue is bounded: ``submit`` raises :class:`QueueFull` when ``max_queue`` jobs already wait.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import warnings

from host.errors import EngineError, IgnoredArgumentWarning
from host.server.pool import SessionPool

log = logging.getLogger("qwen-mk.serve")


class QueueFull(Exception):
    """Raised by ``Worker.submit`` when the queue holds ``max_queue`` waiting jobs; ``retry_after`` in seconds."""

    def __init__(self, retry_after: int):
        super().__init__(f"the request queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class Job:
    """One generation: prompt ids, ``Session.generate`` keyword arguments, and the asyncio queue of its results."""

    def __init__(self, prompt: list[int], kwargs: dict, loop: asyncio.AbstractEventLoop):
        self.prompt, self.kwargs, self.loop = prompt, kwargs, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()

    def cancel(self) -> None:
        """Stop this job: skipped if still queued, closed at its next delta if running."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel()`` was called."""
        return self._cancel.is_set()

    def put(self, kind: str, item) -> None:
        """Hand a result to the request's event loop (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, item))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._cancel.set()


class Worker:
    """Runs jobs on ``engine`` in one thread; at most ``max_queue`` waiting. ``park_memory``: the session pool's
    host-memory budget for parked sessions in bytes (None: its default; 0: never park; ``SessionPool``)."""

    def __init__(self, engine, max_queue: int = 64, park_memory: int | None = None):
        self.engine, self.max_queue = engine, max_queue
        self.pool = SessionPool(engine, park_memory)
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self.running: Job | None = None
        self.served = 0
        self._busy_s = 0.0  # seconds spent on served jobs: Retry-After's estimate
        self._thread = threading.Thread(target=self._run, name="qwen-mk-engine", daemon=True)

    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; QueueFull when ``max_queue`` jobs already wait (the running one not counted)."""
        with self._cv:
            if self._stop:
                raise QueueFull(1)
            if len(self._queue) >= self.max_queue:
                mean = self._busy_s / self.served if self.served else 1.0
                raise QueueFull(max(1, round(mean * (len(self._queue) + 1))))
            self._queue.append(job)
            self._cv.notify()

    @property
    def waiting(self) -> int:
        """Jobs queued and not started."""
        return len(self._queue)

    def stop(self, timeout: float | None = None) -> None:
        """Finish the running job, cancel the queued ones, close the sessions and end the thread."""
        with self._cv:
            self._stop = True
            for job in self._queue:
                job.put("cancelled", None)
            self._queue.clear()
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        warnings.simplefilter("ignore", IgnoredArgumentWarning)  # the server drops what greedy decoding ignores
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop and not self._queue:
                    break
                job = self._queue.popleft()
            if job.cancelled:
                job.put("cancelled", None)
                continue
            self.running = job
            t0 = time.perf_counter()
            try:
                self._run_job(job)
            finally:
                self.running = None
                self.served += 1
                self._busy_s += time.perf_counter() - t0
        self.pool.close()

    def _run_job(self, job: Job) -> None:
        s = None
        try:
            s = self.pool.acquire(job.prompt)
            g = s.generate(job.prompt, **job.kwargs)
            for d in g:
                job.put("delta", d)
                if job.cancelled and d.finish_reason is None:
                    g.close()  # at a yield: the session's state holds exactly its ids
                    job.put("cancelled", None)
                    return
            res = g.result()
            self.pool.observe(res.timings)
            job.put("done", res)
        except EngineError as e:
            job.put("error", e)
        except Exception as e:  # noqa: BLE001 - a bug, not bad input: logged, answered 500, session dropped
            log.exception("generation failed")
            if s is not None:
                self.pool.drop(s)
            job.put("error", e)
