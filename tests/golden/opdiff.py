"""Per-op diff of the NumPy reference against the oracle: ``python3 -m tests.golden.opdiff [--prompt NAME]
[--upto T] [--path decode|prefill]``.

Runs the oracle (``record.load_oracle``, transformers 5.24, eager, bf16, CPU) teacher-forced over the first T
tokens of a recorded prompt with hooks on every module and on the module-level functions of
``modeling_qwen3_5`` (conv, gated delta rule, RoPE, eager attention), and feeds each reference op the oracle's
own inputs of that op, so an op's difference is not mixed with upstream drift. Prints per op the number of
elements, how many differ (bf16 or fp32 bit patterns), the largest difference relative to the largest value of
the op's output in one call, and a histogram of the ulp distance. Decode mode also
prints, per layer, how far the reference's teacher-forced decode hidden states are from the oracle's decode and
how far the oracle's prefill states are from its own decode (relative rms difference, fraction of bf16 elements
differing). A rounding point placed differently from the torch code shows up as an elementwise op with many
differing elements; summation-order noise as rare 1-ulp differences (docs/tolerance.md, "noise or arithmetic").
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

from assembler.ref import ops
from assembler.ref.attention import _rope
from assembler.ref.numerics import BF16, f32

STATS: dict = defaultdict(lambda: np.zeros(7, np.int64))   # elems, differ, max, =1, =2, =3, ≥4 ulp
SCALE: dict = defaultdict(float)                            # max |ours − theirs| / max |theirs| per call
STEP: dict = {}
CUR = {"layer": None}


def _np(t):
    import torch
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16).view(BF16).copy()
    return t.float().numpy().copy()


def _ordered(a: np.ndarray) -> np.ndarray:
    v = (a.view(np.uint16) if a.dtype == BF16 else a.astype(np.float32).view(np.uint32)).astype(np.int64)
    sign = 0x8000 if a.dtype == BF16 else 0x80000000
    return np.where(v >= sign, -(v - sign), v)


def cmp(name: str, ours, theirs) -> None:
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.dtype == theirs.dtype and ours.size == theirs.size, (name, ours.dtype, theirs.dtype, ours.shape,
                                                                     theirs.shape)
    d = np.abs(_ordered(ours).reshape(-1) - _ordered(theirs).reshape(-1))
    STATS[name] += [d.size, (d > 0).sum(), 0, (d == 1).sum(), (d == 2).sum(), (d == 3).sum(), (d >= 4).sum()]
    STATS[name][2] = max(STATS[name][2], d.max())
    o, t = f32(ours).astype(np.float64), f32(theirs).astype(np.float64)
    SCALE[name] = max(SCALE[name], float(np.abs(o - t).max() / max(np.abs(t).max(), 1e-30)))


def _hook(model, cfg) -> None:
    """Forward hooks on every module of interest and wrappers of the module-level functions."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as mq

    def pre(name):
        def f(mod, args, kwargs):
            STEP[name + ".in"] = [_np(a) for a in args if hasattr(a, "dtype")] + \
                [_np(v) for k, v in kwargs.items() if k in ("hidden_states", "gate")]
            if name.startswith("L"):
                CUR["layer"] = int(name[1:].split(".")[0])
        return f

    def post(name):
        def f(mod, args, kwargs, out):
            STEP[name + ".out"] = _np(out[0] if isinstance(out, tuple) else out)
        return f

    lm = model.model
    for li, layer in enumerate(lm.layers):
        mods = {"layer": layer, "in_norm": layer.input_layernorm, "post_norm": layer.post_attention_layernorm,
                "mlp": layer.mlp, "down": layer.mlp.down_proj}
        if li in cfg.linear_layers:
            la = layer.linear_attn
            mods.update(mix=la, in_proj_qkv=la.in_proj_qkv, in_proj_z=la.in_proj_z, in_proj_a=la.in_proj_a,
                        in_proj_b=la.in_proj_b, gnorm=la.norm, out=la.out_proj)
        else:
            sa = layer.self_attn
            mods.update(mix=sa, q_proj=sa.q_proj, k_proj=sa.k_proj, v_proj=sa.v_proj, q_norm=sa.q_norm,
                        k_norm=sa.k_norm, out=sa.o_proj)
        for n, m in mods.items():
            m.register_forward_pre_hook(pre(f"L{li}.{n}"), with_kwargs=True)
            m.register_forward_hook(post(f"L{li}.{n}"), with_kwargs=True)
    lm.norm.register_forward_pre_hook(pre("final"), with_kwargs=True)
    lm.norm.register_forward_hook(post("final"), with_kwargs=True)

    def wrap(fname, key, record):
        orig = getattr(mq, fname)

        def f(*args, **kw):
            before = {k: _np(v) for k, v in kw.items() if k == "initial_state" and v is not None}
            if fname == "causal_conv1d_update":
                before["conv_state"] = _np(args[1])
            out = orig(*args, **kw)
            STEP[f"L{CUR['layer']}.{key}"] = record(args, kw, before, out)
            return out
        setattr(mq, fname, f)

    wrap("causal_conv1d_update", "conv", lambda a, k, b, o: (_np(a[0]), b["conv_state"], _np(o), _np(a[1])))
    wrap("causal_conv1d_fn", "conv", lambda a, k, b, o: (_np(a[0]), None, _np(o), None))
    for fn in ("torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule"):
        wrap(fn, "rule", lambda a, k, b, o: (*(_np(x) for x in a[:3]), _np(k["g"]), _np(k["beta"]),
                                             b.get("initial_state"), _np(o[0]), _np(o[1])))
    wrap("apply_rotary_pos_emb", "rope", lambda a, k, b, o: (*(_np(x) for x in a[:4]), _np(o[0]), _np(o[1])))
    wrap("eager_attention_forward", "attn", lambda a, k, b, o: (*(_np(x) for x in a[1:4]), _np(o[0])))


