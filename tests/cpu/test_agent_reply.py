"""The reply's parsed fields in the decode loop (host/reply.py): a scripted executor spells a reply id by id, and
the result's reasoning_content / content / tool_calls / invalid_tool_calls must equal the one-shot parse of the
same ids (loader.toolcall.parse), the streamed deltas must concatenate to the result, tool calls come in the
OpenAI shape with arguments typed by schema, a malformed call is reported without taking the good calls with it,
finish_reason is tool_calls only when the reply ends with calls, and tool_choice none leaves calls as content."""
import json

import pytest

from host.reply import ReplyParser
from loader.config import IM_END_ID, THINK_END_ID, TOOL_CALL_END_ID, TOOL_CALL_ID
from loader.toolcall import parse
from tests.helpers import drain, hash_engine

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}}, "required": ["city"]}}}
TOOLS = [WEATHER]
MSGS = [{"role": "user", "content": "Weather in Oslo?"}]


def _call(tok, name, params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return [TOOL_CALL_ID] + tok.encode(f"\n<function={name}>\n{body}</function>\n") + [TOOL_CALL_END_ID]


def _reply(tok, *parts):
    ids = []
    for p in parts:
        ids += tok.encode(p) if isinstance(p, str) else list(p)
    return ids


def _run(text_layer, script, **kw):
    """Deltas and result of a one-shot chat whose reply is ``script`` then <|im_end|> (the scripted executor's
    k-th output since reset is script[k]: the prefill calls' outputs come first, counted by a dry run)."""
    eng = hash_engine(text_layer, capacity=1024)
    tools = kw.pop("tools", TOOLS)
    kw.setdefault("tool_grammar", False)  # the script is the model: parse what it wrote
    drain(eng.chat(MSGS, tools=tools, max_new_tokens=1, **kw))
    n_prefill = sum(c[0] == "prefill" for c in eng.executor.calls)
    eng.executor.script = [0] * (n_prefill - 1) + script + [IM_END_ID]
    return drain(eng.chat(MSGS, tools=tools, max_new_tokens=len(script) + 5, **kw))


def _openai(r):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in r.tool_calls]


def _check_stream(deltas, r):
    assert "".join(d.reasoning_content for d in deltas) == (r.reasoning_content or "")
    assert "".join(d.content for d in deltas) == r.content
    assert [c for d in deltas for c in d.tool_calls] == r.tool_calls


def test_reasoning_content_and_typed_calls(text_layer):
    tok, _ = text_layer
    script = _reply(tok, "Check the tool.\n", [THINK_END_ID], "\n\n",
                    _call(tok, "get_weather", [("city", "Oslo"), ("days", "3"), ("metric", "True")]))
    deltas, r = _run(text_layer, script)
    _check_stream(deltas, r)
    assert r.reasoning_content == "Check the tool.\n" and r.content == "\n\n"
    assert _openai(r) == [("get_weather", {"city": "Oslo", "days": 3, "metric": True})]
    c = r.tool_calls[0]
    assert c["type"] == "function" and c["id"].startswith("call_") and c["index"] == 0
    assert r.finish_reason == "tool_calls" and r.finish_detail == "eos"
    assert r.invalid_tool_calls == [] and r.tool_call_warnings == []
    want = parse(r.ids, tok, TOOLS, reasoning=True)  # the one-shot parser of the same ids
    assert (want.reasoning, want.content) == (r.reasoning_content, r.content)
    assert [(c.name, c.arguments) for c in want.tool_calls] == _openai(r)
    assert json.loads(r.to_json()["tool_calls"][0]["function"]["arguments"])["days"] == 3


def test_malformed_call_keeps_good_calls(text_layer):
    tok, _ = text_layer
    good = _call(tok, "get_weather", [("city", "Lima")])
    bad = [TOOL_CALL_ID] + tok.encode("\n<functio=get_weather>\n</function>\n") + [TOOL_CALL_END_ID]
    script = _reply(tok, "t\n", [THINK_END_ID], "\n\n", good, "\n", bad, "\n", good)
    deltas, r = _run(text_layer, script)
    _check_stream(deltas, r)
    assert _openai(r) == [("get_weather", {"city": "Lima"})] * 2
    assert [c["index"] for c in r.tool_calls] == [0, 1]
    assert [(c["index"], c["reason"]) for c in r.invalid_tool_calls] == [(1, "malformed")]
    assert "<functio=get_weather>" in r.invalid_tool_calls[0]["raw"]
    assert r.finish_reason == "tool_calls"  # the reply still ends with a good call
    want = parse(r.ids, tok, TOOLS, reasoning=True)
    assert [(i.index, i.reason) for i in want.invalid_calls] == [(1, "malformed")]


