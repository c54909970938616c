"""Generated ids -> the OpenAI chat message: ``reasoning_content``, ``content`` and ``tool_calls``, streamed.

:class:`ChatOutput` feeds the ids of each Delta to ``loader.toolcall.StreamParser`` (reasoning ends at id 248069
``</think>``; a call is the ``<tool_call>`` ... id 248059 grammar) and turns its events into OpenAI delta dicts.
The non-streamed message is the same deltas joined, so both answers always agree. Reasoning loses the newline
that frames it in the template, content its leading newlines (the template's ``</think>\\n\\n``). Stop strings
are matched on each channel's text (the session stops the generation on the same strings in the whole text).
Without tools (or with ``tool_choice: "none"``) a call the model writes anyway stays in the content as text.
"""
from __future__ import annotations

import json
import uuid

from host.session import _StopMatcher
from loader.toolcall import StreamParser


def tool_call_text(call) -> str:
    """A parsed call written back in the model's format (for output that is not parsed as tool calls)."""
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in call.arguments.items())
    return f"<tool_call>\n<function={call.name}>\n{params}</function>\n</tool_call>"


class _Channel:
    """One text channel: stop strings cut it; leading newlines dropped; trailing ones held (``hold_tail``)."""

    def __init__(self, stops: list[str], hold_tail: bool):
        self.match = _StopMatcher(stops) if stops else None
        self.hold_tail, self.started, self.held, self.hit = hold_tail, False, "", False

    def feed(self, t: str, final: bool = False) -> str:
        if self.hit:
            return ""
        if self.match is not None:
            t, stop = self.match.feed(t)
            if stop is not None:
                self.hit, final = True, True
            elif final:
                t += self.match.flush()
        if not self.started:
            t = t.lstrip("\n")
            self.started = bool(t)
        t = self.held + t
        self.held = ""
        if self.hold_tail:
            body = t.rstrip("\n")
            self.held, t = ("" if final else t[len(body):]), body
        return t


class ChatOutput:
    """Accumulates one chat answer; ``feed(ids)`` / ``finish()`` return OpenAI ``delta`` dicts (possibly empty)."""

    def __init__(self, tokenizer, tools: list | None, reasoning: bool, stops: list[str], parse_tools: bool):
        self.parser = StreamParser(tokenizer, tools, reasoning=reasoning)
        self.parse_tools = parse_tools and bool(tools)
        self.reasoning_ch = _Channel(stops, hold_tail=True)
        self.content_ch = _Channel(stops, hold_tail=False)
        self.reasoning, self.content = "", ""
        self.tool_calls: list[dict] = []
        self.saw_reasoning = reasoning

    def feed(self, ids: list[int]) -> dict:
        """The delta for newly generated ``ids``."""
        return self._delta(self.parser.feed(ids), final=False)

    def finish(self) -> dict:
        """The delta of whatever the parser and channels held back at the end."""
        return self._delta(self.parser.finish(), final=True)

    def _delta(self, events, final: bool) -> dict:
        r, c, calls = [], [], []
        for e in events:
            if e.kind == "reasoning":
                r.append(self.reasoning_ch.feed(e.text))
            elif e.kind == "reasoning_end":
                r.append(self.reasoning_ch.feed("", final=True))
            elif e.kind == "content":
                c.append(self.content_ch.feed(e.text))
            elif e.kind == "call_end":
                if self.parse_tools and not self.content_ch.hit:
                    tc = {"index": len(self.tool_calls), "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": e.call.name,
                                       "arguments": json.dumps(e.call.arguments, ensure_ascii=False)}}
                    self.tool_calls.append(tc)
                    calls.append(tc)
                else:
                    c.append(self.content_ch.feed(tool_call_text(e.call)))
            elif e.kind == "call_invalid":
                c.append(self.content_ch.feed(e.invalid.raw))
        if final:
            r.append(self.reasoning_ch.feed("", final=True))
            c.append(self.content_ch.feed("", final=True))
        delta: dict = {}
        if "".join(r):
            delta["reasoning_content"] = "".join(r)
            self.reasoning += delta["reasoning_content"]
        if "".join(c):
            delta["content"] = "".join(c)
            self.content += delta["content"]
        if calls:
            delta["tool_calls"] = calls
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
