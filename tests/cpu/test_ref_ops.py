"""Reference ops (assembler/ref/ops.py): GEMV slice/row/epilogue contracts, argmax ties, and each op against the
transformers 5.24 function it mirrors (bit-exact where the rounding points are the same, else a named tolerance
with a planted-error negative control)."""
import ml_dtypes
import numpy as np
import pytest

from assembler.numerics import split_k
from assembler.ref import ops
from assembler.ref.numerics import BF16, bf16, f32
from assembler.ref.testing import from_torch, quantize_fp8, to_torch
from loader.config import preset
from tests.tolerance import bits, rel_ulps, within_ulp_or_floor

CFG = preset("tiny")


def rb(rng, *shape, scale=1.0):
    return bf16(rng.standard_normal(shape) * scale)


def fp8_weight(rng, n, k):
    return quantize_fp8((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))


# ---------------------------------------------------------------- GEMV family
@pytest.mark.parametrize("n,k,split", [(384, 512, 1), (384, 512, 2), (256, 1024, 8)])
def test_gemv_slices_compose_to_whole_op(n, k, split):
    rng = np.random.default_rng(n + k + split)
    w, s = fp8_weight(rng, n, k)
    x = rb(rng, 3, k)
    whole = ops.gemv(w, s, x, split=split)
    cuts = [0, 16, 144, 160, n]                                            # uneven row slices, like SM slices
    parts = np.full((split, 3, n), np.nan, np.float32)                    # poisoned until every slice is written
    for a, b in zip(cuts, cuts[1:]):
        for sp in range(split):
            parts[sp, :, a:b] = ops.gemv_partial(w, s, x, range(a, b), split, sp)
    assert not np.isnan(parts).any()
    assert np.array_equal(bits(ops.gemv_reduce(parts)), bits(whole))


@pytest.mark.parametrize("epilogue", ["store", "residual", "swiglu"])
def test_gemv_rows_independent_of_m(epilogue):
    rng = np.random.default_rng(7)
    w, s = fp8_weight(rng, 512, 256)
    x = rb(rng, 8, 256)
    r = rb(rng, 8, 512)
    kw = {"residual": r} if epilogue == "residual" else {}
    full = ops.gemv(w, s, x, epilogue, **kw)
    for m in range(1, 9):
        part = ops.gemv(w, s, x[:m], epilogue, **({"residual": r[:m]} if kw else {}))
        assert np.array_equal(bits(part), bits(full[:m])), f"M={m}"
    for i in range(8):
        one = ops.gemv(w, s, x[i:i + 1], epilogue, **({"residual": r[i:i + 1]} if kw else {}))
        assert np.array_equal(bits(one[0]), bits(full[i])), f"row {i}"


def test_gemv_matches_dequantised_product_and_rejects_wrong_scale():
    rng = np.random.default_rng(3)
    w, s = fp8_weight(rng, 256, 768)
    x = rb(rng, 2, 768)
    W = f32(w).astype(np.float64) * np.repeat(np.repeat(f32(s), 128, 0), 128, 1)
    exact = x.astype(np.float32).astype(np.float64) @ W.T
    y = ops.gemv(w, s, x)
    assert rel_ulps(y, exact).max() <= 1.0                               # one rounding to bf16 (+fp32 noise)
    bad = ops.gemv(w, np.ascontiguousarray(s[::-1]), x)                   # planted error: scale rows swapped
    assert rel_ulps(bad, exact).max() > 1.0


def test_gemv_epilogues_definition():
    rng = np.random.default_rng(4)
    w, s = fp8_weight(rng, 256, 256)
    x, r = rb(rng, 2, 256), rb(rng, 2, 128)
    y = ops.gemv_reduce(np.stack([ops.gemv_partial(w, s, x, range(256), 1, 0)]))
    g, u = f32(y[:, :128]), f32(y[:, 128:])
    sw = bf16(f32(bf16(g / (1 + np.exp(-g.astype(np.float64))))) * u)
    assert np.array_equal(bits(ops.gemv(w, s, x, "swiglu")), bits(sw))
    w2, s2 = w[:128], s[:1]
    res = bf16(f32(ops.gemv(w2, s2, x)) + f32(r))
    assert np.array_equal(bits(ops.gemv(w2, s2, x, "residual", residual=r)), bits(res))


