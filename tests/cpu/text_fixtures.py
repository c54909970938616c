"""Shared objects for the text-layer tests: one built tokenizer per process (building the tokenizer.json takes ~6 s
the first time, loading it ~2.5 s), variants for negative controls, and id sequences with non-canonical spellings."""
from __future__ import annotations

import json
import random
from functools import lru_cache

import pytest

from loader.config import ModelConfig
from loader.tokenizer import Tokenizer, cached_tokenizer_json

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


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    return get_tokenizer()


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
