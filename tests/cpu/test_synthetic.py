"""Synthetic weights: the hash generator (NumPy vs a scalar Python spec vs the CUDA header compiled for the
host), block quantisation, the written checkpoint vs SyntheticWeights, the config files, and the cache."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import zlib

import ml_dtypes
import numpy as np
import pytest

from discrete.build import KERNEL_DIR
from loader import hashgen, synthetic
from loader.checkpoint import FP8, Checkpoint, WeightSource, dequantize, expected_tensors
from loader.config import ModelConfig, preset
from tests.tolerance import bits

TINY = preset("tiny")
BF16_T, FP8_T = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)


def rng(tag: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(tag.encode()))


# ------------------------------------------------------------------ scalar Python specification of the generator
def _f(x) -> np.float32:
    return np.float32(x)


def scalar_value(key: int, kind: int, a: np.float32, b: np.float32, idx: int) -> np.float32:
    """One element, written from the module docstring with Python ints and np.float32 scalar ops."""
    h = hashgen.mix64_int(key + (idx + 1) * hashgen.GOLDEN)
    if kind == hashgen.NORMAL:
        c = sum((h >> s) & 0xFFFF for s in (0, 16, 32, 48)) - 131070
        return _f(_f(c) * a) + b
    u = _f(h >> 40) * _f(2.0 ** -24)
    x = _f(u * a) + b
    if kind == hashgen.UNIFORM:
        return x
    xb = struct.unpack("<I", struct.pack("<f", x))[0]
    e, m = (xb >> 23) - 127, struct.unpack("<f", struct.pack("<I", (xb & 0x7FFFFF) | 0x3F800000))[0]
    m = _f(m)
    if m > hashgen.SQRT2:
        m, e = _f(m * _f(0.5)), e + 1
    t = _f(m - _f(1)) / _f(m + _f(1))
    t2, p = _f(t * t), _f(1 / 9)
    for k in (7, 5, 3, 1):
        p = _f(_f(p * t2) + _f(1 / k))
    return _f(_f(e) * hashgen.LN2) + _f(_f(t * p) * _f(2))


def test_mix64_reference_vector():
    # splitmix64 seeded with 0 (Vigna's splitmix64.c): first output 0xE220A8397B1DCDAF
    assert hashgen.mix64_int(hashgen.GOLDEN) == 0xE220A8397B1DCDAF
    assert int(hashgen.hash_at(0, np.array([0]))[0]) == 0xE220A8397B1DCDAF


@pytest.mark.parametrize("kind,a,b", [(hashgen.NORMAL, 0.013, 0.0), (hashgen.NORMAL, 0.1, 1.0),
                                      (hashgen.UNIFORM, 1.0, -0.5), (hashgen.LOG_UNIFORM, 15.0, 1.0)],
                         ids=["normal", "normal_offset", "uniform", "log_uniform"])
def test_numpy_matches_scalar_spec(kind, a, b):
    r = rng(f"scalar{kind}{a}")
    key = hashgen.tensor_key(int(r.integers(0, 2**63)), f"t{kind}")
    idx = np.concatenate([np.arange(20), r.integers(0, 2**41, 300), [2**40 - 1, 2**33 + 7]]).astype(np.uint64)
    a32, b32 = np.float32(a), np.float32(b)
    got = hashgen.values(key, kind, a32, b32, idx)
    want = np.array([scalar_value(key, kind, a32, b32, int(i)) for i in idx], np.float32)
    assert np.array_equal(bits(got), bits(want))
    planted = want.copy()
    planted[5] = np.nextafter(planted[5], np.float32(np.inf))
    assert not np.array_equal(bits(got), bits(planted))  # negative control: one ulp is visible


def test_log_series_accuracy():
    x = np.linspace(1.0, 16.0, 100_001, dtype=np.float32)
    err = np.abs(hashgen._log_f32(x).astype(np.float64) - np.log(x.astype(np.float64)))
    assert err.max() < 1e-6  # fp32 rounding of ~ten ops on values up to 2.8; series error < 1e-8
    assert not (np.abs(hashgen._log_f32(x * np.float32(1.01)) - np.log(x)) < 1e-6).all()  # negative control


def test_distributions():
    n = np.arange(400_000, dtype=np.uint64)
    key = hashgen.tensor_key(3, "dist")
    z = hashgen.values(key, *synthetic._normal(0.02), n)
    assert abs(z.std() / 0.02 - 1) < 0.01 and abs(z.mean()) < 1e-4 and np.abs(z).max() <= 0.02 * 2 * 3 ** 0.5
    k, a, b = synthetic.init_params("model.layers.0.linear_attn.A_log", (6,), TINY)
    al = hashgen.values(key, k, a, b, n)
    assert al.min() >= 0 and al.max() < np.log(16) + 1e-6
    assert abs(np.exp(al.astype(np.float64)).mean() - 8.5) < 0.05  # A = exp(A_log) ~ U(1, 16)
    dt = hashgen.values(key, *synthetic.init_params("model.layers.0.linear_attn.dt_bias", (6,), TINY), n)
    sp = np.log1p(np.exp(dt.astype(np.float64)))  # softplus(dt_bias) = dt, log-uniform in [1e-3, 0.1]
    assert sp.min() >= 0.001 * 0.999 and sp.max() <= 0.1
    assert abs(np.median(dt) - np.mean(synthetic.DT_BIAS_RANGE)) < 0.02


# ------------------------------------------------------------------ the CUDA header, compiled for the host
HARNESS = r"""
#include "hashgen.cuh"
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
// vals KEY KIND ABITS BBITS START N  -> N float32 | cvt N (stdin N float32) -> N bf16 + N e4m3
// fp8 KEY KIND ABITS BBITS ROWS COLS -> q bytes + scale bf16 (same block logic as qmk_hash_fill_fp8)
int main(int argc, char** argv) {
    std::string mode = argv[1];
    if (mode == "cvt") {
        size_t n = strtoull(argv[2], 0, 10); std::vector<float> x(n); fread(x.data(), 4, n, stdin);
        for (size_t i = 0; i < n; i++) { unsigned short h = qmk_f32_to_bf16(x[i]); fwrite(&h, 2, 1, stdout); }
        for (size_t i = 0; i < n; i++) { unsigned char q = qmk_f32_to_e4m3(x[i]); fwrite(&q, 1, 1, stdout); }
        return 0;
    }
    qmk_u64 key = strtoull(argv[2], 0, 10); int kind = atoi(argv[3]);
    float a = qmk_u2f((qmk_u32)strtoul(argv[4], 0, 10)), b = qmk_u2f((qmk_u32)strtoul(argv[5], 0, 10));
    if (mode == "vals") {
        qmk_u64 start = strtoull(argv[6], 0, 10), n = strtoull(argv[7], 0, 10);
        for (qmk_u64 i = 0; i < n; i++) {
            float v = qmk_hash_value(key, kind, a, b, start + i);
            fwrite(&v, 4, 1, stdout);
        }
        return 0;
    }
    int rows = atoi(argv[6]), cols = atoi(argv[7]), br = (rows + 127) / 128, bc = (cols + 127) / 128;
    std::vector<unsigned char> q((size_t)rows * cols); std::vector<unsigned short> s(br * bc);
    for (int by = 0; by < br; by++) for (int bx = 0; bx < bc; bx++) {
        int r1 = by * 128 + 128 < rows ? by * 128 + 128 : rows, c1 = bx * 128 + 128 < cols ? bx * 128 + 128 : cols;
        float amax = 0.0f;
        for (int r = by * 128; r < r1; r++) for (int c = bx * 128; c < c1; c++)
            amax = fmaxf(amax, fabsf(qmk_hash_value(key, kind, a, b, (qmk_u64)r * cols + c)));
        unsigned short sb = s[by * bc + bx] = qmk_block_scale(amax);
        for (int r = by * 128; r < r1; r++) for (int c = bx * 128; c < c1; c++)
            q[(size_t)r * cols + c] = qmk_quantize_e4m3(qmk_hash_value(key, kind, a, b, (qmk_u64)r * cols + c), sb);
    }
    fwrite(q.data(), 1, q.size(), stdout); fwrite(s.data(), 2, s.size(), stdout);
    return 0;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++) to build the hashgen.cuh harness")
    d = tmp_path_factory.mktemp("hashgen_host")
    (d / "h.cpp").write_text(HARNESS)
    cc = subprocess.run([cxx, "-O2", "-std=c++17", "-I", str(KERNEL_DIR), "-o", str(d / "h"), str(d / "h.cpp")],
                        capture_output=True, text=True)
    assert cc.returncode == 0, f"hashgen.cuh does not build for the host:\n{cc.stderr}"

    def run(*args, stdin: bytes = b"") -> bytes:
        return subprocess.run([str(d / "h"), *map(str, args)], input=stdin, capture_output=True, check=True).stdout
    return run


