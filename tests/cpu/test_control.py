"""The control block: the committed C header matches the NumPy layout it is generated from."""
import numpy as np
import pytest

from discrete.control import CONTROL_DTYPE, HEADER, c_header, new_control


def test_header_is_fresh():
    assert HEADER.read_text() == c_header(), "discrete/kernels/control.h is stale: python3 -m discrete.control --write"


def test_new_control_fields():
    c = new_control(pos=7, tokens=[1, 2, 3], max_pos=100, eos=(248046, 248044))
    assert c["m_rows"] == 3 and c["pos"] == 7 and list(c["tokens"][:3]) == [1, 2, 3]
    assert c.dtype == CONTROL_DTYPE and c.tobytes().__len__() == CONTROL_DTYPE.itemsize
    with pytest.raises(ValueError, match="tokens"):
        new_control(pos=0, tokens=list(range(9)), max_pos=10, eos=())