def test_unterminated_call_and_trailing_text_are_not_tool_calls_finish(text_layer):
    tok, _ = text_layer
    script = _reply(tok, "t\n", [THINK_END_ID], "\n\n", _call(tok, "get_weather", [("city", "Lima")]),
                    "\nDone, it is sunny.")
    _, r = _run(text_layer, script)
    assert r.finish_reason == "stop" and len(r.tool_calls) == 1 and r.content.endswith("Done, it is sunny.")
    script = _reply(tok, "t\n", [THINK_END_ID], "\n\n", [TOOL_CALL_ID], "\n<function=get_weather>\n<parameter=ci")
    deltas, r = _run(text_layer, script)
    _check_stream(deltas, r)
    assert r.tool_calls == [] and [c["reason"] for c in r.invalid_tool_calls] == ["unterminated"]
    assert r.finish_reason == "stop"


def test_value_warning_keeps_the_call(text_layer):
    tok, _ = text_layer
    script = _reply(tok, "t\n", [THINK_END_ID], "\n\n", _call(tok, "get_weather", [("city", "Rome"), ("days", "x")]))
    _, r = _run(text_layer, script)
    assert _openai(r) == [("get_weather", {"city": "Rome", "days": "x"})]
    assert r.tool_call_warnings and "days" in r.tool_call_warnings[0]["warnings"][0]


def test_tool_choice_none_leaves_calls_in_content(text_layer):
    tok, _ = text_layer
    call = _call(tok, "get_weather", [("city", "Oslo")])
    script = _reply(tok, "t\n", [THINK_END_ID], "\n\n", call)
    _, r = _run(text_layer, script, tool_choice="none")
    assert r.tool_calls == [] and r.finish_reason == "stop"
    assert r.content == "\n\n" + tok.decode(call) and "<function=get_weather>" in r.content
    _, r2 = _run(text_layer, script, tools=None)  # no tools: the same
    assert r2.tool_calls == [] and r2.content == r.content


def test_marker_text_spelled_with_ordinary_tokens_is_content(text_layer):
    tok, _ = text_layer
    # "</think>" and "<tool_call>" as ordinary tokens: no reasoning end, no call
    spelled = tok.encode_text("x </think> y <tool_call>\n<function=get_weather>\n</function>\n</tool_call>")
    assert THINK_END_ID not in spelled and TOOL_CALL_ID not in spelled
    _, r = _run(text_layer, spelled)
    assert r.tool_calls == [] and r.reasoning_content == tok.decode(spelled) and r.content == ""


def test_thinking_off_has_no_reasoning(text_layer):
    tok, _ = text_layer
    script = _reply(tok, "Sure.", _call(tok, "get_weather", [("city", "Oslo")]))
    _, r = _run(text_layer, script, enable_thinking=False)
    assert r.reasoning_content is None and r.content == "Sure." and len(r.tool_calls) == 1


def test_stop_string_cuts_content_as_text(text_layer):
    tok, _ = text_layer
    script = _reply(tok, "t\n", [THINK_END_ID], "\n\nThe answer is 4. END and more")
    deltas, r = _run(text_layer, script, stop=["END"])
    _check_stream(deltas, r)
    assert r.finish_detail == "stop_string" and r.content == "\n\nThe answer is 4. " and r.text.endswith("4. ")


@pytest.mark.parametrize("reasoning", [True, False])
def test_reply_parser_equals_one_shot_parse_per_id(text_layer, reasoning):
    tok, _ = text_layer
    ids = _reply(tok, "why\n", [THINK_END_ID], "\n\nok ", _call(tok, "get_weather", [("city", "A b")]), " tail",
                 [TOOL_CALL_ID], "\n<function=get_weather>\n", [IM_END_ID])
    p = ReplyParser(tok, reasoning=reasoning, tools=TOOLS)
    for t in ids:
        p.feed(t)
    p.finish()
    want = parse(ids, tok, TOOLS, reasoning=reasoning)
    assert p.reasoning_content == want.reasoning and p.content == want.content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in p.tool_calls] == \
        [(c.name, c.arguments) for c in want.tool_calls]
    assert [(c["index"], c["reason"], c["raw"]) for c in p.invalid_tool_calls] == \
        [(c.index, c.reason, c.raw) for c in want.invalid_calls]


def test_custom_stop_ids_past_im_end(text_layer):
    tok, _ = text_layer
    script = _reply(tok, "t\n", [THINK_END_ID], "\n\nok", [IM_END_ID], "more")
    eng = hash_engine(text_layer, capacity=1024)
    drain(eng.chat(MSGS, tools=TOOLS, tool_grammar=False, max_new_tokens=1))
    n_prefill = sum(c[0] == "prefill" for c in eng.executor.calls)
    eng.executor.script = [0] * (n_prefill - 1) + script
    _, r = drain(eng.chat(MSGS, tools=TOOLS, tool_grammar=False, max_new_tokens=len(script), stop_ids=[5]))
    assert r.ids == script and r.finish_reason == "length"
    assert r.content == "\n\nok"  # the parse ended at <|im_end|>