def test_gemv_bf16_weights_and_default_split():
    rng = np.random.default_rng(5)
    w = rb(rng, 384, 256, scale=0.1)
    x = rb(rng, 1, 256)
    assert split_k(384, 256) in (1, 2)
    y = ops.gemv(w, None, x)
    exact = f32(x).astype(np.float64) @ f32(w).astype(np.float64).T
    assert rel_ulps(y, exact).max() <= 1.0
    assert np.array_equal(bits(ops.gemv(ops.widen(w), None, x)), bits(y))    # pre-widened weights: same bits


@pytest.mark.parametrize("bad", ["x_dtype", "k_mismatch", "scale_shape", "k_not_128"])
def test_gemv_rejects_bad_input(bad):
    rng = np.random.default_rng(6)
    w, s = fp8_weight(rng, 128, 256)
    x = rb(rng, 1, 256)
    with pytest.raises(ValueError, match="gemv|128"):
        if bad == "x_dtype":
            ops.gemv(w, s, x.astype(np.float32))
        elif bad == "k_mismatch":
            ops.gemv(w, s, rb(rng, 1, 384))
        elif bad == "scale_shape":
            ops.gemv(w, s[:, :1], x)
        else:
            ops.gemv(rb(rng, 16, 100), None, rb(rng, 1, 100))


def test_argmax_ties_lowest_id():
    lg = np.zeros((3, 1000), np.float32)
    lg[0, [17, 400, 999]] = 5.0
    lg[1, [999, 3]] = 2.0
    lg[2, :] = -1.0
    assert list(ops.argmax(bf16(lg))) == [17, 3, 0]
    lg[1, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        ops.argmax(lg)


def test_embed_gather_exact_and_checked():
    rng = np.random.default_rng(8)
    table = rb(rng, 50, 256)
    assert np.array_equal(bits(ops.embed(table, [3, 3, 49])), bits(table[[3, 3, 49]]))
    with pytest.raises(ValueError, match="embed"):
        ops.embed(table, [50])


# ---------------------------------------------------------------- against transformers
hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
torch = pytest.importorskip("torch")


def test_rmsnorm_bit_exact_vs_transformers_and_plain_w_fails():
    rng = np.random.default_rng(10)
    x, w = rb(rng, 8, 256), rb(rng, 256, scale=0.1)
    m = hf.Qwen3_5RMSNorm(256).to(torch.bfloat16)
    m.weight.data = to_torch(w)
    want = from_torch(m(to_torch(x)))
    assert np.array_equal(bits(ops.rmsnorm(x, w, CFG.rms_norm_eps)), bits(want))
    wrong = bf16(f32(ops.rmsnorm(x, bf16(np.zeros(256)), CFG.rms_norm_eps)) * f32(w))  # plain-w norm (bug)
    assert not np.array_equal(bits(wrong), bits(want))


def test_rmsnorm_gated_bit_exact_vs_transformers():
    rng = np.random.default_rng(11)
    x, z, w = rb(rng, 4, 6, 128), rb(rng, 4, 6, 128), bf16(1 + rng.standard_normal(128) * 0.1)
    m = hf.Qwen3_5RMSNormGated(128).to(torch.bfloat16)
    m.weight.data = to_torch(w)
    want = from_torch(m(to_torch(x), to_torch(z)))
    assert np.array_equal(bits(ops.rmsnorm_gated(x, z, w, 1e-6)), bits(want))
    assert not np.array_equal(bits(ops.rmsnorm_gated(x, x, w, 1e-6)), bits(want))  # wrong gate input


def _hf_rope(pos, theta=None):
    from transformers import Qwen3_5TextConfig
    tc = CFG.to_text_config()
    if theta is not None:
        tc["rope_parameters"] = dict(tc["rope_parameters"], rope_theta=theta)
    re = hf.Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(**{k: v for k, v in tc.items() if k != "model_type"}))
    c, s = re(torch.zeros(1, dtype=torch.bfloat16), torch.from_numpy(np.asarray(pos))[None])
    return from_torch(c[0]), from_torch(s[0])


