"""MTP head wiring (spec §4) with constructed weights whose output is known exactly.

With mtp.layers.0's o_proj and down_proj zeroed the layer is the identity on its input (both residual adds add
bf16(0)), so lm_head(mtp.norm(fc(cat[norm_e(e), norm_h(h)]))) is all that remains:
- fc = [0 | I] (passes the hidden half): logits = lm_head(rmsnorm(rmsnorm(h_t, pre_fc_norm_hidden), mtp.norm));
- fc = [I | 0] (passes the embedding half): logits = lm_head(rmsnorm(rmsnorm(embed(t+1), pre_fc_norm_embedding),
  mtp.norm)). The identity GEMV is exact (one nonzero product per output).
A reference with the concatenation order swapped must fail both."""
import gc

import numpy as np
import pytest

from assembler.ref import ops
from assembler.ref.model import ReferenceModel
from assembler.ref.numerics import BF16, FP8
from assembler.ref.testing import OverlayWeights


def _constructed(base, half: str):
    H = base.config.hidden_size
    fc = np.zeros((H, 2 * H), np.float32)
    fc[np.arange(H), np.arange(H) + (H if half == "hidden" else 0)] = 1.0
    ov = {"mtp.fc.weight": fc.astype(BF16)}
    for n in ("self_attn.o_proj", "mlp.down_proj"):
        w = base.get(f"mtp.layers.0.{n}.weight")
        ov[f"mtp.layers.0.{n}.weight"] = np.zeros(w.shape, np.float32).astype(w.dtype)
    return OverlayWeights(base, ov)


@pytest.fixture(scope="module")
def base(tiny_ckpt):
    from loader.checkpoint import Checkpoint
    return Checkpoint.open(tiny_ckpt)


@pytest.mark.parametrize("half", ["hidden", "embedding"])
def test_mtp_constructed_weights_reproduce_known_logits(base, half):
    m = ReferenceModel(_constructed(base, half))
    eps = m.cfg.rms_norm_eps
    ids = np.random.default_rng(11 if half == "hidden" else 12).integers(0, 248000, 6)
    st = m.new_state(16)
    m.prefill(st, ids[:5], logit_rows="none")
    h = st.hidden[-1:]                                                    # final-normed hidden at t = 4
    nxt = ids[5:6]                                                        # token t + 1
    st.mtp_pos = 0                                                        # MTP cache empty: attend to itself
    got, _ = m.mtp_draft(st, nxt, h)
    if half == "hidden":
        x = ops.rmsnorm(h, base.get("mtp.pre_fc_norm_hidden.weight"), eps)
    else:
        x = ops.rmsnorm(ops.embed(base.get("model.embed_tokens.weight"), nxt), base.get("mtp.pre_fc_norm_embedding.weight"), eps)
    want = ops.gemv(base.get("lm_head.weight"), None, ops.rmsnorm(x, base.get("mtp.norm.weight"), eps))
    assert got.dtype == BF16 and np.array_equal(got.view(np.uint16), want.view(np.uint16))
    st.mtp_pos = 0                                                        # MTP cache empty: attend to itself
    swapped, _ = m.mtp_draft(st, nxt, h, swap=True)                      # negative control: [hidden, embedding]
    assert not np.array_equal(swapped.view(np.uint16), want.view(np.uint16))
    assert ops.argmax(swapped)[0] != ops.argmax(want)[0] or np.abs(swapped.astype(np.float32) - want.astype(np.float32)).max() > 1
    del m
    gc.collect()


def test_mtp_layer_is_live_with_real_weights(base):
    """With the checkpoint's own MTP weights the layer changes the result (the zeroing above is what made it
    vanish), and chained drafts advance the MTP cache position."""
    m = ReferenceModel(base)
    st = m.new_state(16)
    ids = np.array([10, 20, 30, 40])
    m.prefill(st, ids, logit_rows="none")
    lg1, h1 = m.mtp_draft(st, [50], st.hidden[-1:])
    lg2, _ = m.mtp_draft(st, [int(ops.argmax(lg1)[0])], h1)              # step 2 chains on the MTP's own hidden
    assert st.mtp_pos == 2 and lg2.shape == (1, m.cfg.vocab_size)
    assert not np.isnan(lg1.astype(np.float32)).any() and not np.isnan(lg2.astype(np.float32)).any()
    assert base.get("mtp.layers.0.self_attn.q_proj.weight").dtype == FP8
