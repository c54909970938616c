"""GDN chunked prefill anchored at the sequence start: a prompt processed in two calls, the second re-run from
the last 64-aligned checkpoint, gives the same bits as one pass (article Part 5.4; docs/INTERFACES.md §2)."""
import numpy as np
import pytest

from assembler.ref.model import ReferenceModel


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    from loader.checkpoint import Checkpoint
    return ReferenceModel(Checkpoint.open(tiny_ckpt))


def _state_bits(st):
    return ({i: a.view(np.uint16).copy() for i, a in st.conv.items()},
            {i: a.view(np.uint32).copy() for i, a in st.rec.items()})


def _same(a, b):
    return all(np.array_equal(a[0][i], b[0][i]) for i in a[0]) and all(np.array_equal(a[1][i], b[1][i]) for i in a[1])


@pytest.mark.parametrize("first,second", [(300, 200), (130, 3)])
def test_two_calls_from_checkpoint_equal_one_pass(model, first, second):
    rng = np.random.default_rng(first * 1000 + second)
    ids = rng.integers(0, 248000, first + second)
    one = model.new_state(first + second + 8)
    lg_one = model.prefill(one, ids, logit_rows=np.arange(first, first + second))
    two = model.new_state(first + second + 8)
    model.prefill(two, ids[:first], logit_rows="none")
    ck = two.restore_checkpoint()
    assert ck == (first // 64) * 64
    lg_two = model.prefill(two, ids[ck:], logit_rows=np.arange(first - ck, first - ck + second))
    assert two.pos == one.pos == first + second
    assert _same(_state_bits(one), _state_bits(two)), "GDN state differs from the single pass"
    assert np.array_equal(lg_one.view(np.uint16), lg_two.view(np.uint16))
    for i in one.k:                                                       # KV of every position identical
        assert np.array_equal(one.k[i][:one.pos].view(np.uint16), two.k[i][:two.pos].view(np.uint16))


def test_unanchored_append_differs(model):
    """Negative control: appending without re-running from the checkpoint moves the chunk boundaries."""
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 248000, 200)
    one = model.new_state(208)
    model.prefill(one, ids, logit_rows="none")
    two = model.new_state(208)
    model.prefill(two, ids[:100], logit_rows="none")
    model.prefill(two, ids[100:], logit_rows="none")                     # chunks anchored at 100, not 64
    assert not _same(_state_bits(one), _state_bits(two))
    for i in one.rec:                                                     # same math, other rounding
        assert np.abs(one.rec[i] - two.rec[i]).max() < 5e-2 * np.abs(one.rec[i]).max()
