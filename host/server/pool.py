"""Resident sessions across requests: a request runs in the session whose history it can reuse most.

Every engine slot holds at most one :class:`host.session.Session`. A session can continue a prompt from
``usable(session, prompt)`` tokens: all of its ids when the prompt extends them, else the newest state checkpoint
at or before the common prefix (GDN state cannot be rewound, so that is where ``Session._sync`` restarts). The
pool picks the session with the most usable tokens, resident or parked; a request that can use none gets a free
slot, or the least recently used resident session is evicted: parked in host memory (``Session.park``) when moving
it back would cost less than re-running its tokens, within a byte budget (``park_memory``), else closed. A parked
session that a request picks is unparked into a slot (``Session.unpark``, bit-identical to one never parked);
parked sessions past the budget are closed, least recently used first. Reusing a session whose history diverges
from the prompt drops its tail past the restart point: in a chat with thinking on that tail is the last reply,
which the next turn's render changes anyway (the template drops an earlier turn's reasoning), so it was never
reusable. Only the engine's worker thread touches the pool.
"""
from __future__ import annotations

import os
from collections import OrderedDict

from host.session import Session, _common_prefix


def usable(s: Session, prompt: list[int]) -> int:
    """Prompt tokens that ``s`` can skip: what ``Session._sync`` will keep of its state for ``prompt``."""
    common = _common_prefix(s.ids, prompt)
    if common == len(s.ids) == len(prompt) and s._last is not None:
        return common
    if common == len(prompt) and common in s._outs:  # a checkpoint at the prompt's end kept its output
        return common
    if common == len(prompt):  # the last prompt token must run again to give its logits
        common -= 1
    if common >= len(s.ids):
        return len(s.ids)
    return max([p for p, _ in s.checkpoints if p <= common], default=0)


PARK_FRACTION = 1 / 8  # default park budget: this share of the host's physical memory


def default_park_memory() -> int:
    """The default park budget in bytes: PARK_FRACTION of the host's physical memory (0 when it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * PARK_FRACTION)
    except (ValueError, OSError, AttributeError):
        return 0


class SessionPool:
    """Sessions of one engine: resident by slot and parked in host memory, each least recently used first.

    ``park_memory``: host bytes parked sessions may hold (None: ``default_park_memory()``; 0: never park, an
    evicted session is closed). Eviction parks the victim when its parked bytes fit the budget and
    ``restore_s(bytes) < reprefill_s(tokens)``: bytes over the executor's ``transfer_rate`` (configured, then
    measured by each park / unpark) against its tokens over this engine's prefill rate (``observe``d from the
    Timings of finished requests; before any is known, parking is assumed cheaper). Raises ValueError for a
    negative budget."""

    def __init__(self, engine, park_memory: int | None = None):
        self.engine = engine
        self.sessions: OrderedDict[int, Session] = OrderedDict()
        self.parked: OrderedDict[int, Session] = OrderedDict()  # by id(session)
        self.park_memory = default_park_memory() if park_memory is None else int(park_memory)
        if self.park_memory < 0:
            raise ValueError(f"park_memory: expected bytes >= 0, got {park_memory}")
        self.parked_bytes = 0
        self._prefill_tokens, self._prefill_s = 0, 0.0
        self.counts = {"parked": 0, "unparked": 0, "closed": 0, "dropped": 0}

    # ------------------------------------------------------------------ cost model
    def observe(self, timings) -> None:
        """Account a finished request's prefill (``Timings.prefilled_tokens`` in ``prefill_ms``) in the rate."""
        if timings.prefilled_tokens > 0 and timings.prefill_ms > 0:
            self._prefill_tokens += timings.prefilled_tokens
            self._prefill_s += timings.prefill_ms / 1e3

    @property
    def prefill_rate(self) -> float | None:
        """Measured prefill tokens per second of this engine (None before any request prefilled)."""
        return self._prefill_tokens / self._prefill_s if self._prefill_s > 0 else None

    def restore_s(self, nbytes: int) -> float:
        """Estimated seconds to move ``nbytes`` of parked state back into a slot."""
        return nbytes / self.engine.executor.transfer_rate

    def reprefill_s(self, tokens: int) -> float:
        """Estimated seconds to re-run ``tokens`` through prefill (infinite before the rate is known)."""
        rate = self.prefill_rate
        return tokens / rate if rate else float("inf")

    # ------------------------------------------------------------------ requests
    def acquire(self, prompt: list[int]) -> Session:
        """The session to run ``prompt`` in, resident in a slot and marked most recently used."""
        best, gain = None, 0
        for s in (*self.sessions.values(), *self.parked.values()):
            u = usable(s, prompt)
            if u > gain:
                best, gain = s, u
        if best is not None and best.parked is not None:
            self.parked.pop(id(best))
            self.parked_bytes -= best.parked.nbytes
            if not self.engine._free and self.sessions:
                self._evict()
            try:
                best.unpark()
            except BaseException:
                best.close()  # out of the pool: its parked state is dropped
                raise
            self.counts["unparked"] += 1
        elif best is None:
            if not self.engine._free and self.sessions:
                self._evict()
            best = self.engine.new_session()
        self.sessions[best.slot] = best
        self.sessions.move_to_end(best.slot)
        return best

    def _evict(self) -> None:
        """Free the least recently used resident session's slot: park it when that pays (see the class), else
        close it."""
        _, victim = self.sessions.popitem(last=False)
        if self.park_memory > 0 and victim.ids:
            try:
                n = self.engine.executor.park_nbytes([snap for _, snap in victim.checkpoints])
            except NotImplementedError:
                n = None
            if n is not None and n <= self.park_memory and self.restore_s(n) < self.reprefill_s(len(victim.ids)):
                self.parked_bytes += victim.park().nbytes
                self.parked[id(victim)] = victim
                self.counts["parked"] += 1
                self._fit()
                return
        victim.close()
        self.counts["closed"] += 1

    def _fit(self) -> None:
        """Close parked sessions, least recently used first, until they fit the budget."""
        while self.parked and self.parked_bytes > self.park_memory:
            _, s = self.parked.popitem(last=False)
            self.parked_bytes -= s.parked.nbytes
            s.close()
            self.counts["dropped"] += 1

    def drop(self, s: Session) -> None:
        """Forget ``s`` and give its slot back (after an error left its state unknown)."""
        self.sessions.pop(s.slot, None)
        if self.parked.pop(id(s), None) is not None:
            self.parked_bytes -= s.parked.nbytes
        s.close()

    def close(self) -> None:
        """Close every session, resident and parked."""
        for s in (*self.sessions.values(), *self.parked.values()):
            s.close()
        self.sessions.clear()
        self.parked.clear()
        self.parked_bytes = 0

    def stats(self) -> list[dict]:
        """Tokens and checkpoints of each session, resident (by slot) then parked (``slot`` None, with its
        ``bytes``), least recently used first."""
        out = [{"slot": k, "tokens": len(s.ids), "checkpoints": [p for p, _ in s.checkpoints]}
               for k, s in self.sessions.items()]
        return out + [{"slot": None, "tokens": len(s.ids), "checkpoints": [p for p, _ in s.checkpoints],
                       "bytes": s.parked.nbytes} for s in self.parked.values()]
