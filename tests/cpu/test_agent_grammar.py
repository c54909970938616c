"""Grammar-constrained decoding (host/grammar.py) on the trained small model and on a scripted executor.

Each constraint is checked with a negative control: the same prompt with the grammar off gives output that does not
validate (the trained model writes Python for ``def fibonacci(n):`` and answers a weather question with a call), so
a mask that did nothing would fail the test. Also: the mask applies to greedy decoding and to a GPU-style step
output (token chosen on the device, logits on the host), grammars are compiled once per schema, a grammar that
admits nothing ends the turn with finish_reason ``grammar_dead_end``, and bad grammar input is a RequestError
naming the parameter with the session intact."""
import json
import re

import jsonschema
import numpy as np
import pytest

from host.engine import Engine
from host.errors import InvalidArgument, RequestError
from host.executors import StepOutput
from host.sampling import Sampler, SamplingParams
from loader.config import FIRST_PADDING_ID, IM_START_ID
from tests.helpers import CALC, WEATHER, drain, hash_engine

TOOLS = [WEATHER, CALC]
CODE = [{"role": "user", "content": "def fibonacci(n):"}]
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}, "unit": {"type": "string", "maxLength": 8}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def eng():
    return Engine.load(executor="cpu", quiet=True)


def _json_or_none(text):
    try:
        return json.loads(text)
    except ValueError:
        return None


def test_json_object_always_parses_and_off_does_not(eng):
    r_on = eng.chat(CODE, max_new_tokens=48, response_format={"type": "json_object"}).result()
    r_off = eng.chat(CODE, max_new_tokens=48).result()
    assert r_on.finish_reason == "stop", r_on.text        # the grammar ended the object, then only EOS
    assert isinstance(_json_or_none(r_on.content), dict), r_on.content
    assert r_on.reasoning_content is not None and r_on.grammar["kind"] == "json_object"
    assert r_on.grammar["masks"] == len(r_on.ids)          # one mask per generated token, greedy included
    assert _json_or_none(r_off.content) is None, r_off.content  # negative control: Python, not JSON


def test_json_schema_validates(eng):
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    msgs = [{"role": "user", "content": "What is 6 * 7? Reply in JSON."}]
    for m in (msgs, CODE):
        r = eng.chat(m, max_new_tokens=96, response_format=rf).result()
        assert r.finish_reason == "stop", r.text  # a reply cut by max_new_tokens cannot be whole JSON
        jsonschema.validate(json.loads(r.content), ANSWER)
    r_off = eng.chat(CODE, max_new_tokens=40).result()
    with pytest.raises((ValueError, jsonschema.ValidationError)):  # negative control
        jsonschema.validate(json.loads(r_off.content), ANSWER)


def test_regex_thinking_off(eng):
    rf = {"type": "regex", "pattern": r"(yes|no)\. [A-Z][a-z]+"}
    r = eng.chat(CODE, max_new_tokens=20, enable_thinking=False, response_format=rf).result()
    assert r.reasoning_content is None and re.fullmatch(rf["pattern"], r.content), r.content
    r_off = eng.chat(CODE, max_new_tokens=20, enable_thinking=False).result()
    assert not re.fullmatch(rf["pattern"], r_off.content)


def _validate_calls(r, tools):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for c in r.tool_calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), schemas[c["function"]["name"]])


def test_tool_choice_required_and_named(eng):
    r_off = eng.chat(CODE, tools=TOOLS, max_new_tokens=40).result()
    assert r_off.tool_calls == []  # negative control: the model writes code, no call
    r = eng.chat(CODE, tools=TOOLS, tool_choice="required", max_new_tokens=80).result()
    assert r.tool_calls and r.finish_reason == "tool_calls" and r.invalid_tool_calls == [], r.text
    _validate_calls(r, TOOLS)
    weather = [{"role": "user", "content": "What is the weather in Oslo?"}]
    r = eng.chat(weather, tools=TOOLS, tool_choice="calculator", max_new_tokens=80).result()
    assert [c["function"]["name"] for c in r.tool_calls] == ["calculator"], r.text
    _validate_calls(r, TOOLS)
    r = eng.chat(weather, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 max_new_tokens=80).result()
    assert [c["function"]["name"] for c in r.tool_calls] == ["get_weather"]
    _validate_calls(r, TOOLS)


