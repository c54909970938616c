"""A reply's structure, parsed by token id as it streams: reasoning, content and tool calls in the OpenAI shape.

The decode loop feeds every generated id to a :class:`ReplyParser` (``loader.toolcall.StreamParser`` underneath:
the markers are the added ids 248068/248069 ``<think>``/``</think>`` and 248058/248059
``<tool_call>``/``</tool_call>``; the same characters spelled with ordinary tokens are text). Each ``feed``
returns the pieces that id decided (reasoning text, content text, finished tool calls); the result fields are the
concatenation of those pieces, so a stream and its result agree by construction, and both agree with the one-shot
``loader.toolcall.parse`` of the same ids (``tests/cpu/test_agent_reply.py``).

Tool calls in the OpenAI shape (``{"id": "call_…", "type": "function", "function": {"name": …, "arguments":
"<JSON text>"}}``), arguments typed by the tool's JSON schema (``loader.toolcall.convert_value``). A streamed call
is handed out whole when its ``</tool_call>`` arrives (one delta: id, type, name and the complete arguments), so
a call that later breaks the grammar never leaves a partial entry behind. A call region that breaks the grammar is
reported in ``invalid_tool_calls`` (``{"index", "raw", "reason"}``, reason ``malformed`` or ``unterminated``) and
never takes the good calls of the same reply with it; conversion problems of a parsed call (a value that does not
fit its type, a parameter or function the tools do not list) are in ``tool_call_warnings``.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from host.errors import RequestError
from host.grammar import Constraint, normalize_tool_choice, response_format_spec, tool_call_spec
from host.stops import StopMatcher  # the loop's matcher: content is cut where text is
from loader.config import ENDOFTEXT_ID, IM_END_ID, THINK_END_ID, THINK_ID
from loader.detok import StreamDetokenizer
from loader.toolcall import Event, StreamParser


def openai_call(call, call_id: str | None = None) -> dict:
    """``loader.toolcall.ToolCall`` → the OpenAI chat-completions tool call dict; ``arguments`` is JSON text."""
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


class _ReasoningSplitter:
    """StreamParser's events without tool parsing: reasoning up to id 248069, then content; ``<tool_call>`` ids are
    their text (``tool_choice="none"`` or no tools). The same rules as ``loader.toolcall.split_reasoning``."""

    def __init__(self, tokenizer, reasoning: bool):
        self._detok = StreamDetokenizer(tokenizer)
        self._state = "start" if reasoning else "content"
        self._done = False

    def feed(self, ids) -> list[Event]:
        out = []
        for i in ids:
            if self._done:
                break
            if i in (IM_END_ID, ENDOFTEXT_ID):
                return out + self.finish()
            if self._state == "start":
                out.append(Event("reasoning_start"))
                self._state = "reasoning"
                if i == THINK_ID:
                    continue
            if self._state == "reasoning" and i == THINK_END_ID:
                text = self._detok.flush()
                out += [Event("reasoning", text)] if text else []
                out.append(Event("reasoning_end"))
                self._state = "content"
                continue
            text = self._detok.push(i)
            if text:
                out.append(Event("reasoning" if self._state == "reasoning" else "content", text))
        return out

    def finish(self) -> list[Event]:
        if self._done:
            return []
        self._done = True
        out = [Event("reasoning_start")] if self._state == "start" else []
        self._state = "reasoning" if self._state == "start" else self._state
        text = self._detok.flush()
        return out + ([Event(self._state if self._state == "reasoning" else "content", text)] if text else [])


@dataclass
class ReplyPieces:
    """What one fed id decided: text appended to the reasoning / content, tool calls completed (OpenAI dicts, with
    ``index`` = the call's position among the reply's valid calls), invalid call regions closed."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    invalid: list[dict] = field(default_factory=list)


