"""``qwen-mk serve`` as a process: the ready line, a port in use, SIGTERM / SIGINT draining a stream in flight and
exiting 0 (loopback only, the trained small model on the cpu executor)."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[2]


def start(*args: str) -> tuple[subprocess.Popen, str, int, list[str]]:
    """The server process, its host, port and the stderr lines read so far (kept filling in a thread)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "host.cli", "serve", "--port", "0", "--max-model-len", "512", *args],
                         cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines = []
    for line in p.stderr:
        lines.append(line)
        if m := re.search(r"ready at http://([\d.]+):(\d+)/v1", line):
            threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True).start()
            return p, m.group(1), int(m.group(2)), lines
    raise AssertionError(f"no ready line (exit {p.wait()}): {''.join(lines)}")


def stream_request(host: str, port: int, headers: dict) -> http.client.HTTPResponse:
    c = http.client.HTTPConnection(host, port, timeout=120)
    body = {"messages": [{"role": "user", "content": "def fibonacci(n):"}], "max_tokens": 40, "temperature": 0,
            "stream": True}
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json", **headers})
    r = c.getresponse()
    assert r.status == 200
    return r


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_the_stream_in_flight_and_exits_0(sig):
    p, host, port, lines = start("--served-model-name", "t", "--api-key", "k")
    try:
        auth = {"authorization": "Bearer k"}
        c = http.client.HTTPConnection(host, port, timeout=30)
        c.request("GET", "/v1/models", headers=auth)
        assert [m["id"] for m in json.loads(c.getresponse().read())["data"]] == ["t"]
        r = stream_request(host, port, auth)
        first = r.readline()
        assert first.startswith(b"data: ")
        p.send_signal(sig)
        rest = r.read().decode()
        events = [json.loads(x[6:]) for x in rest.split("\n\n") if x.startswith("data: {")]
        assert rest.rstrip().endswith("data: [DONE]")
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # it ran to its end, all 40 tokens
        assert p.wait(60) == 0
        with pytest.raises(OSError):  # the port is closed
            socket.create_connection((host, port), timeout=5)
    finally:
        if p.poll() is None:
            p.kill()
    err = "".join(lines)
    assert "qwen-mk serve: stopped" in err and "Traceback" not in err, err


def get(host: str, port: int, path: str) -> tuple[int, dict]:
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request("GET", path)
    r = c.getresponse()
    return r.status, json.loads(r.read())


def test_health_is_503_while_draining_and_new_requests_are_refused():
    p, host, port, lines = start()
    try:
        assert get(host, port, "/health")[0] == 200
        c = http.client.HTTPConnection(host, port, timeout=120)
        body = {"messages": [{"role": "user", "content": "def fibonacci(n): # disconnect"}], "max_tokens": 150,
                "temperature": 0, "stream": True}  # greedy runs to max_tokens here (no EOS): seconds of decode
        c.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        r = c.getresponse()
        assert r.readline().startswith(b"data: ")
        p.send_signal(signal.SIGTERM)
        end = time.monotonic() + 10
        while (got := get(host, port, "/health"))[0] == 200:  # the signal handler runs between bytecodes
            assert time.monotonic() < end, "/health never turned 503"
            time.sleep(0.05)
        assert got == (503, {"status": "draining"})
        time.sleep(0.5)  # still listening while the stream runs on (150 tokens take seconds)
        assert get(host, port, "/health") == (503, {"status": "draining"})
        c2 = http.client.HTTPConnection(host, port, timeout=30)
        c2.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 1}),
                   {"content-type": "application/json"})
        r2 = c2.getresponse()
        assert r2.status == 503 and json.loads(r2.read())["error"]["type"] == "service_unavailable"
        rest = r.read().decode()
        events = [json.loads(x[6:]) for x in rest.split("\n\n") if x.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # the stream in flight ran to its end
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.kill()
    err = "".join(lines)
    assert "qwen-mk serve: stopped" in err and "Traceback" not in err, err


def test_port_in_use_is_one_error_line_before_loading():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        p = subprocess.run([sys.executable, "-m", "host.cli", "serve", "--port", str(s.getsockname()[1])], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)
    finally:
        s.close()
    assert p.returncode == 1 and p.stderr.startswith("qwen-mk: error: cannot listen on 127.0.0.1:"), p.stderr
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1
