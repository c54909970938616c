"""The server's session pool parks evicted sessions in host memory (``host.server.pool.SessionPool``), with the
trained small model on the cpu executor and one engine slot, so every other conversation evicts the last one.

Through the ``openai`` client: two conversations alternating on a one-slot server report cached prompt tokens
(their state came back from host memory) and answer as a fresh engine given the whole conversation. On the pool
directly: the budget closes the least recently used parked session, a budget of 0 never parks (the next turn
re-runs its prompt from scratch), and a parked session too costly to move back is closed, not parked. On the
command line: ``--park-memory GIB`` reaches the pool in bytes (absent: the pool's default), a negative one is a
usage error.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from host.engine import Engine  # noqa: E402
from host.server.app import create_app  # noqa: E402
from tests.helpers import serving  # noqa: E402
from host.server.pool import SessionPool  # noqa: E402
from host.session import render_turn  # noqa: E402

NAME = "tiny-trained"
SYSTEM = {"role": "system", "content": "You are a coding assistant. Answer briefly."}


@pytest.fixture(scope="module")
def served():
    eng = Engine.load(capacity=512, slots=1, quiet=True)
    app = create_app(eng, served_model_name=NAME, max_queue=8, park_memory=1 << 30)
    with serving(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def fresh():
    """An engine never shared: the reference a request must equal."""
    return Engine.load(capacity=512, slots=1, quiet=True)


@pytest.fixture(scope="module")
def local():
    """A one-slot engine for the pool's own tests (no server)."""
    return Engine.load(capacity=512, slots=1, quiet=True)


def trimmed(r) -> tuple[str, str]:
    """(reasoning, content) of a fresh engine's result as the server presents them (framing newlines dropped)."""
    return (r.reasoning_content or "").strip("\n"), r.content.lstrip("\n")


def test_two_alternating_conversations_on_one_slot_come_back_from_host_memory(served, fresh):
    def ask(msgs):
        return served.client.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=10)

    convs = [[SYSTEM, {"role": "user", "content": "def fibonacci(n):"}],
             [SYSTEM, {"role": "user", "content": "import os\nprint(os.listdir())"}]]
    for c in convs:  # the second evicts the first: parked
        m = ask(c).choices[0].message
        c += [{"role": "assistant", "content": m.content, "reasoning_content": m.reasoning_content},
              {"role": "user", "content": "Explain it in one line."}]
    pool = served.srv.worker.pool
    assert pool.counts["parked"] >= 1 and len(pool.parked) == 1
    for c in convs:  # each follow-up unparks its conversation (and parks the other)
        r = ask(c)
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < r.usage.prompt_tokens, "the follow-up reuses the parked history"
        ref = fresh.chat(c, max_new_tokens=10).result()
        assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == trimmed(ref)
    assert pool.counts["unparked"] >= 2 and pool.counts["closed"] == 0


def _turn(pool: SessionPool, engine, content: str):
    """One request through the pool as the server's worker runs it: (result, the session)."""
    prompt, marks = render_turn(engine, [SYSTEM, {"role": "user", "content": content}], None, True)
    s = pool.acquire(prompt)
    r = s.generate(prompt, max_new_tokens=3, reasoning=True, checkpoint_at=[*marks, len(prompt)]).result()
    pool.observe(r.timings)
    return r, s


def test_the_budget_closes_the_least_recently_used_parked_session(local):
    pool = SessionPool(local, park_memory=1 << 30)
    _turn(pool, local, "def a(x):")
    _turn(pool, local, "def b(x):")  # a parked
    (a,) = pool.parked.values()
    one = a.parked.nbytes
    pool.park_memory = one + one // 2  # room for one parked session, not two
    _turn(pool, local, "def c(x):")  # b parked: over the budget, so a (parked longer ago) is closed
    assert pool.counts["dropped"] == 1 and a.closed and len(pool.parked) == 1
    assert pool.parked_bytes == next(iter(pool.parked.values())).parked.nbytes <= pool.park_memory
    r, _ = _turn(pool, local, "def b(x):")  # b comes back from host memory: the same prompt runs nothing
    assert r.timings.reused_tokens == r.timings.prompt_tokens
    r, _ = _turn(pool, local, "def a(x):")  # a was dropped: from scratch
    assert r.timings.reused_tokens == 0
    pool.close()


def test_a_budget_of_zero_never_parks_and_re_prefills(local, fresh):
    pool = SessionPool(local, park_memory=0)
    _turn(pool, local, "def a(x):")
    _turn(pool, local, "def b(x):")
    r, _ = _turn(pool, local, "def a(x):")
    assert pool.counts["parked"] == 0 and pool.counts["closed"] == 2 and not pool.parked
    assert r.timings.reused_tokens == 0 and r.timings.prefilled_tokens == r.timings.prompt_tokens
    ref = fresh.generate(r.prompt_ids, max_new_tokens=3, reasoning=True).result()
    assert r.ids == ref.ids
    pool.close()


def test_a_session_cheaper_to_re_prefill_is_closed_not_parked(local, monkeypatch):
    pool = SessionPool(local, park_memory=1 << 30)
    _turn(pool, local, "def a(x):")
    monkeypatch.setattr(local.executor, "transfer_rate", 1.0)  # 1 byte/s: moving any state back costs more
    _turn(pool, local, "def b(x):")
    assert pool.counts["parked"] == 0 and pool.counts["closed"] == 1
    monkeypatch.undo()
    _turn(pool, local, "def c(x):")  # at the executor's rate parking pays again
    assert pool.counts["parked"] == 1
    pool.close()


@pytest.mark.parametrize("args, want", [([], None), (["--park-memory", "0"], 0),
                                        (["--park-memory", "0.5"], 1 << 29)])
def test_park_memory_flag_reaches_the_pool_in_bytes(monkeypatch, args, want):
    from click.testing import CliRunner

    import host.commands.serve as serve
    import host.engine
    import host.server.app
    from host.cli import main

    seen = {}
    monkeypatch.setattr(host.engine.Engine, "load", classmethod(lambda cls, *a, **kw: SimpleNamespace()))
    monkeypatch.setattr(host.server.app, "create_app", lambda eng, **kw: seen.update(kw) or SimpleNamespace())
    monkeypatch.setattr(serve, "serve_app", lambda app, sock, **kw: sock.close())
    r = CliRunner().invoke(main, ["serve", "--port", "0", *args])
    assert r.exit_code == 0, r.output
    assert seen["park_memory"] == want


def test_a_negative_park_memory_is_a_usage_error():
    from click.testing import CliRunner

    from host.cli import main

    r = CliRunner().invoke(main, ["serve", "--port", "0", "--park-memory", "-1"])
    assert r.exit_code == 2 and "--park-memory" in r.output
