"""Profiling target for the token mixers (issue 5): a few launches of the GDN decode step and of decode attention
on the 27B shapes, for ``ncu`` (no timing of its own).

``ncu --clock-control none -k regex:'qmk_gdn|qmk_attn' ... python3 -m bench.probes.mixer_probe [--contexts ...]``
``python3 -m bench.probes.mixer_probe --stamps [--out DIR]``: the GDN kernel built with ``QMK_GDN_STAMPS`` (SM
clock at the end of each phase, block 0 thread 0; gdn.cuh), launched over 48 distinct layer states (> 2 × L2) with
M = 1, 4, 8; prints the median cycles per phase and writes ``gdn_stamps.json``.

GDN: two M = 1 launches on random state. Attention: two M = 1 calls (four kernels each) per context, on random
KV pages. Operands as ``bench/bench_mixers.py`` builds them (no reference check here: bench_mixers checks).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.bench_mixers import BF, _bf  # noqa: E402
from loader.config import preset  # noqa: E402


def main(argv=None) -> int:
    import cupy as cp
    from discrete import attention, gdn
    from discrete.kv_cache import PagedKVCache
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-27b")
    ap.add_argument("--contexts", type=int, nargs="*", default=[1024, 32768])
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--stamps", action="store_true", help="GDN phase clocks instead of the ncu target")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    cfg, rng = preset(a.preset), np.random.default_rng(0)
    u = lambda x: cp.asarray(np.ascontiguousarray(x).view(np.uint16))  # noqa: E731
    nv, dk, dv, h = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.hidden_size
    op = gdn.GdnDecode(cfg, u(_bf(rng, (nv, h), 0.02)), u(_bf(rng, (nv, h), 0.02)),
                       u(np.log(rng.uniform(1, 16, nv)).astype(np.float32).astype(BF)),
                       u(_bf(rng, (nv,))), u(_bf(rng, (cfg.gdn_conv_dim, 4), 0.5)), u(_bf(rng, (dv,), 0.1, 1.0)))
    state = cp.asarray((rng.standard_normal((nv, dv, dk)) * 0.1).astype(np.float32))
    ring = cp.zeros((gdn.CONV_RING, cfg.gdn_conv_dim), np.uint16)
    qkv, z, hn = u(_bf(rng, (1, cfg.gdn_conv_dim), 1.5)), u(_bf(rng, (1, cfg.gdn_value_dim))), u(_bf(rng, (1, h)))
    out = cp.zeros((1, cfg.gdn_value_dim), np.uint16)
    pos = cp.asarray(np.array([5], np.int32))
    if a.stamps:
        return stamps(cp, cfg, op, qkv, z, hn, a.out)
    for _ in range(a.calls):
        op(qkv, z, hn, ring, state, out, pos, 1)
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for ctx in a.contexts:
        cache = PagedKVCache(cfg, -(-ctx // 256))
        for pg in range(cache.shape[0]):
            mag = cp.random.randint(0x3800, 0x4000, cache.pool[pg].shape, dtype=cp.uint16)
            cache.pool[pg] = mag | (cp.random.randint(0, 2, mag.shape, dtype=cp.uint16) << 15)
        sess = cache.session(ctx)
        sess.reserve(ctx)
        at = attention.AttnDecode(cfg, u(_bf(rng, (hd,), 0.2)), u(_bf(rng, (hd,), 0.2)), capacity=ctx)
        qg, k, v = u(_bf(rng, (1, 2 * nq * hd), 2.0)), u(_bf(rng, (1, nkv * hd), 2.0)), u(_bf(rng, (1, nkv * hd)))
        o = cp.zeros((1, nq * hd), np.uint16)
        pd = cp.asarray(np.array([ctx - 1], np.int32))
        for _ in range(a.calls):
            at(qg, k, v, cache, sess, 0, o, pd, 1, pos_host=ctx - 1)
        cp.cuda.Device().synchronize()
        del cache, at
    cp.cuda.Device().synchronize()
    return 0


PHASES = ("start", "pdl wait", "loads issued", "conv", "a/b dots", "sync 1", "l2norm + gates, sync 2",
          "recurrence + state store", "sync 3", "gated norm")


def stamps(cp, cfg, op, qkv, z, hn, out_dir) -> int:
    """Phase clocks of the GDN kernel (QMK_GDN_STAMPS build) over 48 layer states, M = 1, 4, 8."""
    import json
    from discrete import gdn
    from discrete.build import load_module
    from discrete.launch import kernels
    mod = load_module(cfg, gdn.SOURCES, {**gdn.extra_defines(cfg), "QMK_GDN_STAMPS": 1})
    op.kernel, = kernels(mod, ("qmk_gdn_decode",), False)
    buf = mod.get_global("qmk_gdn_stamps")
    st = cp.ndarray((16,), cp.int64, buf)
    nl, nv, dk, dv = len(cfg.linear_layers), cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    states = [cp.asarray((np.random.default_rng(i).standard_normal((nv, dv, dk)) * 0.1).astype(np.float32)) for i in range(nl)]
    rings = [cp.zeros((gdn.CONV_RING, cfg.gdn_conv_dim), np.uint16) for _ in range(nl)]
    pos = cp.asarray(np.array([7], np.int32))
    res = {}
    for M in (1, 4, 8):
        qkvM, zM, hM = (cp.asarray(cp.tile(x, (M, 1))) for x in (qkv, z, hn))
        outM = cp.zeros((M, cfg.gdn_value_dim), np.uint16)
        rows = []
        for r in range(3 * nl):
            st.fill(0)
            op(qkvM, zM, hM, rings[r % nl], states[r % nl], outM, pos, M)
            cp.cuda.Device().synchronize()
            if r >= nl:
                rows.append(st.get()[:len(PHASES)])
        d = np.median(np.diff(np.stack(rows), axis=1), axis=0)
        res[f"M{M}"] = {p: float(c) for p, c in zip(PHASES[1:], d)}
        res[f"M{M}"]["total"] = float(np.median([x[-1] - x[0] for x in rows]))
        print(f"M={M}: " + ", ".join(f"{p} {c:.0f}" for p, c in res[f"M{M}"].items()) + " cycles", flush=True)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "gdn_stamps.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
