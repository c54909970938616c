"""Tool-call parser and reasoning splitter on token ids: the issue's cases, schema conversion, marker ids versus the
same characters as ordinary tokens, and agreement of the streaming parser with the one-shot parser for every
chunking (1, 2, 3, random k ids; all at once) of canonical, per-character and per-byte spellings."""
import random
import time

import pytest

from loader.chat_template import ChatTemplate
from loader.config import FIRST_PADDING_ID, IM_END_ID, THINK_END_ID, TOOL_CALL_ID
from loader.tokenizer import TokenizerError
from loader.toolcall import (InvalidCall, StreamParser, ToolCall, convert_value, fold, parse, split_reasoning)
from tests.helpers import chunkings, spell


def _tool(name, props):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


SHELL = _tool("shell", {"cmd": {"type": "string"}, "code": {"type": "string"}, "n": {"type": "integer"}})
SCHEMA = _tool("plan", {"day": {"type": "integer"}, "count": {"type": ["integer", "null"]},
                        "location": {"type": "string"}, "ratio": {"type": "number"}, "cfg": {"type": "object"},
                        "flag": {"type": "boolean"}, "items": {"type": "array"}})
TOOLS = [SHELL, SCHEMA]
WEIRD = "echo '</parameter>' </tool_call> a < b &amp; pwd && ls -la"


