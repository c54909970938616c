"""Shared CPU-test fixtures.

``tiny_ckpt``: path of the tiny synthetic checkpoint (seed 0, with tokenizer files), written once and cached
under ``$QWEN_MK_CACHE/ckpt-tiny-seed0`` (``tests/conftest.py`` points it at the system temporary directory),
rewritten when the generator's sources change (``loader.synthetic.ensure_checkpoint``). Treat it as read-only: copy it before planting faults.
"""
from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt():
    if importlib.util.find_spec("loader.tokenizer") is None:
        pytest.skip("loader.tokenizer is not in this tree yet: the tiny checkpoint needs its tokenizer files")
    from loader.synthetic import ensure_checkpoint
    return ensure_checkpoint("tiny", seed=0)
