"""Stop strings in streamed text: the matcher the decode loop and the reply parser share (``host.session`` finds
where a reply ends, ``host.reply`` cuts its content at the same place)."""
from __future__ import annotations

from typing import Sequence


class StopMatcher:
    """Finds user stop strings in the streamed text; holds back any tail that could start one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops]
        self.text = ""
        self.emitted = 0

    def feed(self, t: str) -> tuple[str, str | None]:
        """Append ``t``; return (text now safe to emit, the stop string found or None; the earliest match wins,
        then the first in ``stops``)."""
        self.text += t
        hits = [(j, k) for k, j in enumerate(self.text.find(s, self.emitted) for s in self.stops) if j >= 0]
        if hits:
            j, k = min(hits)
            self.text = self.text[:j]
            out, self.emitted = self.text[self.emitted:], j
            return out, self.stops[k]
        hold = 0
        for s in self.stops:  # longest proper prefix of a stop string ending the text
            for k in range(min(len(s) - 1, len(self.text) - self.emitted), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        end = len(self.text) - hold
        out, self.emitted = self.text[self.emitted:end], end
        return out, None

    def flush(self) -> str:
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out
