"""Chat template: spec §6 rendered examples (byte-exact), the rules behind them, transformers' rendering as the
oracle, clear errors naming the message, and the append-only check of the agent loop."""
import json
import random
import time

import pytest

from loader.chat_template import ChatTemplate, ChatTemplateError, append_only
from loader.tokenizer import write_tokenizer_files

SYS_HI = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Forecast für eine Stadt",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"},
                                                "verbose": {"type": "boolean"}}, "required": ["city"]}}}


def _call(name, args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


def _tool_turns(args):
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "Need tool.", "tool_calls": [_call("get_weather", args)]},
            {"role": "tool", "content": "Sunny"}]


@pytest.fixture(scope="module")
def ct():
    return ChatTemplate.default()


def test_spec_rendered_examples(ct):
    assert ct.render(SYS_HI) == ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                 "<|im_start|>assistant\n<think>\n")
    assert ct.render(SYS_HI, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    out = ct.render(_tool_turns({"city": "Paris", "days": 3, "verbose": True}), add_generation_prompt=False)
    assert out.endswith(
        "<|im_start|>assistant\n<think>\nNeed tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=verbose>\nTrue\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nSunny\n</tool_response><|im_end|>\n")


def test_scalar_and_structured_argument_rendering(ct):
    args = {"b": True, "n": None, "i": 3, "f": 0.5, "m": {"k": [1, "é"]}, "l": [1, {"a": None}], "s": "x  y"}
    out = ct.render(_tool_turns(args), add_generation_prompt=False)
    for name, text in (("b", "True"), ("n", "None"), ("i", "3"), ("f", "0.5"), ("m", '{"k": [1, "é"]}'),
                       ("l", '[1, {"a": null}]'), ("s", "x  y")):
        assert f"<parameter={name}>\n{text}\n</parameter>\n" in out


def test_json_string_arguments_are_decoded(ct):
    args = {"city": "Zürich", "days": 2, "verbose": False}
    as_dict = ct.render(_tool_turns(args))
    assert ct.render(_tool_turns(json.dumps(args))) == as_dict
    empty = ct.render(_tool_turns({}))
    assert ct.render(_tool_turns("")) == empty == ct.render(_tool_turns(None)) == ct.render(_tool_turns("  "))
    with pytest.raises(ChatTemplateError, match=r"message 1 tool_calls\[0\]: arguments is not valid JSON"):
        ct.render(_tool_turns('{"city": "Par'))
    with pytest.raises(ChatTemplateError, match=r"message 1 tool_calls\[0\]: arguments must be a JSON object"):
        ct.render(_tool_turns("[1, 2]"))


def test_reasoning_kept_only_after_last_user_query(ct):
    msgs = [{"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning_content": "old thoughts"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "", "reasoning_content": "new thoughts", "tool_calls": [_call("f", {})]},
            {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}]
    out = ct.render(msgs)
    assert "old thoughts" not in out and "<|im_start|>assistant\nA1<|im_end|>" in out
    assert "<|im_start|>assistant\n<think>\nnew thoughts\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>" in out
    # consecutive tool results share one user turn
    assert "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response><|im_end|>\n" in out
    # reasoning inline in content (<think>…</think>) is split out the same way
    inline = [dict(m) for m in msgs]
    inline[3] = {"role": "assistant", "content": "<think>\nnew thoughts\n</think>\n\n", "tool_calls": [_call("f", {})]}
    assert ct.render(inline) == out


def test_tools_listed_one_json_per_line_then_system(ct):
    other = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}
    out = ct.render(SYS_HI, tools=[WEATHER, other])
    head = "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    assert out.startswith(head + json.dumps(WEATHER, ensure_ascii=False) + "\n" + json.dumps(other) + "\n</tools>")
    assert "Forecast für eine Stadt" in out  # tojson keeps non-ASCII
    assert out.index("</IMPORTANT>\n\nYou are helpful.<|im_end|>\n") > 0


def test_equals_transformers_rendering(ct):
    tu = pytest.importorskip("transformers.utils.chat_template_utils")
    rng = random.Random(time.time_ns())
    convs = [SYS_HI, _tool_turns({"city": "Paris", "days": rng.randint(0, 99), "verbose": True}),
             [{"role": "user", "content": [{"type": "text", "text": "part1 "}, {"type": "text", "text": "part2"}]}]]
    for msgs in convs:
        for tools in (None, [WEATHER]):
            for gen, think in ((True, True), (True, False), (False, True)):
                ours = ct.render(msgs, tools=tools, add_generation_prompt=gen, enable_thinking=think)
                theirs = tu.render_jinja_template([msgs], tools=tools, chat_template=ct.source,
                                                  add_generation_prompt=gen, enable_thinking=think)[0][0]
                assert ours == theirs


@pytest.mark.parametrize("msgs, pattern", [
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "s"}], r"message 1: a system message must be"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"message 1: role must be one of"),
    ([{"role": "user", "content": 5}], r"message 0: content must be a string"),
    ([{"role": "user", "content": [{"type": "image"}]}], r"message 0: only text content parts"),
    ([{"role": "system", "content": "s"}], r"No user query found"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}],
     r"message 1 tool_calls\[0\]: missing function name"),
    ([], r"messages: expected a non-empty list"),
])
def test_errors_name_the_message(ct, msgs, pattern):
    with pytest.raises(ChatTemplateError, match=pattern):
        ct.render(msgs)


def test_template_syntax_error_is_clear():
    with pytest.raises(ChatTemplateError, match="line 1"):
        ChatTemplate("{% if %}")


def test_from_checkpoint(tmp_path, ct):
    write_tokenizer_files(tmp_path)
    loaded = ChatTemplate.from_checkpoint(tmp_path)
    assert loaded.source == ct.source and loaded.render(SYS_HI, tools=[WEATHER]) == ct.render(SYS_HI, tools=[WEATHER])
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}|{{ messages[0].content }}")
    assert ChatTemplate.from_checkpoint(tmp_path).render(SYS_HI) == "<|im_end|>|You are helpful."


def test_append_only_agent_loop(ct, tok):
    rng = random.Random(time.time_ns())
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List files."}]
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}}}}]
    for step in range(3):
        r_k = ct.render(msgs, tools=tools)
        path = rng.choice([".", "src", "/tmp/é"])
        gen = (f"Step {step}: look at {path}.\n</think>\n\n<tool_call>\n<function=ls>\n<parameter=path>\n{path}\n"
               f"</parameter>\n</function>\n</tool_call>")
        msgs = msgs + [{"role": "assistant", "content": "", "reasoning_content": f"Step {step}: look at {path}.",
                        "tool_calls": [_call("ls", {"path": path})]},
                       {"role": "tool", "content": f"a.txt b{rng.randint(0, 9)}.py"}]
        r_k1 = ct.render(msgs, tools=tools)
        assert r_k1.startswith(r_k + gen + "<|im_end|>\n")
        assert append_only(r_k, r_k1, tok) == (True, None)
    # negative control: a new user query drops the earlier reasoning, so the history changes
    r_k = ct.render(msgs, tools=tools)
    r_new = ct.render(msgs + [{"role": "user", "content": "Thanks"}], tools=tools)
    ok, at = append_only(r_k, r_new, tok)
    first_asst = r_k.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    assert not ok and at == len(tok.encode(r_k[:first_asst]))
    assert append_only(r_k, r_k, tok) == (True, None)
    assert append_only(r_k + "x", r_k, tok) == (False, len(tok.encode(r_k)))
