"""Model output → reasoning, content and tool calls, working on token ids (spec §6 output format).

Format: ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n…</function>\\n</tool_call>``. Only the
real added tokens count as markers: ``<tool_call>`` = id 248058, ``</tool_call>`` = 248059, ``</think>`` = 248069
(``<think>`` = 248068 is dropped only as the very first id of the reasoning). The same characters spelled with
ordinary tokens are text, and so is a marker id where the grammar does not expect it.

Grammar of one call (after id 248058; ``\\n?`` = one optional newline):
``\\n?<function=NAME>`` then ``(\\n?<parameter=NAME>VALUE</parameter>)*`` then ``\\n?</function>\\n?`` id 248059.
A value ends at the first ``</parameter>`` followed by a valid continuation: ``\\n?<parameter=NAME>`` (NAME a property
of the tool's schema when the schema lists properties) or ``\\n?</function>\\n?`` + id 248059; any other
``</parameter>`` is value text. One framing newline is removed at each end of a value. A call that breaks the grammar
becomes an :class:`InvalidCall` spanning from its 248058 to the first 248059 at or after the break (reason
``malformed``), or to the end of output (``unterminated``). Values are converted by the tool's JSON schema
(:func:`convert_value`). Stop ids 248046/248044 end the output.

``parse(ids, ...)`` (one shot, regular expressions over the whole output) and :class:`StreamParser` (events per fed id)
are separate implementations; ``fold(events)`` of the stream equals ``parse`` for every chunking.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from loader.config import ENDOFTEXT_ID, IM_END_ID, THINK_END_ID, THINK_ID, TOOL_CALL_END_ID, TOOL_CALL_ID
from loader.detok import StreamDetokenizer

# Marker ids as single lone-surrogate characters: decoded UTF-8 text can never contain one.
TC, TCE, TH, THE = "\ud800", "\ud801", "\ud802", "\ud803"
MARKERS = {TOOL_CALL_ID: TC, TOOL_CALL_END_ID: TCE, THINK_ID: TH, THINK_END_ID: THE}
MARKER_TEXT = {TC: "<tool_call>", TCE: "</tool_call>", TH: "<think>", THE: "</think>"}
STOP_IDS = (IM_END_ID, ENDOFTEXT_ID)
CLOSE = "</parameter>"
_NAME_CHARS = r"[^>\n\ud800-\udfff]"


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: ``arguments`` values converted by schema; ``warnings`` says what could not be."""
    index: int
    name: str
    arguments: dict
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class InvalidCall:
    """A call region that breaks the grammar: its text (markers as their text) and ``malformed``/``unterminated``."""
    index: int
    raw: str
    reason: str


@dataclass
class ParseResult:
    """``reasoning`` is None when the output was parsed without reasoning; ``content`` is all text outside calls."""
    reasoning: str | None = None
    reasoning_complete: bool = False
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_calls: list[InvalidCall] = field(default_factory=list)


def lit(s: str) -> str:
    """Text of a symbol string: markers replaced by the text of their token."""
    for m, t in MARKER_TEXT.items():
        s = s.replace(m, t)
    return s


def tool_schemas(tools) -> dict[str, dict]:
    """``{name: parameters schema}`` from OpenAI-style tools (``{"type": "function", "function": {...}}`` or bare)."""
    out = {}
    for i, t in enumerate(tools or ()):
        fn = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}]: expected a dict with a function name, got {t!r:.80}")
        out[fn["name"]] = fn.get("parameters") or {}
    return out


def _types(schema: dict) -> set[str]:
    t = schema.get("type")
    types = set(t) if isinstance(t, list) else ({t} if isinstance(t, str) else set())
    for sub in [*schema.get("anyOf", ()), *schema.get("oneOf", ())]:
        types |= _types(sub) if isinstance(sub, dict) else set()
    if not types and "enum" in schema:
        types = {"string" if isinstance(v, str) else "null" if v is None else "number" for v in schema["enum"]}
    return types