def test_rope_and_attn_prep_bit_exact_vs_transformers():
    rng = np.random.default_rng(12)
    pos = np.array([0, 1, 63, 640, 5000])
    c, s = _hf_rope(pos)
    cr, sr = ops.rope_cos_sin(pos, CFG)
    assert np.array_equal(bits(cr), bits(c)) and np.array_equal(bits(sr), bits(s))
    cw, _ = ops.rope_cos_sin(pos, CFG, theta=1e4)                         # negative control: wrong base
    assert not np.array_equal(bits(cw), bits(c))
    M, nq, nkv, hd = len(pos), CFG.num_attention_heads, CFG.num_key_value_heads, CFG.head_dim
    qg, k, v = rb(rng, M, 2 * nq * hd), rb(rng, M, nkv * hd), rb(rng, M, nkv * hd)
    qn, kn = rb(rng, hd, scale=0.1), rb(rng, hd, scale=0.1)
    q, gate, kk, vv = ops.attn_prep(qg, k, v, qn, kn, pos, CFG)
    nq_m, nk_m = hf.Qwen3_5RMSNorm(hd).to(torch.bfloat16), hf.Qwen3_5RMSNorm(hd).to(torch.bfloat16)
    nq_m.weight.data, nk_m.weight.data = to_torch(qn), to_torch(kn)
    qh, gh = torch.chunk(to_torch(qg).view(M, nq, 2 * hd), 2, dim=-1)
    qt = nq_m(qh).transpose(0, 1)[None]
    kt = nk_m(to_torch(k).view(M, nkv, hd)).transpose(0, 1)[None]
    qt, kt = hf.apply_rotary_pos_emb(qt, kt, to_torch(c)[None], to_torch(s)[None])
    assert np.array_equal(bits(q), bits(from_torch(qt[0].transpose(0, 1))))
    assert np.array_equal(bits(kk), bits(from_torch(kt[0].transpose(0, 1))))
    assert np.array_equal(bits(gate), bits(from_torch(gh.reshape(M, -1))))


def _hf_eager(q, K, V, qpos):
    """transformers eager attention for queries q [T, nq, hd] at positions qpos over K/V [L, nkv, hd]."""
    class Mod:
        num_key_value_groups, training = CFG.gqa_group, False
    L = K.shape[0]
    mask = torch.where(torch.arange(L)[None, :] <= torch.from_numpy(qpos)[:, None], 0.0, float("-inf")).to(torch.bfloat16)
    o, _ = hf.eager_attention_forward(Mod(), to_torch(q).transpose(0, 1)[None], to_torch(K).transpose(0, 1)[None],
                                      to_torch(V).transpose(0, 1)[None], mask[None, None], CFG.head_dim ** -0.5)
    return from_torch(o[0].reshape(q.shape[0], -1))


@pytest.mark.parametrize("L", [1, 67, 300])
def test_attention_vs_transformers_eager(L):
    rng = np.random.default_rng(L)
    nq, nkv, hd, G = CFG.num_attention_heads, CFG.num_key_value_heads, CFG.head_dim, CFG.gqa_group
    K, V = rb(rng, L, nkv, hd), rb(rng, L, nkv, hd)
    q = rb(rng, 3, nq, hd, scale=0.3)
    qpos = np.array([max(0, L - 3), max(0, L - 2), L - 1])
    want = _hf_eager(q, K, V, qpos)
    got = ops.attn_prefill(q, K, V, qpos)
    # prefill: the eager rounding points exactly; order of fp32 sums may differ → ≤ 1 bf16 ulp, rarely
    assert within_ulp_or_floor(got, want) and np.mean(bits(got) != bits(want)) < 0.01
    dec = np.concatenate([ops.attn_decode_group(q[2, h * G:(h + 1) * G], K[:, h], V[:, h], 66) for h in range(nkv)])
    assert within_ulp_or_floor(dec.reshape(-1), want[2])               # split-KV two-pass: same rounding points
    wrongmap = np.concatenate([ops.attn_decode_group(q[2, h::nkv], K[:, h], V[:, h], 66) for h in range(nkv)])
    if L > 1:                                                             # negative control: GQA map h::nkv
        assert not within_ulp_or_floor(wrongmap.reshape(-1), want[2])


