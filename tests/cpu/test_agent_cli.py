"""The agent flags of ``qwen-mk generate`` / ``chat`` (--tools, --tool-choice, --no-tool-grammar,
--response-format, --json-schema, --regex): real tool calls of the trained model in --json and text mode, a chat
turn answered with /tool, and every bad flag value refused with exit 2 and the flag named before the model
loads."""
from __future__ import annotations

import json
import re

import pytest

from tests.helpers import CALC, WEATHER, run


@pytest.fixture
def tools_file(tmp_path):
    p = tmp_path / "tools.json"
    p.write_text(json.dumps([WEATHER, CALC]))
    return str(p)


def test_generate_tool_call_json_and_text(tools_file):
    r = run(["generate", "--executor", "cpu", "--tools", tools_file, "--max-new-tokens", "80", "--json",
             "What is the weather in Oslo?"])
    assert r.exit_code == 0, r.output + str(r.exception)
    d = json.loads(r.stdout)
    assert d["finish_reason"] == "tool_calls" and d["invalid_tool_calls"] == []
    (c,) = d["tool_calls"]
    assert c["type"] == "function" and c["function"]["name"] == "get_weather"
    assert json.loads(c["function"]["arguments"])["city"] == "Oslo"
    assert d["reasoning_content"] and d["grammar"]["kind"] == "tool_call"
    r = run(["generate", "--executor", "cpu", "--tools", tools_file, "--tool-choice", "calculator",
             "--max-new-tokens", "80", "def fibonacci(n):"])
    assert r.exit_code == 0, r.output
    assert re.search(r"\[tool call 0: calculator \{\"expression\": ", r.stderr), r.stderr
    assert "finish tool_calls (eos)" in r.stderr


def test_chat_tool_round_trip(tools_file):
    r = run(["chat", "--executor", "cpu", "--tools", tools_file, "--max-new-tokens", "80"],
            input='What is the weather in Oslo?\n/tool {"temperature": 3, "conditions": "snow"}\n/exit\n')
    assert r.exit_code == 0, r.output + str(r.exception)
    assert "[tool call 0: get_weather" in r.stderr and r.stderr.count("[prefill") == 2, r.stderr
    turn2 = r.stderr.split("[prefill")[2]
    assert "reused" in turn2  # the tool result appended to the kept session


def test_regex_and_json_schema_flags(fake_engine, tmp_path):
    r = run(["generate", "--regex", "[0-9]+", "--no-think", "--max-new-tokens", "6", "--json", "n ="])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["content"].isdigit() and d["grammar"]["kind"] == "regex"
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"x": {"type": "bogus"}}}))
    r = run(["generate", "--json-schema", str(schema), "hi"])
    assert r.exit_code == 2 and "response_format: xgrammar rejects the JSON schema" in r.stderr, r.stderr


@pytest.mark.parametrize("content, extra, flag", [
    ("[{", [], "--tools"),                                   # not valid JSON
    ('{"name": "f"}', [], "--tools"),                        # not a list of tools
    (json.dumps([WEATHER]), ["--tool-choice", "nope"], "--tool-choice"),
    (json.dumps([WEATHER]), ["--regex", "a", "--response-format", "json_object"], "--regex"),
])
def test_bad_flags_exit_2_before_loading(fake_engine, tmp_path, content, extra, flag):
    p = tmp_path / "tools.json"
    p.write_text(content)
    for cmd in ("generate", "chat"):
        r = run([cmd, "--tools", str(p), *extra, "hi"] if cmd == "generate" else [cmd, "--tools", str(p), *extra],
                input="hi\n")
        assert r.exit_code == 2, (cmd, r.output)
        assert r.stderr.startswith("qwen-mk: error: ") and flag in r.stderr, r.stderr
    assert fake_engine == []  # refused before any model was loaded


def test_bad_tool_choice_names_the_flag_once(fake_engine, tmp_path):
    p = tmp_path / "tools.json"
    p.write_text(json.dumps([WEATHER]))
    r = run(["generate", "--tools", str(p), "--tool-choice", "nope", "hi"])
    assert r.exit_code == 2
    assert r.stderr.startswith("qwen-mk: error: --tool-choice: function 'nope' is not among the tools"), r.stderr
    assert "tool_choice:" not in r.stderr


def test_json_schema_file_not_json(fake_engine, tmp_path):
    p = tmp_path / "s.json"
    p.write_text("{'single': 'quotes'}")
    r = run(["generate", "--json-schema", str(p), "hi"])
    assert r.exit_code == 2 and "--json-schema" in r.stderr and "not valid JSON" in r.stderr
    r = run(["generate", "--tools", str(tmp_path / "missing.json"), "hi"])
    assert r.exit_code == 2 and "--tools" in r.stderr and "cannot read" in r.stderr
    assert fake_engine == []