def _u32(x) -> int:
    return int(np.float32(x).view(np.uint32))


@pytest.mark.parametrize("name", ["model.layers.0.mlp.down_proj.weight", "model.layers.1.linear_attn.A_log",
                                  "model.layers.2.linear_attn.dt_bias", "model.layers.0.linear_attn.conv1d.weight",
                                  "model.layers.3.self_attn.q_norm.weight"])
def test_cuda_header_values_match_numpy(harness, name):
    r = synthetic.SyntheticWeights(TINY, 7).recipe(name)
    start = int(rng(name).integers(0, 2**36))
    got = np.frombuffer(harness("vals", r.key, r.kind, _u32(r.a), _u32(r.b), start, 5000), np.float32)
    want = hashgen.fill(r.key, r.kind, r.a, r.b, (5000,), start)
    assert np.array_equal(bits(got), bits(want))


def test_cuda_header_conversions_match_ml_dtypes(harness):
    r = rng("cvt")
    # every e4m3/bf16 rounding boundary region: random bit patterns in ±[2^-12, 448], plus exact ties
    mag = r.integers(_u32(2.0 ** -12), _u32(448.0) + 1, 400_000).astype(np.uint32).view(np.float32)
    e4 = np.arange(256, dtype=np.uint8).view(FP8_T).astype(np.float32)
    e4 = e4[np.isfinite(e4)]
    ties = (e4[:-1] + e4[1:]) / 2
    x = np.concatenate([mag, -mag, e4, ties, [0.0, -0.0, 448.0, -448.0, 2.0 ** -10, 2.0 ** -6]]).astype(np.float32)
    out = harness("cvt", x.size, stdin=x.tobytes())
    bf = np.frombuffer(out[: 2 * x.size], np.uint16)
    q = np.frombuffer(out[2 * x.size:], np.uint8)
    assert np.array_equal(bf, bits(x.astype(ml_dtypes.bfloat16)))
    assert np.array_equal(q, bits(x.astype(ml_dtypes.float8_e4m3fn)))


