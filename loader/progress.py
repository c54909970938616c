"""A progress bar of bytes written, on stderr (tqdm), for the checkpoint writers (``loader.synthetic``,
``loader.trained``). Shown only when asked for and stderr is a terminal: a pipe, a log file or a test's captured
stderr gets nothing from it, and the writers' ``log`` lines stay as they are there."""
from __future__ import annotations

import contextlib
import sys


class Progress:
    """``with Progress(total, desc, show) as bar``: ``bar.update(n)`` after n bytes; ``bar.shown`` says whether a bar
    is on screen; ``bar.log(fn, msg)`` calls ``fn(msg)`` without breaking the bar's line. ``show`` False (or stderr
    not a terminal, or tqdm missing) makes every method a no-op but ``log``."""

    def __init__(self, total: int, desc: str, show: bool):
        self.total, self.desc = int(total), desc
        self.show = bool(show) and _stderr_is_tty()
        self._bar = None

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def __enter__(self) -> "Progress":
        if self.show:
            try:  # deferred: only a shown bar needs tqdm, and without it the log lines remain
                from tqdm import tqdm
            except ImportError:
                return self
            self._bar = tqdm(total=self.total, desc=self.desc, unit="B", unit_scale=True, unit_divisor=1000,
                             file=sys.stderr, leave=False, dynamic_ncols=True)
        return self

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def log(self, fn, msg: str) -> None:
        """``fn(msg)`` with the bar cleared around it (tqdm's external write mode)."""
        if self._bar is None:
            fn(msg)
            return
        with self._bar.external_write_mode(file=sys.stderr):
            fn(msg)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _stderr_is_tty() -> bool:
    with contextlib.suppress(AttributeError, ValueError, OSError):
        return sys.stderr.isatty()
    return False
