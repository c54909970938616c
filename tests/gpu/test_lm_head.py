"""lm_head (fused argmax / top-k) and embedding gather on the GPU against the NumPy reference.

Logits (debug output, NaN-poisoned first) vs ref.gemv_partial on a random subset of rows: one bf16 ulp (same
tolerance and negative control as tests/gpu/test_gemv.py); argmax and value exact against ref.argmax of the
GPU's own logits; top-k candidates exact (logit desc, id asc); constructed exact ties resolve to the lowest id;
M-row launches bit-identical per row to 1-row launches; embedding gather exact.
"""
from __future__ import annotations

import numpy as np
import pytest

from assembler.ref import ops as ref
from assembler.ref.numerics import BF16, f32
from loader.config import FIRST_PADDING_ID, preset

VALID = FIRST_PADDING_ID  # the defined vocabulary; ids past it are padding rows
from tests.gpu.helpers import MAXM, rand_bf16, seed_of
from tests.tolerance import assert_close_mask, close_mask

cp = pytest.importorskip("cupy")

PRESETS = ("tiny", "qwen3.5-27b")


def rand_w_dev(V, K, seed, scale=0.05):
    """bf16 bits uint16 [V, K] drawn on the device (the 27B head is 1.27 G values)."""
    rs = cp.random.RandomState(seed)
    u = (rs.standard_normal((V, K), dtype=cp.float32) * cp.float32(scale)).view(cp.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)  # RNE (no NaN in normal draws)


def launch(head, x_d, bufs, topk, with_logits=True):
    M = x_d.shape[0]
    for b in bufs.values():
        b.fill(0x5A if b.dtype != cp.float32 else np.nan)
    logits = cp.full((M, head.V), 0x7FC0, cp.uint16) if with_logits else None
    head(x_d, bufs, topk=topk, logits=logits)
    from discrete.lm_head import TOPK, decode_keys
    ids = cp.asnumpy(bufs["ids"][:M]).astype(np.int64)
    vals = cp.asnumpy(bufs["vals"][:M])
    cand = decode_keys(cp.asnumpy(bufs["cand_out"][:M * TOPK]).reshape(M, TOPK)) if topk else None
    return ids, vals, cand, (cp.asnumpy(logits) if with_logits else None)


def topk_ref(logits_u16, k):
    """Top k by (logit desc, id asc) of bf16 bit rows → (ids [M, k], bits [M, k])."""
    lf = f32(logits_u16.view(BF16))
    order = np.lexsort((np.broadcast_to(np.arange(lf.shape[1]), lf.shape), -lf), axis=-1)[:, :k]
    return order, np.take_along_axis(logits_u16, order, axis=1)


@pytest.mark.parametrize("pname", PRESETS)
def test_lm_head(gpu, pname):
    from discrete.lm_head import TOPK, LmHead
    cfg = preset(pname)
    V, K = cfg.vocab_size, cfg.hidden_size
    seed = seed_of("lm_head", pname)
    w_d = rand_w_dev(V, K, seed)
    rng = np.random.default_rng(seed)
    x = rand_bf16(rng, (MAXM, K))
    x_d = cp.asarray(x.view(np.uint16))
    head = LmHead(cfg, w_d)
    bufs = head.buffers()
    ids, vals, cand, logits = launch(head, x_d, bufs, topk=True)

    # logits vs reference on a row subset (all of the first block, a random set, the winners)
    rows = np.unique(np.concatenate([np.arange(128), rng.choice(V, 4096, replace=False), ids, V - 1 - np.arange(16)]))
    w_sub = cp.asnumpy(w_d[cp.asarray(rows)]).view(BF16)
    want = ref.gemv(w_sub, None, x, "store", split=1)  # the head is one split (INTERFACES §2)
    assert not (logits == 0x7FC0).any(), "logits not fully written"
    assert_close_mask(f"{pname} lm_head logits", logits[:, rows], want,
                      "1 bf16 ulp, as the GEMV: fp32 order in a 128-block vs float64")
    bumped = logits[:, rows].copy()
    bumped[1, 7] += 2
    assert not close_mask(bumped, want).all(), "planted 2-ulp error passed"

    # argmax / value exact against the reference argmax of the GPU's logits over the defined vocabulary
    # (padding ids >= FIRST_PADDING_ID are never chosen); top-k exact
    assert np.array_equal(ids, ref.argmax(logits.view(BF16)[:, :VALID]))
    assert np.array_equal(vals, logits[np.arange(MAXM), ids])
    rid, rbits = topk_ref(np.ascontiguousarray(logits[:, :VALID]), TOPK)
    assert np.array_equal(cand[0], rid) and np.array_equal(cand[1], rbits), "top-k candidates differ"

    # argmax-only kernel, no logits: same ids; M-row launches bit-identical per row
    ids2, vals2, _, _ = launch(head, x_d, bufs, topk=False, with_logits=False)
    assert np.array_equal(ids2, ids) and np.array_equal(vals2, vals)
    for m in range(MAXM):
        i1, v1, c1, l1 = launch(head, cp.ascontiguousarray(x_d[m:m + 1]), bufs, topk=True)
        assert i1[0] == ids[m] and np.array_equal(l1[0], logits[m]) and np.array_equal(c1[0][0], cand[0][m])
    for M in (2, 5, 7):
        iM, _, cM, lM = launch(head, cp.ascontiguousarray(x_d[:M]), bufs, topk=True)
        assert np.array_equal(iM, ids[:M]) and np.array_equal(lM, logits[:M]) and np.array_equal(cM[0], cand[0][:M])


