"""Benchmark of the token mixers on the device: the fused GDN decode step and paged decode attention.

``python3 -m bench.bench_mixers [--preset qwen3.5-27b] [--out bench/results/mixers.json]``

Checks before it times (one launch of each against ``assembler.ref.ops``; a failed check aborts). Times with CUDA
events around a captured CUDA graph of one launch per layer over distinct per-layer operands (GDN: the 48 layer
states, 144 MiB; attention: 16 layers of KV), median of 20 replays after 3 warm-ups. Bandwidth is decimal GB/s
of the bytes each op must move (GDN: recurrent state read + written, and separately every byte touched;
attention: K and V read), as a fraction of the H200's measured 4,468 GB/s (shared/spec/h200.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np

from assembler.numerics import attn_partitions
from bench.harness import replay_times_ms
from assembler.ref import ops
from discrete import attention, gdn
from discrete.kv_cache import PagedKVCache
from loader.config import preset

BW = 4468.0
BF = ml_dtypes.bfloat16


def _bf(rng, shape, scale=1.0, mean=0.0):
    return (mean + rng.standard_normal(shape) * scale).astype(np.float32).astype(BF)


def _time_graph(cp, fn, reps=20, warm=3) -> float:
    """Median ms of one replay of the graph captured from fn()."""
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        fn()  # compile + first run outside the capture
        s.synchronize()
        s.begin_capture()
        fn()
        g = s.end_capture()
        return float(np.median(replay_times_ms(g, s, warm, reps)))


def bench_gdn(cp, cfg, rng) -> list[dict]:
    nl, nv, dk, dv, h = len(cfg.linear_layers), cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.hidden_size
    u = lambda a: cp.asarray(np.ascontiguousarray(a).view(np.uint16))  # noqa: E731
    W = dict(w_a=_bf(rng, (nv, h), 0.02), w_b=_bf(rng, (nv, h), 0.02), A_log=np.log(rng.uniform(1, 16, nv)).astype(np.float32).astype(BF),
             dt_bias=_bf(rng, (nv,)), conv_w=_bf(rng, (cfg.gdn_conv_dim, 4), 0.5), norm_w=_bf(rng, (dv,), 0.1, 1.0))
    ops_ = [gdn.GdnDecode(cfg, *(u(W[k]) for k in ("w_a", "w_b", "A_log", "dt_bias", "conv_w", "norm_w"))) for _ in range(nl)]
    S0 = (rng.standard_normal((nv, dk, dv)) * 0.1).astype(np.float32)
    states = [cp.asarray(gdn.state_from_ref(S0)) for _ in range(nl)]
    rings = [cp.zeros((gdn.CONV_RING, cfg.gdn_conv_dim), np.uint16) for _ in range(nl)]
    qkv, z, hn = _bf(rng, (1, cfg.gdn_conv_dim), 1.5), _bf(rng, (1, cfg.gdn_value_dim)), _bf(rng, (1, h))
    dq, dz, dh = u(qkv), u(z), u(hn)
    out = cp.full((1, cfg.gdn_value_dim), 0x7FC1, np.uint16)
    pos = cp.asarray(np.array([0], np.int32))
    # check: layer 0, position 0, against the reference
    ops_[0](dq, dz, dh, rings[0], states[0], out, pos, 1)
    y, _ = ops.gdn_conv_step(qkv, np.zeros((cfg.gdn_conv_dim, 3), BF), W["conv_w"])
    g, beta = ops.gdn_gates(ops.gemv(W["w_a"], None, hn), ops.gemv(W["w_b"], None, hn), W["A_log"], W["dt_bias"])
    kd, G = cfg.gdn_key_dim, cfg.gdn_head_group
    qn, kn = ops.gdn_qk_norm(y[0, :kd].reshape(-1, dk), y[0, kd:2 * kd].reshape(-1, dk), "step")
    idx = np.arange(nv) // G
    o, _ = ops.gdn_step_head(qn[idx], kn[idx], y[0, 2 * kd:].reshape(nv, dv), g[0], beta[0], S0)
    ref = ops.rmsnorm_gated(o, z[0].reshape(nv, dv), W["norm_w"], cfg.rms_norm_eps).reshape(1, -1)
    diff = np.abs(out.get().view(BF).astype(np.float32) - ref.astype(np.float32)).max()
    if not diff <= 0.02 * np.abs(ref.astype(np.float32)).max():
        raise SystemExit(f"bench_gdn: check against the reference failed (max |diff| {diff})")
    res = []
    for M in (1, 4, 8):
        qkvM, zM, hM = (cp.asarray(cp.tile(a, (M, 1))) for a in (dq, dz, dh))
        outM = cp.zeros((M, cfg.gdn_value_dim), np.uint16)
        ms = _time_graph(cp, lambda: [ops_[i](qkvM, zM, hM, rings[i], states[i], outM, pos, M) for i in range(nl)]) / nl
        state_b = nv * dk * dv * 4 * 2
        total_b = state_b + 2 * nv * h * 2 + cfg.gdn_conv_dim * 4 * 2 + M * (cfg.gdn_conv_dim * 2 + cfg.gdn_value_dim * 4 + h * 2)
        res.append({"name": f"gdn_decode_state_M{M}", "shape": [nv, dv, dk], "bytes": state_b, "ms": ms,
                    "gbps": state_b / ms / 1e6, "frac_of_measured_bw": state_b / ms / 1e6 / BW})
        res.append({"name": f"gdn_decode_all_bytes_M{M}", "shape": [nv, dv, dk], "bytes": total_b, "ms": ms,
                    "gbps": total_b / ms / 1e6, "frac_of_measured_bw": total_b / ms / 1e6 / BW})
    return res


def bench_attention(cp, cfg, rng, contexts=(1024, 8192, 32768)) -> list[dict]:
    nq, nkv, hd, nl = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, len(cfg.full_layers)
    u = lambda a: cp.asarray(np.ascontiguousarray(a).view(np.uint16))  # noqa: E731
    res = []
    for ctx in contexts:
        pos = ctx - 1
        cache = PagedKVCache(cfg, -(-ctx // 256))
        for pg in range(cache.shape[0]):  # random finite bf16 bit patterns, one page at a time
            mag = cp.random.randint(0x3800, 0x4000, cache.pool[pg].shape, dtype=cp.uint16)
            cache.pool[pg] = mag | (cp.random.randint(0, 2, mag.shape, dtype=cp.uint16) << 15)
        sess = cache.session(ctx)
        sess.reserve(ctx)
        qnw, knw = _bf(rng, (hd,), 0.2), _bf(rng, (hd,), 0.2)
        op = attention.AttnDecode(cfg, u(qnw), u(knw), capacity=ctx)
        qg, k, v = _bf(rng, (1, 2 * nq * hd), 2.0), _bf(rng, (1, nkv * hd), 2.0), _bf(rng, (1, nkv * hd))
        dqg, dk_, dv_ = u(qg), u(k), u(v)
        out = cp.full((1, nq * hd), 0x7FC1, np.uint16)
        pd = cp.asarray(np.array([pos], np.int32))
        op(dqg, dk_, dv_, cache, sess, 0, out, pd, 1, pos_host=pos)
        K, V = (a.view(BF) for a in cache.gather(sess, 0, ctx))
        q = op.q[:1].get().view(BF)
        gate = np.ascontiguousarray(qg.reshape(1, nq, 2, hd)[:, :, 1].reshape(1, -1))
        o = np.stack([ops.attn_decode_group(q[0, j:j + 1], K[:, j // cfg.gqa_group], V[:, j // cfg.gqa_group],
                                            attn_partitions(cfg))[0] for j in range(nq)])
        ref = ops.attn_gate(o.reshape(1, -1), gate)
        if not np.array_equal(out.get(), ref.view(np.uint16)):
            d = np.abs(out.get().view(BF).astype(np.float32) - ref.astype(np.float32)).max()
            if not d <= 0.02 * np.abs(ref.astype(np.float32)).max():
                raise SystemExit(f"bench_attention ctx={ctx}: check against the reference failed ({d})")
        ms = _time_graph(cp, lambda: [op(dqg, dk_, dv_, cache, sess, i % cache.n_layers, out, pd, 1) for i in range(nl)]) / nl
        kv_b = ctx * nkv * hd * 2 * 2
        res.append({"name": "attn_decode_M1", "shape": [ctx, nkv, hd], "bytes": kv_b, "ms": ms,
                    "gbps": kv_b / ms / 1e6, "frac_of_measured_bw": kv_b / ms / 1e6 / BW})
        del cache, op
        cp.get_default_memory_pool().free_all_blocks()
    return res


def main(argv=None) -> int:
    import cupy as cp
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-27b")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "mixers.json"))
    args = ap.parse_args(argv)
    cfg, rng = preset(args.preset), np.random.default_rng(0)
    res = bench_gdn(cp, cfg, rng) + bench_attention(cp, cfg, rng)
    p = cp.cuda.runtime.getDeviceProperties(0)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    doc = {"device": p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"]),
           "driver": str(cp.cuda.runtime.driverGetVersion()), "commit": commit,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "preset": args.preset, "method": "CUDA graph of one launch per layer, median of 20 replays / layers",
           "results": res}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for r in res:
        print(f"{r['name']:28s} {str(r['shape']):18s} {r['ms'] * 1e3:9.2f} us {r['gbps']:8.0f} GB/s {100 * r['frac_of_measured_bw']:5.1f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
