"""The instruction set: word layout = dataclass field order, round trips, the generated C header is fresh."""
import dataclasses

import numpy as np
import pytest

from assembler.isa import (FIELDS, HEADER, MAX_WAITS, WAITS_OFFSET, WORDS, Instruction, Opcode, c_header, sub_parts,
                           sub_word)


def test_header_is_fresh():
    assert HEADER.read_text() == c_header(), "megakernel/include/isa.h is stale: python3 -m assembler.isa --write"


def test_nop_is_zero_and_layout_fits():
    assert Opcode.NOP == 0 and Opcode(0).name == "NOP"
    assert len(FIELDS) <= WAITS_OFFSET and WAITS_OFFSET + 3 * MAX_WAITS == WORDS
    assert np.all(Instruction(Opcode.NOP, row_end=1).words()[WAITS_OFFSET:] == 0)


def test_field_order_is_word_order():
    rng = np.random.default_rng()
    for _ in range(20):
        kw = {f: int(rng.integers(-5, 1 << 20)) for f in FIELDS if f not in ("opcode", "nwaits")}
        waits = tuple(tuple(int(v) for v in rng.integers(0, 1000, 3)) for _ in range(int(rng.integers(0, MAX_WAITS + 1))))
        ins = Instruction(opcode=int(rng.integers(0, len(Opcode))), waits=waits, **kw)
        w = ins.words()
        assert w.dtype == np.int32 and w.shape == (WORDS,)
        for i, f in enumerate(FIELDS):
            assert w[i] == getattr(ins, f), f
        for j, t in enumerate(waits):
            assert tuple(w[WAITS_OFFSET + 3 * j:WAITS_OFFSET + 3 * j + 3]) == t
        assert Instruction.from_words(w) == ins


def test_sub_word_round_trip():
    for pro in ("none", "rmsnorm", "mtp_concat"):
        for epi in ("store", "residual", "swiglu"):
            assert sub_parts(sub_word(pro, epi)) == (pro, epi)


def test_bad_instructions_raise():
    with pytest.raises(ValueError, match="MAX_WAITS"):
        Instruction(Opcode.GEMV, waits=((0, 1, 0),) * (MAX_WAITS + 1))
    with pytest.raises(ValueError):
        Instruction(99)
    with pytest.raises(ValueError, match="words"):
        Instruction.from_words(np.zeros(WORDS - 1, np.int32))
    with pytest.raises(KeyError):
        sub_word("layernorm", "store")


def test_program_words_decode_to_its_lists():
    from assembler.graph import decode_graph
    from assembler.scheduler import schedule
    from loader.config import preset
    p = schedule(decode_graph(preset("tiny"), layer_limit=2), 5)
    w = p.words()
    assert w.shape == (5, max(len(l) for l in p.sm_lists), WORDS)
    for s, lst in enumerate(p.sm_lists):
        assert [Instruction.from_words(x) for x in w[s, :len(lst)]] == lst
        assert np.all(w[s, len(lst):] == 0)  # padded with NOP
    assert p.buffer_table().dtype.itemsize == 32 and p.counter_table()["expected"].tolist() == [c.expected for c in p.counters]
