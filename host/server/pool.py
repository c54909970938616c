"""Resident sessions across requests: a request runs in the session whose history it can reuse most.

Every engine slot holds at most one :class:`host.session.Session`. A session can continue a prompt from
``usable(session, prompt)`` tokens: all of its ids when the prompt extends them, else the newest state checkpoint
at or before the common prefix (GDN state cannot be rewound, so that is where ``Session._sync`` restarts). The
pool picks the session with the most usable tokens; a request that can use none gets a free slot, or the least
recently used session is closed and its slot reopened. Reusing a session whose history diverges from the prompt
drops its tail past the restart point: in a chat with thinking on that tail is the last reply, which the next
turn's render changes anyway (the template drops an earlier turn's reasoning), so it was never reusable. Only the
engine's worker thread touches the pool.
"""
from __future__ import annotations

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


class SessionPool:
    """Sessions of one engine by slot, least recently used first."""

    def __init__(self, engine):
        self.engine = engine
        self.sessions: OrderedDict[int, Session] = OrderedDict()

    def acquire(self, prompt: list[int]) -> Session:
        """The session to run ``prompt`` in, marked most recently used."""
        best, gain = None, 0
        for s in self.sessions.values():
            u = usable(s, prompt)
            if u > gain:
                best, gain = s, u
        if best is None:
            if len(self.sessions) >= self.engine.executor.slots:
                _, victim = self.sessions.popitem(last=False)
                victim.close()
            best = self.engine.new_session()
        self.sessions[best.slot] = best
        self.sessions.move_to_end(best.slot)
        return best

    def drop(self, s: Session) -> None:
        """Forget ``s`` and give its slot back (after an error left its state unknown)."""
        self.sessions.pop(s.slot, None)
        s.close()

    def close(self) -> None:
        """Close every session."""
        for s in self.sessions.values():
            s.close()
        self.sessions.clear()

    def stats(self) -> list[dict]:
        """Tokens and checkpoints of each resident session, least recently used first."""
        return [{"slot": k, "tokens": len(s.ids), "checkpoints": [p for p, _ in s.checkpoints]}
                for k, s in self.sessions.items()]
