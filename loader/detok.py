"""Streaming detokeniser: ids in, text deltas out, only whole UTF-8 characters.

A multi-byte character can span tokens (article Part 2.1), so the bytes of an incomplete trailing sequence (at most
3) are held back until the next id completes them or shows them invalid. Invalid bytes become U+FFFD under the same
maximal-subpart rule as ``Tokenizer.decode``, so the concatenated deltas plus ``flush()`` equal ``decode(all ids)``.
A literal U+FFFD in the text is an ordinary 3-byte character and is emitted as soon as its bytes are complete.
"""
from __future__ import annotations

import codecs


class StreamDetokenizer:
    """Incremental decoder over a :class:`loader.tokenizer.Tokenizer`.

    ``push(id) -> str`` (may be ``""``), ``push_many(ids) -> str``, ``flush() -> str`` at stop (pending bytes → U+FFFD,
    then the stream is reset). Padding or out-of-range ids raise ``TokenizerError`` before any state changes.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def pending(self) -> bytes:
        """Bytes held back (a proper prefix of one UTF-8 character; length 0..3)."""
        return self._dec.getstate()[0]

    def push(self, token_id: int) -> str:
        """Feed one id; returns the newly completed text."""
        return self._dec.decode(self.tokenizer.token_bytes(token_id))

    def push_many(self, ids) -> str:
        """Feed several ids; returns the newly completed text (same as pushing them one at a time)."""
        data = b"".join(self.tokenizer.token_bytes(i) for i in ids)
        return self._dec.decode(data)

    def flush(self) -> str:
        """End of stream: emit held-back bytes (as U+FFFD: they are an incomplete character) and reset."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out
