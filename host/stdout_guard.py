"""The CLI's stdout while a command runs: the same stream, whose failed writes raise :class:`StdoutClosed` (its
reader went away: ``| head -1``) or :class:`StdoutError` (it cannot be written: ``> /dev/full``) instead of an
OSError, so that no ``except OSError`` meant for another file takes them, and ``host.cli.Main`` turns them into
a quiet exit 0 or one error line."""
from __future__ import annotations

import contextlib
import os
import sys


class StdoutClosed(Exception):
    """A write to stdout met a closed reader (BrokenPipeError)."""


class StdoutError(Exception):
    """A write to stdout failed otherwise (an OSError such as ENOSPC); ``reason``: its strerror."""

    def __init__(self, e: OSError):
        super().__init__(e.strerror or str(e))
        self.reason = e.strerror or str(e)


class GuardedStdout:
    """Wraps a text stream: ``write`` and ``flush`` raise StdoutClosed / StdoutError for an OSError; every other
    attribute is the stream's."""

    def __init__(self, stream):
        self.stream = stream

    def _call(self, f, *a):
        try:
            return f(*a)
        except BrokenPipeError:
            raise StdoutClosed() from None
        except OSError as e:
            raise StdoutError(e) from e

    def write(self, s):
        """Write ``s`` to the stream."""
        return self._call(self.stream.write, s)

    def flush(self):
        """Flush the stream."""
        return self._call(self.stream.flush)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def guarded_stdout():
    """``sys.stdout`` is a GuardedStdout inside the block (once, when blocks nest), the original after it."""
    if isinstance(sys.stdout, GuardedStdout):
        yield
        return
    sys.stdout = GuardedStdout(sys.stdout)
    try:
        yield
    finally:
        if isinstance(sys.stdout, GuardedStdout):
            sys.stdout = sys.stdout.stream


def detach_stdout() -> None:
    """Point stdout's file descriptor at /dev/null, so that the interpreter's flush at exit (of the bytes still
    buffered) neither fails nor prints an "Exception ignored" message."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (click's test runner): nothing flushes it later
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