def test_lm_head_ties(gpu):
    """Identical dominant rows: the lowest id wins, within a tile, across warps, across blocks."""
    from discrete.lm_head import LmHead
    cfg = preset("tiny")
    V, K = cfg.vocab_size, cfg.hidden_size
    w_d = rand_w_dev(V, K, seed_of("ties"), scale=0.01)
    rng = np.random.default_rng(seed_of("ties"))
    x = rand_bf16(rng, (MAXM, K))
    x_d = cp.asarray(x.view(np.uint16))
    head = LmHead(cfg, w_d)
    bufs = head.buffers()
    groups = {0: [200_003, 200_001, 5, 200_100], 1: [77_777, 77_778], 2: [131, 130_000, 248_076],
              3: [248_000, 248_018]}
    padding = {4: [248_077, 248_319], 5: [248_200]}  # dominant padding rows: must never win
    for m, rows in {**groups, **padding}.items():
        dom = np.where(f32(x[m]) >= 0, 0.5, -0.5).astype(np.float32).astype(BF16).view(np.uint16)
        w_d[cp.asarray(rows)] = cp.asarray(dom)[None, :]
    for topk in (False, True):
        ids, _, cand, logits = launch(head, x_d, bufs, topk=topk)
        for m, rows in groups.items():
            assert ids[m] == min(rows), f"row {m}: argmax {ids[m]}, want the lowest tied id {min(rows)}"
            assert np.all(logits[m, rows] == logits[m, min(rows)])
            if topk:
                assert list(cand[0][m][:len(rows)]) == sorted(rows), "tied candidates not in id order"
        for m, rows in padding.items():
            lf = f32(logits[m].view(BF16))
            assert ids[m] < VALID and lf[rows[0]] > lf[ids[m]], \
                f"row {m}: padding row should dominate the logits yet never be chosen (got {ids[m]})"
            if topk:
                assert (cand[0][m] < VALID).all(), "a padding id among the top-k candidates"


def test_embed(gpu):
    from discrete.lm_head import Embed
    cfg = preset("tiny")
    rng = np.random.default_rng(seed_of("embed"))
    table = rand_bf16(rng, (cfg.vocab_size, cfg.hidden_size))
    emb = Embed(cfg, cp.asarray(table.view(np.uint16)))
    for M in (1, 3, 8):
        ids = rng.integers(0, cfg.vocab_size, M).astype(np.int32)
        ids[0] = cfg.vocab_size - 1
        out = cp.full((M, cfg.hidden_size), 0x7FC0, cp.uint16)
        emb(cp.asarray(ids), out)
        assert np.array_equal(cp.asnumpy(out), ref.embed(table, ids).view(np.uint16))
    out = cp.zeros((2, cfg.hidden_size), cp.uint16)
    emb(cp.asarray(np.array([3, cfg.vocab_size], np.int32)), out)
    o = cp.asnumpy(out)
    assert np.array_equal(o[0], table[3].view(np.uint16)) and np.all(o[1] == 0x7FC0), "bad id must give NaN"
