"""``qwen-mk serve`` through the real ``openai`` client, on loopback, with the trained small model (cpu executor).

One server per module (uvicorn in a thread on a free port, ``host.commands.serve.serve_app``) and one fresh
engine as the reference: the server's answers must equal what a fresh engine gives the same request alone
(greedy), whatever the server reused or ran concurrently.
"""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from host.engine import Engine  # noqa: E402
from host.server.app import create_app  # noqa: E402
from tests.helpers import serving  # noqa: E402

NAME = "tiny-trained"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def served():
    eng = Engine.load(capacity=512, slots=4, quiet=True)
    app = create_app(eng, served_model_name=NAME, max_queue=64)
    with serving(app) as srv:
        srv.engine = eng
        yield srv


@pytest.fixture(scope="module")
def fresh():
    """A second engine, never shared: the reference a request must equal."""
    return Engine.load(capacity=512, slots=1, quiet=True)


def post(url: str, body, headers=None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a raw POST; ``body`` bytes are sent as they are."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as f:
            return f.status, json.loads(f.read()), dict(f.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def chat(s, messages, **kw):
    return s.client.chat.completions.create(model=NAME, messages=messages, temperature=0, **kw)


def trimmed(r) -> tuple[str, str]:
    """(reasoning, content) of a fresh engine's result as the server presents them (framing newlines dropped)."""
    return (r.reasoning_content or "").strip("\n"), r.content.lstrip("\n")


def test_models_and_health(served):
    assert [m.id for m in served.client.models.list().data] == [NAME]
    with urllib.request.urlopen(served.url + "/health") as f:
        assert json.loads(f.read())["status"] == "ok"


def test_chat_whole_and_streamed_agree_with_a_fresh_engine(served, fresh):
    msgs = [{"role": "user", "content": "def fibonacci(n):"}]
    r = chat(served, msgs, max_tokens=24)
    m = r.choices[0].message
    ref = fresh.chat(msgs, max_new_tokens=24).result()
    assert (m.reasoning_content, m.content) == trimmed(ref) and m.content
    assert r.choices[0].finish_reason == ref.finish_reason == "length"
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(ref.prompt_ids)
    reasoning, content, finish, usage = "", "", None, None
    for ch in chat(served, msgs, max_tokens=24, stream=True, stream_options={"include_usage": True}):
        if not ch.choices:
            usage = ch.usage
            continue
        d = ch.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        finish = ch.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == (m.reasoning_content, m.content, "length")
    assert usage.completion_tokens == 24 and usage.prompt_tokens == r.usage.prompt_tokens


def test_logprobs(served):
    r = chat(served, [{"role": "user", "content": "import os"}], max_tokens=6, logprobs=True, top_logprobs=3)
    items = r.choices[0].logprobs.content
    assert len(items) == r.usage.completion_tokens == 6
    for it in items:
        tops = [t.logprob for t in it.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert it.token == it.top_logprobs[0].token and it.logprob == tops[0]  # greedy takes the most likely
        assert bytes(it.bytes).decode("utf-8", "replace") == it.token
    c = served.client.completions.create(model=NAME, prompt="import os\n", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == c.choices[0].text and lp.text_offset[0] == 0


def test_prefix_reuse_reports_cached_tokens_and_equals_a_fresh_engine(served, fresh):
    msgs = [{"role": "system", "content": "You are a coding assistant. Answer briefly."},
            {"role": "user", "content": "def fibonacci(n):"}]
    m = chat(served, msgs, max_tokens=12).choices[0].message
    msgs2 = msgs + [{"role": "assistant", "content": m.content, "reasoning_content": m.reasoning_content},
                    {"role": "user", "content": "Now write it iteratively."}]
    r2 = chat(served, msgs2, max_tokens=12)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < r2.usage.prompt_tokens
    ref = fresh.chat(msgs2, max_new_tokens=12).result()
    assert (r2.choices[0].message.reasoning_content, r2.choices[0].message.content) == trimmed(ref)
    again = chat(served, msgs2, max_tokens=12)  # the same request once more: the checkpoint at its prompt's end
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    assert again.choices[0].message.content == r2.choices[0].message.content


def test_tool_call_round_trip(served):
    msgs = [{"role": "user", "content": "What's the weather in Paris in celsius?"}]
    r = chat(served, msgs, tools=[WEATHER], max_tokens=80)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id,
              "content": json.dumps({"city": "Paris", "temperature": 21, "unit": "celsius", "conditions": "sunny"})}]
    r2 = chat(served, msgs, tools=[WEATHER], max_tokens=40, extra_body={"chat_template_kwargs":
                                                                       {"enable_thinking": False}})
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    assert "Paris" in r2.choices[0].message.content and "21" in r2.choices[0].message.content
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    streamed = [tc for ch in chat(served, msgs[:1], tools=[WEATHER], max_tokens=80, stream=True)
                for tc in (ch.choices[0].delta.tool_calls or [] if ch.choices else [])]
    assert [(tc.function.name, tc.function.arguments) for tc in streamed] == [(call.function.name,
                                                                               call.function.arguments)]


def test_json_schema_answer_validates(served):
    schema = {"type": "object", "additionalProperties": False, "required": ["module", "name", "summary"],
              "properties": {"module": {"type": "string"}, "name": {"type": "string"}, "summary": {"type": "string"}}}
    r = chat(served, [{"role": "user", "content": "Give me a JSON object with the module, name and summary of "
                                                  "os.path.join."}],
             max_tokens=80, response_format={"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    with pytest.raises(jsonschema.ValidationError):  # the check can fail: the same answer minus a required key
        jsonschema.validate({k: v for k, v in json.loads(r.choices[0].message.content).items() if k != "name"},
                            schema)


def test_sixteen_concurrent_clients_equal_solo_greedy(served, fresh):
    prompts = [fresh.encode(f"def f{i}(x):\n    return x") for i in range(16)]
    solo = [fresh.generate(p, max_new_tokens=8).result().text for p in prompts]

    def one(p):
        return served.client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0).choices[0].text

    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as ex:
        got = list(ex.map(one, prompts))
    assert got == solo
    assert time.monotonic() - t0 < 90


def _open_stream(s, content: str, max_tokens: int):
    st = s.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                          temperature=0, max_tokens=max_tokens, stream=True)
    return st, iter(st)


def _ran(served, prompt: list[int]) -> list[int]:
    """Token counts of the resident sessions whose history starts with ``prompt``."""
    return [len(x.ids) for x in served.srv.worker.pool.sessions.values() if x.ids[:len(prompt)] == prompt]


def _wait(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_queue_full_is_429_with_retry_after(served):
    w = served.srv.worker
    w.max_queue = 1
    try:
        a, ia = _open_stream(served, "def a(x):", 400)
        next(ia)
        _wait(lambda: w.running is not None)
        b, ib = _open_stream(served, "def b(x):", 400)
        next(ib)
        _wait(lambda: w.waiting == 1)
        status, body, headers = post(served.url + "/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": "c"}], "max_tokens": 2})
        assert status == 429 and body["error"]["type"] == "rate_limit_error"
        assert int(headers["retry-after"]) >= 1
        with pytest.raises(openai.RateLimitError):
            chat(served, [{"role": "user", "content": "c"}], max_tokens=2)
        a.close()
        b.close()
    finally:
        w.max_queue = 64
    _wait(lambda: w.running is None and w.waiting == 0)
    assert chat(served, [{"role": "user", "content": "hi"}], max_tokens=2).choices[0].finish_reason == "length"


