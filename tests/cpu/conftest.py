"""Shared CPU-test fixtures (the helpers they are built on: ``tests/helpers.py``).

``tiny_ckpt``: path of the tiny synthetic checkpoint (seed 0, with tokenizer files), written once and cached
under ``$QWEN_MK_CACHE/ckpt-tiny-seed0`` (``tests/conftest.py`` points it at the system temporary directory),
rewritten when the generator's sources change (``loader.synthetic.ensure_checkpoint``). Treat it as read-only: copy it before planting faults.

``tok``: the synthetic tokenizer (one per process). ``text_layer``: (that tokenizer, the shipped chat template).
``fake_engine``: the CLI's engine loader patched to a scripted-executor engine; the list of engines made.
"""
from __future__ import annotations

import importlib.util

import pytest

from host.engine import Engine
from loader.config import PRESETS
from loader.tokenizer import Tokenizer
from tests.helpers import HashExecutor, get_tokenizer


@pytest.fixture(scope="session")
def tiny_ckpt():
    if importlib.util.find_spec("loader.tokenizer") is None:
        pytest.skip("loader.tokenizer is not in this tree yet: the tiny checkpoint needs its tokenizer files")
    from loader.synthetic import ensure_checkpoint
    return ensure_checkpoint("tiny", seed=0)


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    return get_tokenizer()


@pytest.fixture(scope="module")
def text_layer():
    """The synthetic tokenizer (one per process, shared with the text-layer tests) and the shipped template."""
    from loader.chat_template import ChatTemplate
    return get_tokenizer(), ChatTemplate.default()


@pytest.fixture
def fake_engine(monkeypatch, text_layer):
    """Patch the CLI's engine loader to a scripted-executor engine; returns the list of engines made."""
    made = []

    def load(kw):
        tok, tmpl = text_layer
        e = Engine(PRESETS["tiny"], None, None, tok, tmpl, HashExecutor(capacity=kw["capacity"] or 4096))
        made.append(e)
        return e

    import host.commands.chat as chat
    import host.commands.generate as gen
    monkeypatch.setattr(gen, "load_engine", load)
    monkeypatch.setattr(chat, "load_engine", load)
    return made