class ReplyParser:
    """Parses a reply id by id. ``reasoning``: the reply starts inside a reasoning block (the prompt ends with
    ``<think>\\n``, the template's generation prompt with thinking on). ``tools``: the OpenAI tool list (values are
    typed by its schemas); ``parse_tools`` False leaves ``<tool_call>`` regions in the content as text (no tools,
    or ``tool_choice="none"``). ``stops``: stop strings, held back from the content as the loop holds them back
    from ``text`` (``host.stops.StopMatcher``).

    ``feed(tok) -> ReplyPieces``; ``finish() -> ReplyPieces`` once at the end (closes an unterminated call or
    releases held text). After ``finish``: ``reasoning_content`` (None when the reply did not start in reasoning),
    ``content``, ``tool_calls``, ``invalid_tool_calls``, ``tool_call_warnings`` and ``ends_with_calls`` (at least
    one valid call and nothing but whitespace after the last one: finish_reason ``tool_calls``)."""

    def __init__(self, tokenizer, *, reasoning: bool, tools=None, parse_tools: bool = True, stops=()):
        self.parse_tools = bool(parse_tools)
        self._p = (StreamParser(tokenizer, tools, reasoning) if self.parse_tools
                   else _ReasoningSplitter(tokenizer, reasoning))
        self._match = StopMatcher(list(stops))
        self._stopped = False
        self.reasoning_content: str | None = None
        self.content = ""
        self.tool_calls: list[dict] = []
        self.invalid_tool_calls: list[dict] = []
        self.tool_call_warnings: list[dict] = []
        self._tail = ""          # content since the last valid call
        self._bad_after = False  # an invalid call after the last valid one

    @property
    def ends_with_calls(self) -> bool:
        return bool(self.tool_calls) and not self._tail.strip() and not self._bad_after

    def feed(self, tok: int) -> ReplyPieces:
        """Pieces decided by the generated id ``tok``. The parse ends at the first 248046 / 248044 (the format's
        end of output), even when custom ``stop_ids`` let the generation go on: later ids decide nothing."""
        if self._p._done:
            return ReplyPieces()
        return self._apply(self._p.feed([int(tok)]), final=False)

    def finish(self) -> ReplyPieces:
        """The last pieces: held text released, an open call reported ``unterminated``. Idempotent."""
        return self._apply(self._p.finish(), final=True)

    def _content(self, text: str, out: ReplyPieces) -> None:
        if self._stopped:
            return
        safe, hit = self._match.feed(text)
        if hit is not None:
            self._stopped = True
        out.content += safe
        self.content += safe
        self._tail += safe

    def _apply(self, events, final: bool) -> ReplyPieces:
        out = ReplyPieces()
        for e in events:
            if e.kind == "reasoning_start":
                self.reasoning_content = ""
            elif e.kind == "reasoning":
                out.reasoning += e.text
                self.reasoning_content += e.text
            elif e.kind == "content":
                self._content(e.text, out)
            elif e.kind == "call_end" and not self._stopped:
                d = openai_call(e.call)
                d["index"] = len(self.tool_calls)
                self.tool_calls.append(d)
                out.tool_calls.append(d)
                if e.call.warnings:
                    self.tool_call_warnings.append({"index": d["index"], "id": d["id"], "name": e.call.name,
                                                    "warnings": list(e.call.warnings)})
                self._tail, self._bad_after = "", False
            elif e.kind == "call_invalid" and not self._stopped:
                inv = {"index": e.invalid.index, "raw": e.invalid.raw, "reason": e.invalid.reason}
                self.invalid_tool_calls.append(inv)
                out.invalid.append(inv)
                self._bad_after = True
        if final and not self._stopped:
            rest = self._match.flush()
            out.content += rest
            self.content += rest
            self._tail += rest
        return out


@dataclass
class ReplyPlan:
    """How a reply is read and constrained, fixed before the run: ``reasoning`` (it starts in a reasoning
    block), ``tools`` (OpenAI list or None), ``parse_tools`` (tool calls are parsed: tools given and tool_choice
    not ``none``), ``tool_choice`` (normalized), ``grammar`` (a ``host.grammar.GrammarSpec`` or None) with its
    compiled form, compile time and whether it came from the cache."""

    reasoning: bool = False
    tools: list | None = None
    parse_tools: bool = False
    tool_choice: str | dict = "none"
    grammar: object = None
    compiled: object = None
    compile_ms: float = 0.0
    cached: bool = False

    def parser(self, tokenizer, stops=()) -> ReplyParser:
        return ReplyParser(tokenizer, reasoning=self.reasoning, tools=self.tools, parse_tools=self.parse_tools,
                           stops=stops)

    def constraint(self, vocab_size: int):
        """A fresh ``host.grammar.Constraint`` for one run, None when nothing constrains the reply."""
        if self.grammar is None:
            return None
        return Constraint(self.grammar, self.compiled, self.compile_ms, self.cached, vocab_size)


def plan_reply(engine, *, tools=None, tool_choice=None, response_format=None, reasoning: bool = False,
               tool_grammar: bool = True) -> ReplyPlan:
    """Check the agent arguments and compile their grammar (cached per engine: ``engine.grammars``).

    ``tools``: OpenAI tool list or None. ``tool_choice``: ``auto`` (the default with tools) | ``required`` |
    ``none`` | a function name | ``{"type": "function", "function": {"name": ...}}``. ``response_format``:
    ``host.grammar.response_format_spec``. ``tool_grammar``: constrain tool calls with the model's structural tag
    (default True; False parses whatever the model writes, and is refused with ``required`` or a named
    function, which only a grammar can enforce). Raises RequestError naming the parameter: tools not a list of
    functions, an unknown tool_choice or function name, response_format with tools under a tool_choice other
    than none, a schema / regex xgrammar rejects."""
    choice = normalize_tool_choice(tool_choice, tools)
    plan = ReplyPlan(reasoning=bool(reasoning), tools=list(tools) if tools is not None else None,
                     parse_tools=tools is not None and choice != "none", tool_choice=choice)
    rf = response_format_spec(response_format, plan.reasoning)
    if rf is not None and plan.parse_tools:
        raise RequestError("response_format: cannot be combined with tools unless tool_choice is 'none' (the "
                           "reply is either tool calls or the formatted answer)", "response_format")
    if not isinstance(tool_grammar, bool):
        raise RequestError(f"tool_grammar: expected a bool, got {tool_grammar!r}", "tool_grammar")
    if not tool_grammar and choice not in ("auto", "none"):
        raise RequestError(f"tool_grammar: tool_choice {choice if isinstance(choice, str) else 'NAME'!r} can only "
                           "be enforced by the grammar; keep tool_grammar=True", "tool_grammar")
    spec = rf if rf is not None else (tool_call_spec(plan.tools, choice, plan.reasoning)
                                      if plan.parse_tools and tool_grammar else None)
    if spec is not None:
        plan.grammar = spec
        plan.compiled, plan.compile_ms, plan.cached = engine.grammars.compile(spec)
    return plan
