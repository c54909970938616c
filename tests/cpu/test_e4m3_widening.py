"""The e4m3 → bf16 widening of the GEMV kernels (discrete/kernels/common.cuh), modelled bit for bit on every byte
pair: the placed bits s.0000eeee.mmm0000 times 2^120 are the e4m3 value exactly (ml_dtypes), and the sign-replicate
form of the e4m3 patch in bench/EXPERIMENTS.md (prmt generic mode, shift, one mask) builds the same bits as the
current one (prmt, shift, two masks, or), so applying it cannot change a result."""
import ml_dtypes
import numpy as np

B = np.arange(1 << 16, dtype=np.uint32)
W = (B & 0xFF) | ((B >> 8) << 8) | (((B * 7) & 0xFF) << 16) | ((((B >> 8) * 13) & 0xFF) << 24)  # 4 bytes per word


def prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    """PTX prmt.b32 generic mode (PTX ISA "prmt"): byte n of the result is byte sel[n] & 7 of {b, a}; with bit 3
    of the selector nibble set, the sign (msb) of that byte replicated over all 8 bits."""
    src = (b.astype(np.uint64) << 32) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=np.uint32)
    for n in range(4):
        c = (sel >> (4 * n)) & 0xF
        byte = ((src >> np.uint64(8 * (c & 7))) & np.uint64(0xFF)).astype(np.uint32)
        if c & 8:
            byte = np.where(byte & 0x80, 0xFF, 0).astype(np.uint32)
        out |= byte << np.uint32(8 * n)
    return out


def placed_current(w: np.ndarray, sel: int) -> np.ndarray:
    a = prmt(w, np.zeros_like(w), sel)  # __byte_perm(w, 0, sel): [0, b_i, 0, b_j]
    return (a & 0x80008000) | ((a >> 4) & 0x07F007F0)


def placed_signrep(w: np.ndarray, sel: int) -> np.ndarray:
    return (prmt(w, np.zeros_like(w), sel) << 4) & 0x87F087F0


def test_signrep_builds_the_same_bits_on_every_byte_pair():
    for cur, new in ((0x1404, 0x9180), (0x3424, 0xB3A2)):  # elements (0, 1) and (2, 3) of a word
        assert np.array_equal(placed_current(W, cur), placed_signrep(W, new))
    # the 65,536 words hold every (b0, b1) pair and every (b2, b3) pair (7 and 13 are odd: bijections mod 256)
    assert np.unique(W & 0xFFFF).size == np.unique(W >> 16).size == 1 << 16


def test_negative_control_without_the_sign_mode():
    """The same selector without bit 3 (the byte copied over the high byte, not its sign) puts the element's bit 3
    (the exponent's lowest bit) where the sign goes: wrong exactly where those two bits differ."""
    bad = (prmt(W, np.zeros_like(W), 0x1100) << 4) & 0x87F087F0
    diff = bad != placed_signrep(W, 0x9180)
    b0, b1 = W & 0xFF, (W >> 8) & 0xFF
    assert np.array_equal(diff, (((b0 >> 7) ^ (b0 >> 3)) & 1).astype(bool) | (((b1 >> 7) ^ (b1 >> 3)) & 1).astype(bool))
    assert diff.mean() > 0.5


def test_placed_bits_times_2_120_are_the_e4m3_values():
    """Decode each 16-bit lane as bf16 times 2^120 (the kernel's exact mul.rn.bf16x2 by 0x7B80): the e4m3 value for
    all 254 finite codes (the two NaN codes give ±480, never in a checkpoint)."""
    codes = np.arange(256, dtype=np.uint32)
    w = codes | (codes << 8)
    t = placed_signrep(w, 0x9180)
    lanes = np.stack([t & 0xFFFF, t >> 16], -1).astype(np.uint16)
    vals = lanes.view(ml_dtypes.bfloat16).astype(np.float64) * 2.0 ** 120
    ref = codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    finite = np.isfinite(ref)
    assert finite.sum() == 254
    assert np.array_equal(vals[finite, 0], ref[finite]) and np.array_equal(vals[finite, 1], ref[finite])
    assert np.array_equal(np.abs(vals[~finite, 0]), [480.0, 480.0])
