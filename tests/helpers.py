"""Helpers shared by the CPU tests (fixtures built on them live in ``tests/cpu/conftest.py``; the GPU tests' shared
pieces are in ``tests/gpu/helpers.py``, the tolerance policy in ``tests/tolerance.py``).

* the CLI in this process: :func:`run` (click's runner, stdout and stderr apart);
* the scripted executor: :class:`HashExecutor`, an engine on it (:func:`hash_engine`) and :func:`drain`;
* the text layer: one built tokenizer per process (building the tokenizer.json takes ~6 s the first time, loading
  it ~2.5 s), variants for negative controls, and id sequences with non-canonical spellings;
* scratch checkpoint directories over the cached tiny checkpoint (:func:`checkpoint_dir`);
* a ``create_app`` app served on a loopback port in a thread, with an ``openai`` client (:func:`serving`);
* :class:`FakeStream`, a CUDA stream stand-in for the NumPy-backed ``cupy`` fakes.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import threading
from contextlib import contextmanager
from functools import lru_cache
from types import SimpleNamespace

import numpy as np
from click.testing import CliRunner

from host.cli import main
from host.engine import Engine
from host.executors import Executor, StepOutput
from loader.checkpoint import INDEX_FILE
from loader.config import FIRST_PADDING_ID, PRESETS, ModelConfig
from loader.tokenizer import Tokenizer, cached_tokenizer_json

V = PRESETS["tiny"].vocab_size

# Two OpenAI tools (the agent tests' calls and grammars).
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city"]}}}
CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}

# Qwen2/Qwen3 split regex (no \p{M}): the negative control for the Qwen3.5 regex.
QWEN3_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                     r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@lru_cache(maxsize=1)
def get_tokenizer() -> Tokenizer:
    """The synthetic-checkpoint tokenizer, built/loaded once per process."""
    return Tokenizer.synthetic()


@lru_cache(maxsize=4)
def variant_tokenizer(split_regex: str | None = None, ignore_merges: bool = True) -> Tokenizer:
    """The same tokenizer.json with the split regex or ``ignore_merges`` changed (negative controls)."""
    from tokenizers import Tokenizer as HFTokenizer
    d = json.loads(cached_tokenizer_json().read_text(encoding="utf-8"))
    d["model"]["ignore_merges"] = ignore_merges
    if split_regex is not None:
        d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = split_regex
    return Tokenizer(HFTokenizer.from_str(json.dumps(d)), ModelConfig.vocab_size, "variant tokenizer.json")


@lru_cache(maxsize=1)
def byte_ids() -> dict[int, int]:
    """Byte value → id of its single-byte token."""
    vb = get_tokenizer().vocab_bytes()
    out = {vb[i][0]: i for i in range(len(vb)) if len(vb[i]) == 1}
    assert len(out) == 256
    return out


def spell(tok: Tokenizer, text: str, mode: str) -> list[int]:
    """Ids for ``text`` (added tokens become their ids in every mode). ``canonical``: ``encode``; ``chars``: each
    character encoded alone; ``bytes``: one single-byte token per UTF-8 byte (both non-canonical, as a model may
    generate them)."""
    if mode == "canonical":
        return tok.encode(text)
    import re
    from loader.tokenizer import ADDED_TOKENS
    pat = "(" + "|".join(re.escape(t) for t, _ in ADDED_TOKENS) + ")"
    ids: list[int] = []
    for k, part in enumerate(re.split(pat, text)):
        if k % 2:
            ids.append(tok.token_id(part))
        elif mode == "chars":
            ids += [i for ch in part for i in tok.encode(ch)]
        else:
            ids += [byte_ids()[b] for b in part.encode("utf-8")]
    return ids


def chunkings(n: int, rng: random.Random) -> list[list[int]]:
    """Chunk sizes covering ``n`` ids: all ones, all twos, all threes, all at once, and a random mix."""
    out = [[1] * n, [2] * (n // 2 + 1), [3] * (n // 3 + 1), [max(n, 1)]]
    mix = []
    while sum(mix) < n:
        mix.append(rng.randint(1, 9))
    return out + [mix]


# ---------------------------------------------------------------------------------------------- the CLI
class FakeStream:
    """A CuPy stream stand-in: a context manager whose ``synchronize`` does nothing (``ptr`` 0)."""
    ptr = 0

    def __init__(self, non_blocking=False):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


def run(args, input=None):
    """The CLI in this process (click's runner: stdout and stderr apart)."""
    return CliRunner().invoke(main, args, input=input)


# ---------------------------------------------------------------------------------------------- scripted executor
class HashExecutor(Executor):
    """Test double whose state is a hash of the whole token history, so any bookkeeping slip in the session
    (a token dropped, run twice, or a wrong rewind) changes every later output. Each output puts the largest
    logit on a padding id (the loop must mask it) and the next largest on ``script[k]`` (k-th output since
    reset) or on a history-dependent ordinary id. ``interrupt_at`` raises KeyboardInterrupt in that step call
    after scrambling the state, like a Ctrl-C in the middle of a real step."""

    name, detail = "hash", "test double"

    def __init__(self, capacity=512, slots=2, script=None):
        self.capacity, self.slots, self.script = capacity, slots, list(script or [])
        self._st, self._cur, self.calls, self.interrupt_at = [None] * slots, 0, [], None

    def reset(self, slot=0):
        self._st[slot] = [0, 14695981039346656037, 0]              # position, history hash, outputs
        self._cur = slot

    def select(self, slot):
        self._cur = slot

    @property
    def position(self):
        return self._st[self._cur][0]

    def _feed(self, ids):
        st = self._st[self._cur]
        for t in ids:
            assert st[0] < self.capacity, "ran past capacity"
            st[1] = ((st[1] ^ int(t)) * 1099511628211) % (1 << 64)
            st[0] += 1

    def _out(self):
        st = self._st[self._cur]
        k, st[2] = st[2], st[2] + 1
        tok = self.script[k] if k < len(self.script) else 1000 + st[1] % 100000
        logits = np.full(V, -20.0, np.float32)
        logits[tok] = 10.0
        logits[FIRST_PADDING_ID + st[1] % (V - FIRST_PADDING_ID)] = 50.0
        return StepOutput(logits=logits)

    def prefill(self, ids):
        assert len(ids) > 0
        self.calls.append(("prefill", self.position, len(ids)))
        self._feed(ids)
        return self._out()

    def step(self, token):
        self.calls.append(("step", self.position, 1))
        if self.interrupt_at is not None and len([c for c in self.calls if c[0] == "step"]) == self.interrupt_at:
            self._st[self._cur][1] ^= 0xDEAD
            raise KeyboardInterrupt
        self._feed([token])
        return self._out()

    def state_snapshot(self):
        return tuple(self._st[self._cur])

    def state_restore(self, snap):
        self._st[self._cur] = list(snap)


def hash_engine(text_layer, **kw) -> Engine:
    """The tiny preset's engine on a :class:`HashExecutor` (``kw``: its arguments), with the real text layer."""
    tok, tmpl = text_layer
    return Engine(PRESETS["tiny"], None, None, tok, tmpl, HashExecutor(**kw))


def drain(g):
    """(every delta of the generation ``g``, its result)."""
    deltas = list(g)
    return deltas, g.result()


# ---------------------------------------------------------------------------------------------- scratch checkpoints
SHARD = "model-00001-of-00001.safetensors"  # the cached tiny checkpoint's one shard (with an index)


def checkpoint_dir(tiny_ckpt, d, config=None, shards=(SHARD,), index=True):
    """A checkpoint directory ``d``: config.json (``config`` or the tiny one), the tiny shard symlinked under
    each name of ``shards``, and the tiny index when ``index``."""
    d.mkdir()
    cj = config if config is not None else json.loads((tiny_ckpt / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cj))
    for s in shards:
        os.symlink(tiny_ckpt / SHARD, d / s)
    if index:
        shutil.copy(tiny_ckpt / INDEX_FILE, d / INDEX_FILE)
    return d


def tiny_config_json(tiny_ckpt) -> dict:
    """The cached tiny checkpoint's config.json, parsed (a fresh dict to edit)."""
    return json.loads((tiny_ckpt / "config.json").read_text())


@contextmanager
def serving(app):
    """Serve ``app`` (``host.server.app.create_app``) on a free 127.0.0.1 port in a daemon thread (the server tests'
    module fixtures). Yields a namespace: ``url`` (``http://127.0.0.1:PORT``), ``srv`` (``app.state.server``),
    ``client`` (an ``openai.OpenAI`` on ``url/v1``, no retries, 120 s timeout); then asks uvicorn to exit and
    asserts the thread ended. fastapi, uvicorn and openai are imported here: the callers skip without them."""
    import openai

    from host.commands.serve import bind, serve_app
    sock = bind("127.0.0.1", 0)
    ready = threading.Event()
    t = threading.Thread(target=serve_app, args=(app, sock), daemon=True,
                         kwargs=dict(drain_timeout=5, on_ready=lambda h, p: ready.set()))
    t.start()
    assert ready.wait(120), "the server did not start"
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield SimpleNamespace(url=url, srv=app.state.server,
                              client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120))
    finally:
        app.state.uvicorn.should_exit = True
        t.join(30)
    assert not t.is_alive()