def test_attn_gate_bit_exact():
    rng = np.random.default_rng(13)
    o, g = rb(rng, 2, 3072), rb(rng, 2, 3072, scale=3)
    want = from_torch(to_torch(o) * torch.sigmoid(to_torch(g)))
    assert np.array_equal(bits(ops.attn_gate(o, g)), bits(want))


def test_gdn_conv_gates_vs_transformers():
    rng = np.random.default_rng(14)
    C = CFG.gdn_conv_dim
    x, w = rb(rng, 20, C), bf16(rng.uniform(-0.5, 0.5, (C, 1, 4)))
    y, st = ops.gdn_conv_prefill(x, np.zeros((C, 3), BF16), w)
    yt = hf.causal_conv1d_fn(to_torch(x).T[None].contiguous(), to_torch(w).squeeze(1), None, activation="silu")
    assert np.array_equal(bits(y), bits(from_torch(yt[0].T)))
    ys, st2 = [], np.zeros((C, 3), BF16)                                   # step form over the same tokens
    for t in range(20):
        yy, st2 = ops.gdn_conv_step(x[t:t + 1], st2, w)
        ys.append(yy[0])
    assert np.array_equal(bits(np.stack(ys)), bits(y)) and np.array_equal(bits(st2), bits(st))
    assert np.array_equal(bits(st), bits(x[-3:].T))
    nv = CFG.linear_num_value_heads
    a, b = rb(rng, 8, nv, scale=3), rb(rng, 8, nv, scale=3)
    A_log, dt = bf16(np.log(rng.uniform(1, 16, nv))), bf16(rng.uniform(-7, -2.2, nv))
    g, beta = ops.gdn_gates(a, b, A_log, dt)
    gt = (-to_torch(A_log).float().exp() * torch.nn.functional.softplus(to_torch(a).float() + to_torch(dt))).numpy()
    assert np.array_equal(bits(beta), bits(from_torch(to_torch(b).sigmoid())))
    assert np.allclose(g, gt, rtol=4e-7, atol=0)                          # fp32 exp/softplus: ≤ ~2 ulp libm noise
    assert not np.allclose(ops.gdn_gates(a, b, A_log, bf16(np.zeros(nv)))[0], gt, rtol=4e-7, atol=0)


def _gdn_inputs(rng, T):
    nk, nv, dk = CFG.linear_num_key_heads, CFG.linear_num_value_heads, CFG.linear_key_head_dim
    q, k, v = rb(rng, T, nk, dk), rb(rng, T, nk, dk), rb(rng, T, nv, dk)
    g = (-np.abs(rng.standard_normal((T, nv))) * 0.3).astype(np.float32)
    beta = bf16(rng.uniform(0, 1, (T, nv)))
    S0 = (rng.standard_normal((nv, dk, dk)) * 0.1).astype(np.float32)
    return q, k, v, g, beta, S0


def test_gdn_chunked_vs_transformers_and_wrong_head_map_fails():
    rng = np.random.default_rng(15)
    q, k, v, g, beta, S0 = _gdn_inputs(rng, 150)
    rep = CFG.gdn_head_group
    ot, St = hf.torch_chunk_gated_delta_rule(to_torch(q)[None], to_torch(k)[None], to_torch(v)[None],
                                             g=torch.from_numpy(g)[None], beta=to_torch(beta)[None],
                                             initial_state=torch.from_numpy(S0)[None], output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)
    want_o, want_S = from_torch(ot[0]), St[0].numpy()
    qn, kn = ops.gdn_qk_norm(np.repeat(q, rep, 1), np.repeat(k, rep, 1), "chunk")
    o, S = ops.gdn_prefill_chunked(qn, kn, v, g, beta, S0)
    # same rounding points, different fp32 summation order: ≤ 1 bf16 ulp on o, fp32 noise on S
    assert within_ulp_or_floor(o, want_o)
    assert np.abs(S - want_S).max() <= 1e-5 * np.abs(want_S).max()
    qw, kw = ops.gdn_qk_norm(np.tile(q, (1, rep, 1)), np.tile(k, (1, rep, 1)), "chunk")  # tiled map (wrong)
    ow, _ = ops.gdn_prefill_chunked(qw, kw, v, g, beta, S0)
    assert not within_ulp_or_floor(ow, want_o)