def test_disconnect_mid_stream_cancels_and_keeps_serving(served, fresh):
    content = "def fibonacci(n): # disconnect"  # greedy runs to 400 tokens here (no EOS) unless cancelled
    prompt = fresh.render_chat([{"role": "user", "content": content}])
    st, it = _open_stream(served, content, 400)
    for _ in range(4):
        next(it)
    st.close()
    w = served.srv.worker
    _wait(lambda: w.running is None)
    ran = _ran(served, prompt)
    assert len(ran) == 1 and ran[0] < len(prompt) + 100, ran  # stopped long before 400 tokens
    r = chat(served, [{"role": "user", "content": content}], max_tokens=8)  # reuses the cut-short session
    ref = fresh.chat([{"role": "user", "content": content}], max_new_tokens=8).result()
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == trimmed(ref)


def test_disconnect_while_waiting_for_a_whole_answer_cancels_it(served, fresh):
    content = "def fibonacci(n): # gone"  # greedy runs to 400 tokens here (no EOS) unless cancelled
    prompt = fresh.render_chat([{"role": "user", "content": content}])
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 400,
                       "temperature": 0}).encode()
    w = served.srv.worker
    with socket.create_connection(("127.0.0.1", int(served.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        _wait(lambda: w.running is not None)
        time.sleep(0.3)
    _wait(lambda: w.running is None)
    ran = _ran(served, prompt)
    assert len(ran) == 1 and ran[0] < len(prompt) + 200, ran  # stopped long before 400 tokens
    assert chat(served, [{"role": "user", "content": "hi"}], max_tokens=2).choices[0].finish_reason == "length"


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 600}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": " ".join(map(str, range(600)))}]}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": "no"}}, 400,
     "chat_template_kwargs.enable_thinking"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
                                                                          "json_schema": {"schema": {"type": "nope"}}}},
     400, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": "no_such_tool"}, 400,
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_chat_request_gets_its_4xx(served, body, status, param):
    got, err, _ = post(served.url + "/v1/chat/completions", body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["param"] == param
    assert "Traceback" not in err["error"]["message"]


USER = [{"role": "user", "content": "x"}]
WORDED = [  # (body, param, words the message holds, words it must not hold)
    ({"messages": USER, "tools": [WEATHER], "tool_choice": "get_weather"}, "tool_choice",
     ["'none'", "'auto'", "'required'"], ["not among"]),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", ["user message needs content"], []),
    ({"messages": [{"role": "user"}]}, "messages[0].content", ["user message needs content"], []),
    ({"messages": USER + [{"role": "assistant", "content": None}]}, "messages[1].content", ["tool_calls"], []),
    ({"messages": USER + [{"role": "system", "content": "late"}]}, "messages",
     ["system message must be the first"], [".json", "/", "cache"]),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature",
     ["temperature", "from 0 to 2", "NaN"], []),
    ({"messages": USER, "temperature": 2.5}, "temperature", ["from 0 to 2", "2.5"], []),
    ({"messages": USER, "tools": [{"name": "get_weather"}]}, "tools[0].function", ["tools[0].function: "],
     ["pydantic", "validation error", "Param"]),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name",
     ["tools[0].function.name: "], ["pydantic"]),
    ({"messages": USER, "tools": [{"type": "tool", "function": {"name": "f"}}]}, "tools[0].type",
     ["tools[0].type: "], ["pydantic"]),
]