def test_cuda_header_fp8_blocks_match_numpy(harness):
    cfg = TINY
    src = synthetic.SyntheticWeights(cfg, 11)
    r = src.recipe("model.layers.0.linear_attn.in_proj_z.weight")
    # a partial edge block (200 x 300) as well as the real shape
    for rows, cols in ((200, 300), r.shape):
        out = harness("fp8", r.key, r.kind, _u32(r.a), _u32(r.b), rows, cols)
        q = np.frombuffer(out[: rows * cols], np.uint8).reshape(rows, cols)
        s = np.frombuffer(out[rows * cols:], np.uint16)
        wq, ws = hashgen.quantize_blocks(hashgen.fill(r.key, r.kind, r.a, r.b, (rows, cols)))
        assert np.array_equal(q, bits(wq)) and np.array_equal(s, bits(ws).reshape(-1))


# ------------------------------------------------------------------ block quantisation
def test_quantize_blocks_scale_to_fit():
    r = rng("quant")
    w = (r.standard_normal((300, 260)) * np.exp(r.uniform(-6, 2, (300, 1)))).astype(np.float32)
    w[:128, :128] = 0  # an all-zero block gets scale 0 and q 0
    q, s = hashgen.quantize_blocks(w)
    assert q.shape == w.shape and s.shape == (3, 3) and s.dtype == BF16_T and q.dtype == FP8_T
    assert float(s[0, 0]) == 0 and not np.any(q[:128, :128].astype(np.float32))
    qa = np.abs(q.astype(np.float32))
    for i in range(3):
        for j in range(3):
            blk = qa[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert (i, j) == (0, 0) or blk.max() == 448.0  # the block's amax lands on the top code
    back = dequantize(q, s)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, absolute <= 2^-10·scale for subnormals
    sf = np.repeat(np.repeat(s.astype(np.float32), 128, 0), 128, 1)[:300, :260]
    tol = np.maximum(np.abs(w) * 2.0 ** -4, sf * 2.0 ** -10) * 1.0001
    assert np.all(np.abs(back - w) <= tol)
    planted = back.copy()
    planted[200, 200] += 3 * tol[200, 200]
    assert not np.all(np.abs(planted - w) <= tol)  # negative control


# ------------------------------------------------------------------ the written checkpoint
def test_written_tiny_matches_synthetic_weights(tiny_ckpt):
    ck = Checkpoint.open(tiny_ckpt)
    src = synthetic.SyntheticWeights(TINY, 0)
    assert isinstance(ck, WeightSource) and isinstance(src, WeightSource) and src.config == ck.config.replace(name="tiny")
    assert ck.names() == src.names() == list(expected_tensors(TINY))
    for n in ck.names():
        a, b = ck.get(n), src.get(n)
        assert a.dtype == b.dtype and a.shape == b.shape, n
        assert np.array_equal(bits(a), bits(b)), n
    assert not np.array_equal(bits(synthetic.SyntheticWeights(TINY, 1).get("model.norm.weight")),
                              bits(ck.get("model.norm.weight")))  # another seed gives other weights


def test_config_files(tiny_ckpt):
    cj = json.loads((tiny_ckpt / "config.json").read_text())
    assert cj["architectures"] == ["Qwen3_5ForConditionalGeneration"] and cj["model_type"] == "qwen3_5"
    assert cj["text_config"] == TINY.to_text_config()
    assert cj["vision_config"]["out_hidden_size"] == TINY.hidden_size and cj["vision_config"]["depth"] == 27
    q = cj["quantization_config"]
    assert (q["activation_scheme"], q["fmt"], q["quant_method"], q["weight_block_size"]) == ("dynamic", "e4m3", "fp8",
                                                                                                 [128, 128])
    exp = expected_tensors(TINY)
    bf16_modules = {("model.language_model." + n[6:] if n.startswith("model.") else n)[:-7]
                    for n, (_, dt) in exp.items() if dt == "bfloat16" and n.endswith(".weight")}
    assert set(q["modules_to_not_convert"]) == bf16_modules and len(q["modules_to_not_convert"]) == len(bf16_modules)
    assert "mtp.fc" in bf16_modules and "lm_head" in bf16_modules
    assert not any(n + ".weight" in exp and exp[n + ".weight"][1] == FP8 for n in q["modules_to_not_convert"])
    parsed = ModelConfig.from_file(tiny_ckpt)
    assert parsed.replace(name="tiny") == TINY
    gc = json.loads((tiny_ckpt / "generation_config.json").read_text())
    assert gc["eos_token_id"] == [248046, 248044] and (gc["temperature"], gc["top_k"], gc["top_p"]) == (0.6, 20, 0.95)
    idx = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    assert set(idx["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    assert idx["metadata"]["total_size"] == sum(a.nbytes for a in map(Checkpoint.open(tiny_ckpt).get, exp))
    assert sum(n.startswith("mtp.") for n in idx["weight_map"]) == 22
    tc = json.loads((tiny_ckpt / "tokenizer_config.json").read_text())  # written by loader.tokenizer
    assert (tiny_ckpt / "tokenizer.json").is_file() and "chat_template" in tc


def test_sharded_parallel_write_matches(tmp_path, tiny_ckpt):
    """Shards of <= 40 MB written by 2 worker processes hold the same tensors as the cached tiny checkpoint."""
    res = synthetic.write_checkpoint(TINY, tmp_path / "sh", 0, tokenizer="skip", max_shard_bytes=40_000_000, workers=2)
    files = sorted(p.name for p in (tmp_path / "sh").glob("*.safetensors"))
    assert res["shards"] == len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    ck, ref = Checkpoint.open(tmp_path / "sh"), Checkpoint.open(tiny_ckpt)
    per_file = {}
    for n in ck.names():
        assert np.array_equal(bits(ck.get(n)), bits(ref.get(n))), n
        per_file.setdefault(ck.file_of(n)[0], []).append(n)
    for f, names in per_file.items():  # a shard exceeds the limit only when it holds one tensor that does
        assert f.stat().st_size <= 40_000_000 or len(names) == 1, (f, names)
    w = "model.layers.7.mlp.down_proj.weight"
    assert ck.file_of(w)[0] == ck.file_of(w + "_scale_inv")[0]  # a weight and its scale share a shard
    with pytest.raises(ValueError, match="single_file"):
        synthetic.write_checkpoint(TINY, tmp_path / "x", 0, tokenizer="skip", max_shard_bytes=40_000_000,
                                   single_file=True)


def test_ensure_checkpoint_caches_and_rewrites(tmp_path, monkeypatch):
    calls = []

    def fake_write(cfg, out, seed, tokenizer, progress=None):
        calls.append((cfg.name, seed))
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(synthetic, "write_checkpoint", fake_write)
    p = synthetic.ensure_checkpoint("tiny", 3, tmp_path)
    assert p == tmp_path / "ckpt-tiny-seed3" and calls == [("tiny", 3)]
    assert synthetic.ensure_checkpoint("tiny", 3, tmp_path) == p and len(calls) == 1  # cached
    monkeypatch.setattr(synthetic, "generator_hash", lambda: "changed-source")
    assert synthetic.ensure_checkpoint("tiny", 3, tmp_path) == p and len(calls) == 2  # stale stamp: rewritten
    assert (p / synthetic.STAMP).read_text().strip() == "changed-source"
    assert not list(tmp_path.glob(".tmp-*"))
