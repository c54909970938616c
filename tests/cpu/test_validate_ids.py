"""``host.session.validate_ids``: a long list of plain ints is checked at once, and whatever that check refuses
goes through the per-id loop, so the error still names the first bad index and what is wrong with it."""
import numpy as np
import pytest

from host.errors import EmptyPrompt, InvalidArgument, InvalidTokenId
from host.session import validate_ids
from loader.config import FIRST_PADDING_ID

V = 248320


def _ids(n=32768):
    return [int(x) for x in np.random.default_rng(0).integers(0, FIRST_PADDING_ID, n)]


def test_valid_lists_come_back_equal_and_as_new_lists():
    ids = _ids()
    for arg in (ids, tuple(ids)):
        out = validate_ids(arg, V)
        assert out == list(ids) and out is not arg and type(out) is list
    assert validate_ids([FIRST_PADDING_ID - 1, 0], V) == [FIRST_PADDING_ID - 1, 0]


@pytest.mark.parametrize("bad, what", [(FIRST_PADDING_ID, "a padding id"), (V, "outside the vocabulary"),
                                       (-1, "outside the vocabulary"), (2 ** 70, "outside the vocabulary"),
                                       (True, "expected an integer"), (3.0, "expected an integer")])
def test_the_first_bad_id_is_named(bad, what):
    ids = _ids()
    ids[30000] = bad
    ids[31000] = -5  # a later bad id is not the one named
    with pytest.raises(InvalidTokenId, match=rf"prompt\[30000\] = .*{what}"):
        validate_ids(ids, V)


def test_numpy_ints_and_other_sequences_take_the_loop():
    ids = np.arange(10, dtype=np.int64)
    assert validate_ids(ids, V) == list(range(10))
    assert validate_ids(range(5), V) == list(range(5))
    with pytest.raises(EmptyPrompt):
        validate_ids([], V)
    with pytest.raises(InvalidArgument, match="encode text"):
        validate_ids("hello", V)