@pytest.mark.parametrize("body,param,words,unwanted", WORDED, ids=[f"worded{i}" for i in range(len(WORDED))])
def test_bad_chat_request_message_names_the_field(served, body, param, words, unwanted):
    got, err, _ = post(served.url + "/v1/chat/completions", body)
    msg = err["error"]["message"]
    assert got == 400 and err["error"]["param"] == param, err
    assert all(w in msg for w in words) and not any(w in msg for w in unwanted), msg


def test_null_content_with_tool_calls_is_accepted(served):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    msgs = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": None,
                                                             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 3}'}]
    got, body, _ = post(served.url + "/v1/chat/completions", {"messages": msgs, "tools": [WEATHER], "max_tokens": 1,
                                                               "temperature": 0})
    assert got == 200, body


def test_named_tool_choice_finishes_with_stop_as_vllm(served):
    msgs = [{"role": "user", "content": "What's the weather in Paris in celsius?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(served, msgs, tools=[WEATHER], tool_choice=named, max_tokens=80)
    assert r.choices[0].finish_reason == "stop"
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    finish = [ch.choices[0].finish_reason for ch in chat(served, msgs, tools=[WEATHER], tool_choice=named,
                                                         max_tokens=80, stream=True) if ch.choices]
    assert [f for f in finish if f] == ["stop"]


def test_echo_with_logprobs_is_refused(served):
    got, err, _ = post(served.url + "/v1/completions", {"prompt": "import os", "echo": True, "logprobs": 1})
    assert got == 400 and err["error"]["param"] == "echo" and "prompt tokens' logprobs" in err["error"]["message"]
    c = served.client.completions.create(model=NAME, prompt="import os", max_tokens=2, temperature=0, echo=True)
    assert c.choices[0].text.startswith("import os")


@pytest.mark.parametrize("body,param", [({"prompt": [999999999]}, "prompt"), ({"prompt": ""}, "prompt"),
                                        ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": 3}, "prompt"),
                                        ({"prompt": "x", "max_tokens": 600}, "max_tokens")])
def test_bad_completion_request_gets_400(served, body, param):
    got, err, _ = post(served.url + "/v1/completions", body)
    assert got == 400 and err["error"]["param"] == param, err


def test_api_key(served):
    served.srv.api_key = "sekrit"
    try:
        got, err, _ = post(served.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert got == 401 and err["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            served.client.models.list()
        keyed = openai.OpenAI(base_url=served.url + "/v1", api_key="sekrit", max_retries=0)
        assert [m.id for m in keyed.models.list().data] == [NAME]
    finally:
        served.srv.api_key = None
