"""Worker processes that Ctrl-C stops at once, for the checkpoint writer (``loader.synthetic``): a process pool
whose workers ignore SIGINT and that the parent terminates on an interrupt or an error, and a block that ignores
SIGINT while a cleanup runs."""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import signal
import threading
import time


def _ignore_sigint() -> None:
    """Pool initializer: a worker ignores SIGINT. Ctrl-C in a terminal reaches the whole process group, and only
    the parent decides what happens then: it terminates the workers (:class:`WorkerPool`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def sigint_ignored():
    """Ignore SIGINT inside the block (in the main thread; elsewhere a no-op), so a second Ctrl-C cannot break
    off the cleanup after the first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


class WorkerPool:
    """Worker processes (``concurrent.futures.ProcessPoolExecutor``; None for ``workers`` <= 1).
    Leaving the block normally waits for the workers; leaving it on an exception (KeyboardInterrupt included)
    cancels the queued jobs and terminates the workers with a bounded join (SIGTERM, then SIGKILL after
    ``JOIN_S``), so an interrupt never waits on a worker's work or pipe."""

    JOIN_S = 2.0

    def __init__(self, workers: int):
        self.workers, self.pool = workers, None

    def __enter__(self):
        if self.workers > 1:
            self.pool = concurrent.futures.ProcessPoolExecutor(self.workers, initializer=_ignore_sigint)
        return self

    def __exit__(self, typ, exc, tb) -> None:
        if self.pool is None:
            return
        if typ is None:
            self.pool.shutdown(wait=True)
            return
        with sigint_ignored():
            self._terminate()

    def _terminate(self) -> None:
        # The executor has no terminate(): its internals are taken before shutdown forgets them. A worker killed
        # while it sends a result leaves the executor's manager thread reading the rest of that message forever
        # (the parent holds the result pipe's write end too), and interpreter exit joins that thread: closing
        # the parent's write end once the workers are gone ends the read (EOF), the executor marks itself
        # broken and the thread exits.
        pool = self.pool
        procs = list((getattr(pool, "_processes", None) or {}).values())
        results = getattr(pool, "_result_queue", None)
        manager = getattr(pool, "_executor_manager_thread", None)
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            with contextlib.suppress(OSError, ValueError):
                p.terminate()
        deadline = time.monotonic() + self.JOIN_S
        for p in procs:
            with contextlib.suppress(OSError, ValueError):
                p.join(max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join(self.JOIN_S)
        writer = getattr(results, "_writer", None)
        if writer is not None:
            with contextlib.suppress(OSError):
                writer.close()
        if manager is not None:
            manager.join(self.JOIN_S)

    def ordered(self, fn, jobs):
        """(job, fn(job)) in job order; with a pool at most 2·workers jobs are in flight (bounded memory). ``fn``
        is a module-level function, so that worker processes can run it."""
        if self.pool is None:
            for j in jobs:
                yield j, fn(j)
            return
        window: collections.deque = collections.deque()
        for j in jobs:
            window.append((j, self.pool.submit(fn, j)))
            if len(window) >= 2 * self.workers:
                jj, f = window.popleft()
                yield jj, f.result()
        while window:
            jj, f = window.popleft()
            yield jj, f.result()