def convert_value(raw: str, schema: dict | None) -> tuple[object, str | None]:
    """Value text → JSON value by the property's schema; ``(value, warning)``.

    No schema or a ``string`` type: the text verbatim (so ``null`` stays text). ``null`` allowed and text ``null`` or
    ``None`` (the template writes Python's ``str(None)``): None. Then in order:
    integer (JSON integer syntax), number (JSON number: ``1e-3`` → 0.001), boolean (``true``/``false`` any case: the
    template writes Python's ``True``), object/array (JSON). Nothing fits: the text, with a warning (the call is kept)."""
    types = _types(schema or {})
    if not types or "string" in types:
        return raw, None
    if "null" in types and raw.strip() in ("null", "None"):
        return None, None
    s = raw.strip()
    if "integer" in types and re.fullmatch(r"-?(?:0|[1-9][0-9]*)", s):
        return int(s), None
    if "number" in types and re.fullmatch(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?", s):
        return json.loads(s), None
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower() == "true", None
    for t, py in (("object", dict), ("array", list)):
        if t in types:
            try:
                v = json.loads(s)
            except ValueError:
                continue
            if isinstance(v, py):
                return v, None
    return raw, f"value {raw[:40]!r} is not a valid {'|'.join(sorted(types))}; kept as text"


def _param_warnings(fn_name: str, schemas: dict | None, pname: str, seen: dict) -> list[str]:
    w = []
    if schemas is not None and fn_name in schemas:
        props = schemas[fn_name].get("properties")
        if isinstance(props, dict) and props and pname not in props:
            w.append(f"parameter {pname!r} is not in the schema of {fn_name!r}")
    if pname in seen:
        w.append(f"parameter {pname!r} given twice; the last value is kept")
    return w


def finish_call(index: int, name: str, params: list[tuple[str, str]], schemas: dict | None) -> ToolCall:
    """Build the ToolCall from raw (name, value) pairs: conversion and warnings (shared by both parsers)."""
    warnings, args = [], {}
    if schemas is not None and name not in schemas:
        warnings.append(f"function {name!r} is not among the tools")
    props = (schemas or {}).get(name, {}).get("properties") or {}
    for pname, raw in params:
        warnings += _param_warnings(name, schemas, pname, args)
        value, w = convert_value(raw, props.get(pname))
        args[pname] = value
        if w:
            warnings.append(f"{pname}: {w}")
    return ToolCall(index, name, args, tuple(warnings))


def allowed_params(fn_name: str, schemas: dict | None) -> set[str] | None:
    """Parameter names that may follow a closing ``</parameter>`` (None: any name)."""
    props = (schemas or {}).get(fn_name, {}).get("properties")
    return set(props) if isinstance(props, dict) and props else None


def symbols(ids, tokenizer) -> tuple[str, bool]:
    """Output ids → (symbol string, stopped): runs of ordinary ids decoded as a whole, markers as single characters;
    everything after a stop id is ignored."""
    parts, run, stopped = [], [], False
    for i in ids:
        i = int(i)
        if i in STOP_IDS:
            stopped = True
            break
        if i in MARKERS:
            parts += [tokenizer.decode(run), MARKERS[i]]
            run = []
        else:
            tokenizer.token_bytes(i)  # padding / out-of-range ids raise here
            run.append(i)
    parts.append(tokenizer.decode(run))
    return "".join(parts), stopped


def split_reasoning(ids, tokenizer) -> tuple[str, str, bool]:
    """(reasoning, rest, complete): the reasoning ends only at id 248069; ``</think>`` as ordinary tokens is text."""
    s, _ = symbols(ids, tokenizer)
    s = s[1:] if s.startswith(TH) else s
    k = s.find(THE)
    return (lit(s), "", False) if k < 0 else (lit(s[:k]), lit(s[k + 1:]), True)


_FUNC_RE = re.compile(rf"\n?<function=({_NAME_CHARS}+)>")
_PARAM_RE = re.compile(rf"\n?<parameter=({_NAME_CHARS}+)>")
_END_RE = re.compile(rf"\n?</function>\n?{TCE}")


def _match_call(s: str, i: int, index: int, schemas):
    """One call starting after its 248058 at ``i``: (end, ToolCall) or (fail_position, None)."""
    m = _FUNC_RE.match(s, i)
    if not m:
        return i, None
    name, i, params = m.group(1), m.end(), []
    allowed = allowed_params(name, schemas)
    while True:
        if m := _END_RE.match(s, i):
            return m.end(), finish_call(index, name, params, schemas)
        if not (m := _PARAM_RE.match(s, i)):
            return i, None
        pname, i = m.group(1), m.end()
        i += s.startswith("\n", i)
        j = i
        while (p := s.find(CLOSE, j)) >= 0:
            q = p + len(CLOSE)
            c = _PARAM_RE.match(s, q)
            if (c and (allowed is None or c.group(1) in allowed)) or _END_RE.match(s, q):
                break
            j = p + 1
        else:
            return len(s), None
        raw = s[i:p]
        params.append((pname, lit(raw[:-1] if raw.endswith("\n") else raw)))
        i = q


def parse(ids, tokenizer, tools=None, reasoning: bool = True) -> ParseResult:
    """One-shot parse of a whole output (ids after the generation prompt). ``reasoning``: output starts in reasoning
    (thinking on). ``tools``: OpenAI-style tool list for value conversion; None = no schemas (values kept as text)."""
    s, _ = symbols(ids, tokenizer)
    schemas = tool_schemas(tools) if tools is not None else None
    res, pos = ParseResult(), 0
    if reasoning:
        s = s[1:] if s.startswith(TH) else s
        k = s.find(THE)
        res.reasoning, res.reasoning_complete = lit(s if k < 0 else s[:k]), k >= 0
        pos = len(s) if k < 0 else k + 1
    content, index = [], 0
    while (k := s.find(TC, pos)) >= 0:
        content.append(lit(s[pos:k]))
        end, call = _match_call(s, k + 1, index, schemas)
        if call is not None:
            res.tool_calls.append(call)
            pos = end
        else:
            e = s.find(TCE, end)
            pos = len(s) if e < 0 else e + 1
            res.invalid_calls.append(InvalidCall(index, lit(s[k:pos]), "unterminated" if e < 0 else "malformed"))
        index += 1
    content.append(lit(s[pos:]))
    res.content = "".join(content)
    return res


# ---------------------------------------------------------------------------------------------- streaming
NEED, FAIL = -1, -2


def _match_seq(t: str, items: tuple, allowed: set | None) -> tuple[int, str | None]:
    """Partial match of ``t`` against a sequence of items: ``"?\\n"`` (optional newline), ``"NAME"`` (name chars then
    ``>``; checked against ``allowed``) or a literal. Returns (length, name) on a match, (NEED, None) when ``t`` is a
    proper prefix of a possible match, (FAIL, None) otherwise."""
    if not items:
        return 0, None
    head, rest = items[0], items[1:]
    if head == "?\n":
        tries = [_match_seq(t, rest, allowed)]
        if t.startswith("\n"):
            r = _match_seq(t[1:], rest, allowed)
            tries.insert(0, (r[0] + 1, r[1]) if r[0] >= 0 else r)
        best = next((r for r in tries if r[0] >= 0), None)
        return best or ((NEED, None) if any(r[0] == NEED for r in tries) else (FAIL, None))
    if head == "NAME":
        m = re.match(rf"{_NAME_CHARS}*", t)
        n = m.end()
        if n == len(t):
            return NEED, None
        if t[n] != ">" or n == 0 or (allowed is not None and t[:n] not in allowed):
            return FAIL, None
        r = _match_seq(t[n + 1:], rest, allowed)
        return (r[0] + n + 1, t[:n]) if r[0] >= 0 else r
    if len(t) < len(head):
        return (NEED, None) if head.startswith(t) else (FAIL, None)
    if not t.startswith(head):
        return FAIL, None
    r = _match_seq(t[len(head):], rest, allowed)
    return (r[0] + len(head), r[1]) if r[0] >= 0 else r


_SEQ_FUNC = ("?\n", "<function=", "NAME")
_SEQ_PARAM = ("?\n", "<parameter=", "NAME")
_SEQ_END = ("?\n", "</function>", "?\n", TCE)


@dataclass(frozen=True)
class Event:
    """One streaming event. kind: ``reasoning_start``; ``reasoning`` / ``content`` (text deltas); ``reasoning_end``;
    ``call_start`` (index, name); ``param_start`` (index, name); ``param_delta`` (index, name, text: raw value text);
    ``param_end`` (index, name, value: converted); ``call_end`` (call); ``call_invalid`` (invalid)."""
    kind: str
    text: str = ""
    index: int = -1
    name: str = ""
    value: object = None
    call: ToolCall | None = None
    invalid: InvalidCall | None = None


def fold(events) -> ParseResult:
    """The ParseResult an event sequence describes (for comparing a stream with :func:`parse`)."""
    res = ParseResult()
    for e in events:
        if e.kind == "reasoning_start":
            res.reasoning = ""
        elif e.kind == "reasoning":
            res.reasoning = (res.reasoning or "") + e.text
        elif e.kind == "reasoning_end":
            res.reasoning, res.reasoning_complete = res.reasoning or "", True
        elif e.kind == "content":
            res.content += e.text
        elif e.kind == "call_end":
            res.tool_calls.append(e.call)
        elif e.kind == "call_invalid":
            res.invalid_calls.append(e.invalid)
    return res


class StreamParser:
    """Incremental parser: ``feed(ids) -> list[Event]`` as ids arrive, ``finish() -> list[Event]`` at the end (also
    run by a stop id). Text is released as soon as no later id can change its meaning; a value's closing tag and
    trailing newline are held until the continuation decides them. Same arguments as :func:`parse`."""

    def __init__(self, tokenizer, tools=None, reasoning: bool = True):
        self._detok = StreamDetokenizer(tokenizer)
        self._schemas = tool_schemas(tools) if tools is not None else None
        self._state = "reasoning_start" if reasoning else "content"
        self._reasoning_seen = False
        self._buf, self._done, self._index = "", False, 0
        self._raw = ""  # symbols of the current call since its 248058
        self._name, self._params, self._pname, self._val, self._scan, self._emitted = "", [], "", "", 0, 0

    def feed(self, ids) -> list[Event]:
        """Feed one id or a sequence of ids; returns the events they decide. A stop id ends the output (the rest of
        the sequence is ignored). Padding/out-of-range ids raise TokenizerError; feeding after the end RuntimeError."""
        if self._done:
            raise RuntimeError("StreamParser.feed after the output ended (stop id or finish())")
        if isinstance(ids, int):
            ids = [ids]
        out: list[Event] = []
        for i in ids:
            i = int(i)
            if i in STOP_IDS:
                return out + self._step(self._detok.flush(), final=False) + self.finish()
            text = self._detok.flush() + MARKERS[i] if i in MARKERS else self._detok.push(i)
            out += self._step(text, final=False)
        return out

    def finish(self) -> list[Event]:
        """End of output: releases held text, closes or invalidates an open call; idempotent."""
        if self._done:
            return []
        out = self._step(self._detok.flush(), final=True)
        self._done = True
        return out

    # ---------------------------------------------------------------- state machine
    def _step(self, text: str, final: bool) -> list[Event]:
        out: list[Event] = []
        if self._state == "value":
            self._val += text
        else:
            self._buf += text
        while getattr(self, "_st_" + self._state)(out, final):
            pass
        return out

    def _st_reasoning_start(self, out, final) -> bool:
        if not self._buf and not final:
            return False
        self._buf = self._buf[1:] if self._buf.startswith(TH) else self._buf
        self._state = "reasoning"
        out.append(Event("reasoning_start"))
        return True

    def _st_reasoning(self, out, final) -> bool:
        k = self._buf.find(THE)
        if self._buf[:k if k >= 0 else None]:
            out.append(Event("reasoning", lit(self._buf[:k if k >= 0 else None])))
        if k < 0:
            self._buf = ""
            return False
        self._buf, self._state = self._buf[k + 1:], "content"
        out.append(Event("reasoning_end"))
        return True

    def _st_content(self, out, final) -> bool:
        k = self._buf.find(TC)
        if self._buf[:k if k >= 0 else None]:
            out.append(Event("content", lit(self._buf[:k if k >= 0 else None])))
        if k < 0:
            self._buf = ""
            return False
        self._buf, self._raw, self._state = self._buf[k + 1:], TC, "call_open"
        self._params = []
        return True

    def _consume(self, n: int) -> None:
        self._raw += self._buf[:n]
        self._buf = self._buf[n:]

    def _fail(self) -> bool:
        self._state = "skip"
        return True

    def _st_call_open(self, out, final) -> bool:
        n, name = _match_seq(self._buf, _SEQ_FUNC, None)
        if n == NEED and not final:
            return False
        if n < 0:
            return self._fail()
        self._consume(n)
        self._name, self._state = name, "call_body"
        out.append(Event("call_start", index=self._index, name=name))
        return True

    def _st_call_body(self, out, final) -> bool:
        n, _ = _match_seq(self._buf, _SEQ_END, None)
        if n >= 0:
            self._consume(n)
            call = finish_call(self._index, self._name, self._params, self._schemas)
            out.append(Event("call_end", index=self._index, name=self._name, call=call))
            self._index, self._state = self._index + 1, "content"
            return True
        m, pname = _match_seq(self._buf, _SEQ_PARAM, None)
        if m >= 0:
            self._consume(m)
            self._pname, self._state = pname, "value_start"
            out.append(Event("param_start", index=self._index, name=pname))
            return True
        if NEED in (n, m) and not final:
            return False
        return self._fail()

    def _st_value_start(self, out, final) -> bool:
        if not self._buf and not final:
            return False
        if self._buf.startswith("\n"):
            self._consume(1)
        self._val, self._buf, self._scan, self._emitted, self._state = self._buf, "", 0, 0, "value"
        return True

    def _emit_value(self, out, end: int) -> None:
        end -= end > 0 and self._val[end - 1] == "\n"  # the framing newline before a closing tag is held
        if end > self._emitted:
            out.append(Event("param_delta", lit(self._val[self._emitted:end]), self._index, self._pname))
            self._emitted = end

    def _st_value(self, out, final) -> bool:
        v, allowed = self._val, allowed_params(self._name, self._schemas)
        while (p := v.find(CLOSE, self._scan)) >= 0:
            q = p + len(CLOSE)
            a, _ = _match_seq(v[q:], _SEQ_PARAM, allowed)
            b, _ = _match_seq(v[q:], _SEQ_END, None)
            if a >= 0 or b >= 0:
                self._emit_value(out, p)
                raw = v[:p]
                value = lit(raw[:-1] if raw.endswith("\n") else raw)
                self._params.append((self._pname, value))
                cv, _ = convert_value(value, ((self._schemas or {}).get(self._name, {}).get("properties") or {})
                                      .get(self._pname))
                out.append(Event("param_end", index=self._index, name=self._pname, value=cv))
                self._raw += v[:q]
                self._buf, self._val, self._state = v[q:], "", "call_body"
                return True
            if NEED in (a, b) and not final:
                self._emit_value(out, p)
                return False
            self._scan = p + 1
        if final:
            self._raw += v
            self._buf, self._val = "", ""
            return self._fail()
        hold = next((k for k in range(min(len(CLOSE) - 1, len(v)), 0, -1) if v.endswith(CLOSE[:k])), 0)
        self._emit_value(out, len(v) - hold)
        return False

    def _st_skip(self, out, final) -> bool:
        k = self._buf.find(TCE)
        if k < 0 and not final:
            self._raw += self._buf
            self._buf = ""
            return False
        self._consume(len(self._buf) if k < 0 else k + 1)
        inv = InvalidCall(self._index, lit(self._raw), "unterminated" if k < 0 else "malformed")
        out.append(Event("call_invalid", index=self._index, invalid=inv))
        self._index, self._state = self._index + 1, "content"
        return True