def check(ref, path: str, pos: np.ndarray, parts: int) -> None:
    """Every op of every layer for the rows of one oracle forward (T = len(pos) rows at positions pos)."""
    cfg, eps, T = ref.cfg, ref.cfg.rms_norm_eps, len(pos)
    S = lambda k: STEP[k][0] if isinstance(STEP[k], list) else STEP[k]   # noqa: E731
    row = lambda a: a.reshape(T, -1)                                      # noqa: E731
    for li, L in enumerate(ref.layers):
        p = f"L{li}."
        x = row(S(p + "layer.in"))
        cmp("rmsnorm (input)", ops.rmsnorm(x, L["in_norm"], eps), row(S(p + "in_norm.out")))
        h = row(S(p + "in_norm.out"))
        gdn = li in cfg.linear_layers
        projs = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b") if gdn else ("q_proj", "k_proj", "v_proj")
        for n in projs:
            cmp(f"gemv {n}", ops.gemv(*L[n], h, split=1), row(S(p + n + ".out")))
        if gdn:
            xin, cs0, yo, cs1 = STEP[p + "conv"]
            cs0 = np.zeros((xin.shape[1], 3), BF16) if cs0 is None else cs0[0][:, -3:].copy()
            y, cs = ops.gdn_conv_step(xin[0].T.copy(), cs0, L["conv1d.weight"])
            cmp(f"conv ({path})", y, yo[0].T)
            q, k, v, g, beta, S0, o, S1 = STEP[p + "rule"]
            a_, b_ = row(S(p + "in_proj_a.out")), row(S(p + "in_proj_b.out"))
            g_r, beta_r = ops.gdn_gates(a_, b_, L["A_log"], L["dt_bias"])
            cmp("gdn g (fp32)", g_r, g[0])
            cmp("gdn beta", beta_r, beta[0])
            rep, kind = cfg.gdn_head_group, "step" if path == "decode" else "chunk"
            qn, kn = ops.gdn_qk_norm(np.repeat(q[0], rep, 1), np.repeat(k[0], rep, 1), kind)
            S0 = np.zeros_like(S1[0]) if S0 is None else S0[0]
            if kind == "step":
                o_r, S_r = ops.gdn_step_head(qn[0], kn[0], v[0, 0], g[0, 0], beta[0, 0], S0)
            else:
                o_r, S_r = ops.gdn_prefill_chunked(qn, kn, v[0], g[0], beta[0], S0)
            cmp(f"gdn rule {kind} out", o_r.reshape(-1), o[0].reshape(-1))
            cmp(f"gdn rule {kind} state (fp32)", S_r, S1[0])
            gi, gz = STEP[p + "gnorm.in"]
            cmp("rmsnorm_gated", ops.rmsnorm_gated(gi, gz, L["norm.weight"], eps), S(p + "gnorm.out"))
        else:
            for n in ("q_norm", "k_norm"):
                cmp(f"rmsnorm ({n})", ops.rmsnorm(S(p + n + ".in"), L[n], eps), S(p + n + ".out"))
            qq, kk, cos, sin, qo, ko = STEP[p + "rope"]
            cr, sr = ops.rope_cos_sin(pos, cfg)
            cmp("rope cos", cr, cos[0])
            cmp("rope sin", sr, sin[0])
            for nm, a, b in (("q", qq, qo), ("k", kk, ko)):
                cmp(f"rope apply {nm}", _rope(a[0].transpose(1, 0, 2).copy(), cos[0], sin[0]), b[0].transpose(1, 0, 2))
            eq, eK, eV, eo = STEP[p + "attn"]
            Kc, Vc = eK[0].transpose(1, 0, 2).copy(), eV[0].transpose(1, 0, 2).copy()
            one = ops.attn_prefill(eq[0].transpose(1, 0, 2).copy(), Kc, Vc, pos)
            cmp(f"attention ({path}, one softmax)", one, row(eo[0]))
            if path == "decode":
                G = cfg.gqa_group
                o = np.concatenate([ops.attn_decode_group(eq[0, kh * G:(kh + 1) * G, 0].copy(), Kc[:, kh].copy(),
                                                          Vc[:, kh].copy(), parts)
                                    for kh in range(cfg.num_key_value_heads)])
                cmp("attention (decode, split-KV)", o.reshape(1, -1), row(eo[0]))
            qg = row(S(p + "q_proj.out")).reshape(T, cfg.num_attention_heads, 2 * cfg.head_dim)
            gate = np.ascontiguousarray(qg[..., cfg.head_dim:]).reshape(T, -1)
            cmp("attn gate", ops.attn_gate(row(eo[0]), gate), row(S(p + "out.in")))
        proj = "out_proj" if gdn else "o_proj"
        cmp(f"gemv {proj}", ops.gemv(*L[proj], row(S(p + "out.in")), split=1), row(S(p + "out.out")))
        r1 = row(S(p + "post_norm.in"))
        cmp("residual add (mixer)", ops.residual_add(x, row(S(p + "mix.out"))), r1)
        cmp("rmsnorm (post)", ops.rmsnorm(r1, L["post_norm"], eps), row(S(p + "post_norm.out")))
        cmp("swiglu gate|up", ops.gemv(*L["gate_up"], row(S(p + "post_norm.out")), "swiglu", split=1),
            row(S(p + "down.in")))
        cmp("gemv down", ops.gemv(*L["down"], row(S(p + "down.in")), split=1), row(S(p + "down.out")))
        cmp("residual add (mlp)", ops.residual_add(r1, row(S(p + "mlp.out"))), row(S(p + "layer.out")))
    cmp("rmsnorm (final)", ops.rmsnorm(row(S("final.in")), ref.final_norm, eps), row(S("final.out")))