def test_gdn_step_vs_transformers_recurrent():
    rng = np.random.default_rng(16)
    q, k, v, g, beta, S0 = _gdn_inputs(rng, 5)
    rep = CFG.gdn_head_group
    ot, St = hf.torch_recurrent_gated_delta_rule(to_torch(q)[None], to_torch(k)[None], to_torch(v)[None],
                                                 g=torch.from_numpy(g)[None], beta=to_torch(beta)[None],
                                                 initial_state=torch.from_numpy(S0)[None], output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
    qn, kn = ops.gdn_qk_norm(np.repeat(q, rep, 1), np.repeat(k, rep, 1), "step")
    S, outs = S0, []
    for t in range(5):
        o, S = ops.gdn_step_head(qn[t], kn[t], v[t], g[t], beta[t], S)
        outs.append(o)
    assert within_ulp_or_floor(np.stack(outs), from_torch(ot[0]))
    assert np.abs(S - St[0].numpy()).max() <= 1e-6 * np.abs(S).max()
    _, Sw = ops.gdn_step_head(qn[0], kn[0], v[0], g[0] * 0, beta[0], S0)   # negative control: no decay
    _, S1 = ops.gdn_step_head(qn[0], kn[0], v[0], g[0], beta[0], S0)
    assert np.abs(Sw - S1).max() > 1e-3


def test_gdn_chunk_equals_steps_within_fp32_noise():
    rng = np.random.default_rng(17)
    q, k, v, g, beta, S0 = _gdn_inputs(rng, 70)
    rep = CFG.gdn_head_group
    qc, kc = ops.gdn_qk_norm(np.repeat(q, rep, 1), np.repeat(k, rep, 1), "chunk")
    _, Sc = ops.gdn_prefill_chunked(qc, kc, v, g, beta, S0)
    qs, ks = ops.gdn_qk_norm(np.repeat(q, rep, 1), np.repeat(k, rep, 1), "step")
    S = S0
    for t in range(70):
        _, S = ops.gdn_step_head(qs[t], ks[t], v[t], g[t], beta[t], S)
    assert np.abs(S - Sc).max() <= 1e-4 * np.abs(Sc).max()
    assert not np.array_equal(S, Sc)                                      # different paths, different bits


# ---------------------------------------------------------------- model level: verify rows
def test_verify_pass_rows_equal_single_steps(tiny_ckpt):
    """decode(state, M tokens) (the verify pass) gives, per row, the bits of M single-token decode steps."""
    from assembler.ref.model import ReferenceModel
    from loader.checkpoint import Checkpoint
    m = ReferenceModel(Checkpoint.open(tiny_ckpt))
    ids = np.random.default_rng(21).integers(0, 248000, 70)
    a, b = m.new_state(80), m.new_state(80)
    m.prefill(a, ids[:66], logit_rows="none")
    m.prefill(b, ids[:66], logit_rows="none")
    rows = m.decode(a, ids[66:70])
    singles = np.concatenate([m.decode(b, [t]) for t in ids[66:70]])
    assert np.array_equal(bits(rows), bits(singles))
    for i in a.rec:
        assert np.array_equal(a.rec[i].view(np.uint32), b.rec[i].view(np.uint32))
        assert np.array_equal(bits(a.conv[i]), bits(b.conv[i]))


def test_argmax_never_picks_padding_ids():
    """The greedy step's argmax over the defined vocabulary: a dominant padding logit is ignored (as on the GPU);
    without n_valid (the negative control) it would win."""
    from loader.config import FIRST_PADDING_ID
    rng = np.random.default_rng(11)
    lf = rng.standard_normal((2, 248320)).astype(np.float32)
    lf[0, FIRST_PADDING_ID + 5] = 100.0
    lf[1, 7] = lf[1, 9] = 50.0
    logits = lf.astype(BF16)
    got = ops.argmax(logits, n_valid=FIRST_PADDING_ID)
    assert got[0] < FIRST_PADDING_ID and got[0] == np.argmax(lf[0, :FIRST_PADDING_ID])
    assert got[1] == 7
    assert ops.argmax(logits)[0] == FIRST_PADDING_ID + 5