def _call(name, params, sep="\n"):
    body = "".join(f"<parameter={k}>{sep}{v}{sep}</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _stream(tok, ids, sizes, tools=TOOLS, reasoning=True):
    p, events, pos = StreamParser(tok, tools, reasoning), [], 0
    for n in sizes:
        if pos >= len(ids) or p._done:
            break
        events += p.feed(ids[pos:pos + n])
        pos += n
    return events + p.finish()


def _check_agree(tok, text, tools=TOOLS, reasoning=True, seed=None):
    """Stream ≡ one-shot for all spellings and chunkings; returns the one-shot result of the canonical spelling."""
    rng = random.Random(time.time_ns() if seed is None else seed)
    want = parse(tok.encode(text), tok, tools, reasoning)
    for mode in ("canonical", "chars", "bytes"):
        ids = spell(tok, text, mode)
        assert parse(ids, tok, tools, reasoning) == want, mode
        for sizes in chunkings(len(ids), rng):
            events = _stream(tok, ids, sizes, tools, reasoning)
            assert fold(events) == want, (mode, sizes[:5])
            for c in want.tool_calls:  # raw value deltas concatenate to each string value
                for k, v in c.arguments.items():
                    if isinstance(v, str):
                        got = "".join(e.text for e in events if e.kind == "param_delta" and e.index == c.index
                                      and e.name == k)
                        assert got == v, (mode, k)
    return want


def test_value_with_markup_comes_back_verbatim(tok):
    text = "Let me run it.\n</think>\n\n" + _call("shell", [("cmd", WEIRD), ("n", "5")]) + "<|im_end|>"
    r = _check_agree(tok, text)
    assert r.reasoning == "Let me run it.\n" and r.reasoning_complete and r.content == "\n\n"  # raw: lossless
    assert r.tool_calls == [ToolCall(0, "shell", {"cmd": WEIRD, "n": 5})]
    assert tok.encode(WEIRD).count(248059) == 1  # the </tool_call> inside the value is the real id, still text


def test_closing_tag_needs_valid_continuation(tok):
    # a value containing "</parameter>\n" followed by text that is not a parameter of the tool
    v = "x\n</parameter>\n<parameter=nope>\ny"
    r = _check_agree(tok, "t\n</think>\n\n" + _call("shell", [("cmd", v)]))
    assert r.tool_calls[0].arguments == {"cmd": v}
    # negative control: without schemas any parameter name is a valid continuation, so the value is cut there
    r2 = parse(tok.encode("t\n</think>\n\n" + _call("shell", [("cmd", v)])), tok, None)
    assert r2.tool_calls[0].arguments["cmd"] == "x" and r2.tool_calls[0].arguments["nope"] == "y"


def test_one_framing_newline_removed_each_end(tok):
    code = "\n    if x:\n        return 1\n\n"
    text = f"r\n</think>\n\n<tool_call>\n<function=shell>\n<parameter=code>{code}</parameter>\n</function>\n</tool_call>"
    assert _check_agree(tok, text).tool_calls[0].arguments == {"code": "    if x:\n        return 1\n"}
    text = "r\n</think>\n\n<tool_call>\n<function=shell>\n<parameter=code></parameter>\n</function>\n</tool_call>"
    assert _check_agree(tok, text).tool_calls[0].arguments == {"code": ""}


def test_schema_conversion(tok):
    params = [("day", "2026-01-15"), ("count", "5"), ("location", "null"), ("ratio", "1e-3"), ("cfg", '{"k": 1}'),
              ("flag", "True"), ("items", '[1, "a"]')]
    r = _check_agree(tok, "r\n</think>\n\n" + _call("plan", params))
    (c,) = r.tool_calls
    assert c.arguments == {"day": "2026-01-15", "count": 5, "location": "null", "ratio": 0.001, "cfg": {"k": 1},
                           "flag": True, "items": [1, "a"]}
    assert type(c.arguments["count"]) is int and type(c.arguments["ratio"]) is float
    assert len(c.warnings) == 1 and "day" in c.warnings[0]  # kept as text, call not dropped
    assert convert_value("null", {"type": ["integer", "null"]}) == (None, None)
    assert convert_value("None", {"type": ["integer", "null"]}) == (None, None)
    assert convert_value("null", {"type": ["string", "null"]}) == ("null", None)
    assert convert_value("null", {"type": "integer"})[0] == "null"
    assert convert_value("5", None) == ("5", None) and convert_value("1.5", {"type": "integer"})[0] == "1.5"
    assert convert_value("x", {"enum": ["x", "y"]}) == ("x", None)
    assert convert_value("3", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) == (3, None)


def test_reasoning_ends_only_at_the_marker_id(tok):
    fake_end = [i for p in ("</", "think", ">") for i in tok.encode(p)]
    assert tok.decode(fake_end) == "</think>" and THINK_END_ID not in fake_end
    ids = tok.encode("a ") + fake_end + tok.encode(" b\n") + [THINK_END_ID] + tok.encode("\n\nAnswer.")
    assert split_reasoning(ids, tok) == ("a </think> b\n", "\n\nAnswer.", True)
    r = parse(ids, tok, TOOLS)
    assert (r.reasoning, r.content, r.reasoning_complete) == ("a </think> b\n", "\n\nAnswer.", True)
    for sizes in chunkings(len(ids), random.Random(time.time_ns())):
        assert fold(_stream(tok, ids, sizes)) == r
    unfinished = tok.encode("a ") + fake_end
    assert split_reasoning(unfinished, tok) == ("a </think>", "", False)
    assert parse(unfinished, tok).reasoning_complete is False


def test_marker_spelled_as_text_is_not_a_call(tok):
    fake_call = [i for p in ("<", "tool", "_call", ">") for i in tok.encode(p)]
    assert TOOL_CALL_ID not in fake_call
    ids = [THINK_END_ID] + fake_call + tok.encode("\n<function=shell>\n</function>\n</tool_call>")
    r = parse(ids, tok, TOOLS)
    assert r.tool_calls == [] and r.invalid_calls == [] and r.content.startswith("<tool_call>\n<function=shell>")


def test_several_calls_and_text(tok):
    text = ("think\n</think>\n\nSure 😊.\n\n" + _call("shell", [("cmd", "ls")]) + "\n" +
            _call("plan", [("day", "3"), ("cfg", "{}")]) + "<|im_end|>ignored after stop")
    r = _check_agree(tok, text)
    assert r.content == "\n\nSure 😊.\n\n\n"
    assert [c.name for c in r.tool_calls] == ["shell", "plan"] and r.tool_calls[1].arguments == {"day": 3, "cfg": {}}


def test_without_reasoning_and_unknown_names(tok):
    text = _call("nuke", [("x", "1")]) + _call("shell", [("zzz", "2"), ("n", "1"), ("n", "2")])
    r = _check_agree(tok, text, reasoning=False)
    assert r.reasoning is None
    assert r.tool_calls[0].warnings == ("function 'nuke' is not among the tools",)
    assert r.tool_calls[1].arguments == {"zzz": "2", "n": 2} and len(r.tool_calls[1].warnings) == 2


@pytest.mark.parametrize("body, after, reason", [
    ("\n<fun=shell>\n</function>\n</tool_call>", "after", "malformed"),
    ("\n<function=shell>\nstray\n</function>\n</tool_call>", "after", "malformed"),
    ("\n<function=shell>\n<parameter=cmd>\nls\n</parameter>\n</function>\n", "", "unterminated"),
    ("\n<function=shell>\n<parameter=cmd>\nls", "", "unterminated"),
    ("\n<function=sh", "", "unterminated"),
    # no valid continuation after </parameter>: the value never closes, the rest of the output is the call
    ("\n<function=shell>\n<parameter=cmd>\nls\n</parameter>\nstray\n</function>\n</tool_call>after", "",
     "unterminated"),
])
def test_invalid_calls(tok, body, after, reason):
    r = _check_agree(tok, "r\n</think>\n\nx<tool_call>" + body + after)
    assert r.tool_calls == [] and r.invalid_calls == [InvalidCall(0, "<tool_call>" + body, reason)]
    assert r.content == "\n\nx" + after


def test_rendered_history_round_trips_through_parser(tok):
    # the template writes values the way the model sees them; parsing that text recovers the arguments
    args = {"day": 7, "count": None, "location": "Zürich\n  centre", "ratio": 0.25, "cfg": {"k": [1, 2]},
            "flag": False, "items": ["a", 1]}
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "reasoning_content": "ok",
             "tool_calls": [{"function": {"name": "plan", "arguments": args}}]}]
    out = ChatTemplate.default().render(msgs, tools=TOOLS, add_generation_prompt=False)
    gen = out[out.rindex("<|im_start|>assistant\n<think>\n") + len("<|im_start|>assistant\n<think>\n"):]
    r = _check_agree(tok, gen)
    assert r.tool_calls[0].arguments == args and r.reasoning == "ok\n"


def test_random_outputs_agree(tok):
    rng = random.Random(time.time_ns())
    pieces = ["x", "\n", "</parameter>", "<parameter=n>", "</function>", "<tool_call>", "</tool_call>", "</think>",
              "<function=shell>", "<parameter=cmd>", " é😊", "\ufffd", "<", ">", "5"]
    for _ in range(40):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        for reasoning in (True, False):
            _check_agree(tok, text, reasoning=reasoning, seed=rng.randrange(2**32))


def test_bad_ids_and_feed_after_stop(tok):
    with pytest.raises(TokenizerError, match=f"token id {FIRST_PADDING_ID}"):
        parse([1, FIRST_PADDING_ID], tok)
    p = StreamParser(tok)
    with pytest.raises(TokenizerError, match="padding"):
        p.feed([FIRST_PADDING_ID])
    p.feed([IM_END_ID])
    with pytest.raises(RuntimeError, match="after the output ended"):
        p.feed([1])
