"""Pieces shared by the GPU tests (hashed into RECORD.json with them); the tolerance policy is
``tests/tolerance.py``.

* :data:`CAP`: the session capacity of the tiny decode-step tests (step, PDL, fused norm);
* :func:`same_state`: two DecodeStep snapshots hold the same bits (final hidden row, GDN conv rings and recurrent
  state, KV pages), the first mismatch reported as (buffer, index);
* :data:`MAXM`, :func:`seed_of`, :func:`rand_bf16`: the activation rows and seeded random data of the GEMV-family
  tests (GEMV, lm_head).
"""
from __future__ import annotations

import zlib

import numpy as np

from assembler.ref.numerics import BF16
from tests.tolerance import assert_bits_equal

CAP = 64
MAXM = 8


def same_state(a, b, cfg):
    assert a["pos"] == b["pos"]
    assert_bits_equal("final hidden (last row)", a["hidden"][-1:], b["hidden"][-1:])
    for i in cfg.linear_layers:
        assert_bits_equal(f"conv {i}", a["conv"][i], b["conv"][i])
        assert_bits_equal(f"rec {i}", a["rec"][i], b["rec"][i])
    for i in cfg.full_layers:
        assert_bits_equal(f"K {i}", a["k"][i], b["k"][i])
        assert_bits_equal(f"V {i}", a["v"][i], b["v"][i])


def seed_of(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def rand_bf16(rng, shape, scale=1.0):
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(BF16)
