"""Streaming detokeniser: whole characters only, at most 3 bytes held, deltas concatenate to decode(all ids)."""
import random
import time

import pytest

from loader.config import FIRST_PADDING_ID
from loader.detok import StreamDetokenizer
from loader.tokenizer import TokenizerError
from tests.helpers import byte_ids, spell

ISSUE_TEXT = "ďábelské 😊 👨\u200d👩\u200d👧\u200d👦 中文 é"


def _stream(tok, ids, chunk=1):
    d, deltas = StreamDetokenizer(tok), []
    for i in range(0, len(ids), chunk):
        deltas.append(d.push_many(ids[i:i + chunk]) if chunk > 1 else d.push(ids[i]))
        assert len(d.pending) <= 3
    return deltas, d.flush()


@pytest.mark.parametrize("mode", ["canonical", "chars", "bytes"])
def test_issue_text_one_id_at_a_time(tok, mode):
    ids = spell(tok, ISSUE_TEXT, mode)
    deltas, tail = _stream(tok, ids)
    assert tail == ""
    assert "".join(deltas) == ISSUE_TEXT == tok.decode(ids)
    for d in deltas:
        d.encode("utf-8")  # each delta is valid UTF-8 (no lone surrogate) ...
        assert "\ufffd" not in d  # ... and no replacement character crept in
    if mode == "bytes":  # the 4-byte emoji: three empty deltas, then the character
        k = ISSUE_TEXT.encode().index("😊".encode())
        assert deltas[k:k + 4] == ["", "", "", "😊"]


def test_naive_per_token_decode_fails_negative_control(tok):
    ids = spell(tok, ISSUE_TEXT, "bytes")
    assert "".join(tok.decode([i]) for i in ids) != ISSUE_TEXT


def test_random_ids_equal_decode_all(tok):
    rng = random.Random(time.time_ns())
    for _ in range(300):
        # ids biased towards single bytes so that split and invalid UTF-8 sequences are common
        ids = [rng.choice((rng.randrange(FIRST_PADDING_ID), rng.choice(list(byte_ids().values()))))
               for _ in range(rng.randint(1, 20))]
        for chunk in (1, 2, 5):
            deltas, tail = _stream(tok, ids, chunk)
            assert "".join(deltas) + tail == tok.decode(ids), (ids, chunk)


def test_literal_replacement_char_is_emitted_at_once(tok):
    ids = spell(tok, "a\ufffdb", "bytes")  # a, EF, BF, BD, b
    deltas, _ = _stream(tok, ids)
    assert deltas == ["a", "", "", "\ufffd", "b"]
    deltas, _ = _stream(tok, tok.encode("x\ufffd"))
    assert "".join(deltas) == "x\ufffd" and deltas[-1].endswith("\ufffd")


def test_flush_emits_incomplete_tail_and_resets(tok):
    d = StreamDetokenizer(tok)
    b = byte_ids()
    assert d.push(b[0xF0]) == "" and d.push(b[0x9F]) == "" and d.pending == b"\xf0\x9f"
    assert d.flush() == "\ufffd" == tok.decode([b[0xF0], b[0x9F]])
    assert d.pending == b"" and d.push(b[0x41]) == "A"


def test_invalid_byte_is_not_held(tok):
    d = StreamDetokenizer(tok)
    b = byte_ids()
    assert d.push(b[0xE2]) == "" and d.push(b[0x41]) == "\ufffdA" and d.pending == b""


def test_padding_id_raises_without_changing_state(tok):
    d = StreamDetokenizer(tok)
    b = byte_ids()
    d.push(b[0xC3])
    with pytest.raises(TokenizerError, match=f"token id {FIRST_PADDING_ID} is a padding row"):
        d.push(FIRST_PADDING_ID)
    assert d.pending == b"\xc3" and d.push(b[0xA9]) == "é"
