"""A generation's parsed deltas -> OpenAI chat deltas and message; log-probabilities in OpenAI's shapes.

The engine parses the reply by token id (``host.reply``: ``Delta.reasoning_content`` / ``content`` /
``tool_calls``, stop strings already cut from the content). :class:`ChatOutput` only presents them: reasoning
loses the newlines that frame it in the template (``<think>\n`` ... ``\n</think>``), content its leading
newlines (the template's ``</think>\n\n``), and the non-streamed message is the streamed deltas joined, so both
answers agree.
"""
from __future__ import annotations


class _Trim:
    """Drops a channel's leading newlines; with ``hold_tail`` holds trailing ones until more text comes (and drops
    them at the end)."""

    def __init__(self, hold_tail: bool):
        self.hold_tail, self.started, self.held = hold_tail, False, ""

    def feed(self, t: str, final: bool = False) -> str:
        """The part of ``t`` to emit now (``final``: nothing more comes on this channel)."""
        if not self.started:
            t = t.lstrip("\n")
            self.started = bool(t)
        t, self.held = self.held + t, ""
        if self.hold_tail:
            body = t.rstrip("\n")
            self.held, t = ("" if final else t[len(body):]), body
        return t


class ChatOutput:
    """Accumulates one chat answer; ``feed(delta)`` / ``finish()`` return OpenAI ``delta`` dicts (maybe empty)."""

    def __init__(self, reasoning: bool):
        self.saw_reasoning = reasoning
        self._r, self._c = _Trim(hold_tail=True), _Trim(hold_tail=False)
        self.reasoning, self.content = "", ""
        self.tool_calls: list[dict] = []

    def feed(self, d) -> dict:
        """The OpenAI delta of one engine Delta."""
        return self._out(self._r.feed(d.reasoning_content or "", final=bool(d.content or d.tool_calls)),
                         self._c.feed(d.content or ""), d.tool_calls)

    def finish(self) -> dict:
        """Whatever was held back at the end."""
        return self._out(self._r.feed("", final=True), self._c.feed("", final=True), [])

    def _out(self, r: str, c: str, calls: list) -> dict:
        delta: dict = {}
        if r:
            delta["reasoning_content"] = r
            self.reasoning += r
        if c:
            delta["content"] = c
            self.content += c
        if calls:
            delta["tool_calls"] = calls
            self.tool_calls += calls
        return delta

    def message(self) -> dict:
        """The whole assistant message (OpenAI ``choices[0].message``)."""
        m = {"role": "assistant", "content": self.content or (None if self.tool_calls else ""),
             "reasoning_content": self.reasoning if self.saw_reasoning else None}
        if self.tool_calls:
            m["tool_calls"] = [{k: v for k, v in tc.items() if k != "index"} for tc in self.tool_calls]
        return m


def _token(tokenizer, i: int) -> tuple[str, list[int]]:
    b = tokenizer.token_bytes(i)
    return b.decode("utf-8", "replace"), list(b)


def chat_logprobs(tokenizer, entries) -> list[dict]:
    """OpenAI chat ``logprobs.content`` items for Delta.logprobs entries (id, logprob, [(id, logprob)])."""
    out = []
    for i, lp, top in entries:
        tok, b = _token(tokenizer, i)
        tops = []
        for j, lpj in top:
            tj, bj = _token(tokenizer, j)
            tops.append({"token": tj, "logprob": lpj, "bytes": bj})
        out.append({"token": tok, "logprob": lp, "bytes": b, "top_logprobs": tops})
    return out


def completion_logprobs(tokenizer, entries, offset: int) -> dict:
    """The legacy ``/v1/completions`` logprobs object; ``offset``: text length before these tokens."""
    toks, lps, tops, offs = [], [], [], []
    for i, lp, top in entries:
        tok, _ = _token(tokenizer, i)
        toks.append(tok)
        lps.append(lp)
        tops.append({_token(tokenizer, j)[0]: lpj for j, lpj in top})
        offs.append(offset)
        offset += len(tok)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}