def test_tool_choice_none_with_grammar_emits_no_call(eng):
    weather = [{"role": "user", "content": "What is the weather in Oslo?"}]
    assert eng.chat(weather, tools=TOOLS, max_new_tokens=60).result().tool_calls  # the model calls by itself
    r = eng.chat(weather, tools=TOOLS, tool_choice="none", max_new_tokens=60).result()
    assert r.tool_calls == [] and r.grammar is None


def test_compiled_once_per_schema(eng):
    rf = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"k": {"type": "null"}}}}}
    before = eng.grammars.compiles
    r1 = eng.chat(CODE, max_new_tokens=4, response_format=rf).result()
    r2 = eng.chat(CODE, max_new_tokens=4, response_format=json.loads(json.dumps(rf))).result()
    assert eng.grammars.compiles == before + 1
    assert (r1.grammar["cached"], r2.grammar["cached"]) == (False, True)


def test_mask_applies_to_greedy_on_a_scripted_model(text_layer):
    tok, _ = text_layer
    e = hash_engine(text_layer, capacity=256)  # the top logit is a padding id, the next a letter: never digits
    r = e.generate(tok.encode("n = "), max_new_tokens=12, response_format={"type": "regex", "pattern": "[0-9]+"}).result()
    assert r.text and r.text.isdigit() and len(r.ids) == 12
    r_off = e.generate(tok.encode("n = "), max_new_tokens=12).result()
    assert not r_off.text.isdigit()


def test_mask_on_a_gpu_style_output_uses_the_host_logits():
    logits = np.full(FIRST_PADDING_ID + 5, -1.0, np.float32)
    logits[7], logits[9] = 5.0, 3.0
    out = StepOutput(logits=logits, token=7)          # the device's argmax
    allowed = np.zeros(logits.shape, bool)
    allowed[[9, 11]] = True
    s = Sampler(SamplingParams())
    assert s.choose(out) == 7 and s.choose(out, allowed) == 9
    with pytest.raises(ValueError, match="admits no id"):
        s.choose(out, np.zeros(logits.shape, bool))


def test_dead_end_ends_the_turn_and_keeps_the_session(text_layer):
    tok, _ = text_layer
    e = hash_engine(text_layer, capacity=256)
    dead = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "ok"}, {"type": "token", "token": IM_START_ID}]}}  # a token never admitted
    s = e.new_session()
    deltas, r = drain(s.generate(tok.encode("say ok"), max_new_tokens=10, response_format=dead))
    assert (r.finish_reason, r.finish_detail) == ("grammar_dead_end", "grammar_dead_end")
    assert r.text == "ok" and deltas[-1].finish_reason == "grammar_dead_end"
    r2 = s.generate(tok.encode("say ok again"), max_new_tokens=3).result()  # the session goes on
    assert r2.finish_reason == "length" and len(r2.ids) == 3


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": []}}}}, "response_format"),
    ({"response_format": {"type": "regex", "pattern": "("}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "nope"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]}, "tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "tool_grammar": False}, "tool_grammar"),
])
def test_bad_grammar_input_names_the_param_and_keeps_the_session(text_layer, kw, param):
    tok, _ = text_layer
    e = hash_engine(text_layer, capacity=1024)
    s = e.new_session()
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(RequestError) as ei:
        s.chat(msgs, max_new_tokens=2, **kw)
    assert ei.value.param == param and isinstance(ei.value, InvalidArgument) and ei.value.exit_code == 2
    assert param in str(ei.value)
    assert len(s.chat(msgs, max_new_tokens=2).result().ids) == 2  # nothing ran, nothing broke