def _layers(store: list):
    """Wrap ReferenceModel._block to append each layer's output row 0 to store[-1]."""
    from assembler.ref.model import ReferenceModel
    orig = ReferenceModel._block

    def block(self, L, x, mix):
        y = orig(self, L, x, mix)
        store[-1].append(y)
        return y
    return ReferenceModel, orig, block


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="prose")
    ap.add_argument("--upto", type=int, default=200)
    ap.add_argument("--path", choices=("decode", "prefill"), default="decode")
    a = ap.parse_args(argv)
    import torch
    from transformers import DynamicCache

    from assembler.ref.envelope import load_goldens
    from assembler.ref.model import ReferenceModel
    from loader.synthetic import ensure_checkpoint
    from tests.golden.record import HERE, load_oracle
    torch.set_num_threads(1)
    model, ck = load_oracle(ensure_checkpoint("tiny"))
    ref = ReferenceModel(ck, oracle_weights=True)
    cfg = ref.cfg
    _hook(model, cfg)
    ids = load_goldens(HERE, [a.prompt])[a.prompt]["ids"].astype(np.int64)[:a.upto]
    nl = cfg.num_hidden_layers
    outs = lambda: [STEP[f"L{li}.layer.out"][0] for li in range(nl)] + [STEP["final.out"][0]]   # noqa: E731
    with torch.no_grad():
        if a.path == "prefill":
            model(input_ids=torch.from_numpy(ids)[None], cache=DynamicCache(config=model.config), use_cache=True)
            check(ref, "prefill", np.arange(len(ids)), ref.parts)
        else:
            cache, orc = DynamicCache(config=model.config), []
            for t in range(len(ids)):      # token 0 runs the oracle's prompt branch (no cache yet): skipped
                STEP.clear()
                model(input_ids=torch.tensor([[ids[t]]]), cache=cache, use_cache=True)
                orc.append([o[0] for o in outs()])
                if t:
                    check(ref, "decode", np.array([t]), ref.parts)
            STEP.clear()
            model(input_ids=torch.from_numpy(ids)[None], cache=DynamicCache(config=model.config), use_cache=True)
            pre = outs()
    print(f"{a.prompt}, first {len(ids)} tokens, oracle {a.path} path: each reference op on the oracle's inputs")
    print(f"{'op':36s} {'elements':>9s} {'differ':>7s} {'fraction':>9s} {'max ulp':>8s} {'max|Δ|/max|x|':>13s}"
          "  ulp =1 / =2 / =3 / >=4")
    for k, s in STATS.items():
        print(f"{k:36s} {s[0]:9d} {s[1]:7d} {s[1] / max(1, s[0]):9.2e} {s[2]:8d} {SCALE[k]:13.2e}  "
              f"{s[3]} / {s[4]} / {s[5]} / {s[6]}")
    if a.path == "prefill":
        return
    store: list = []
    cls, orig, block = _layers(store)
    cls._block = block
    st = ref.new_state(len(ids) + 8)
    for t in ids:
        store.append([])
        ref.decode(st, [t], logits=False)
        store[-1].append(st.hidden)
    cls._block = orig
    def rel(x, y):
        x, y = f32(x).astype(np.float64), f32(y).astype(np.float64)
        return np.sqrt(((x - y) ** 2).mean(-1)) / np.sqrt((y ** 2).mean(-1))
    print("\nper layer output, positions 1..: mean rms(diff)/rms(x) / fraction of bf16 elements differing")
    print(f"{'layer':>6s} {'ref decode vs oracle decode':>28s} {'oracle prefill vs decode':>28s}")
    for li in range(nl + 1):
        R = np.concatenate([store[t][li] for t in range(1, len(ids))])
        D = np.stack([orc[t][li] for t in range(1, len(ids))])
        P = pre[li][1:]
        cells = [f"{rel(x, D).mean():.2e} / {(x.view(np.uint16) != D.view(np.uint16)).mean():.3f}" for x in (R, P)]
        print(f"{li if li < nl else 'final':>6} {cells[0]:>28s} {cells[1]:>28s}")


if __name__ == "__main__":
    main()
