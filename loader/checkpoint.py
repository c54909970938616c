"""Checkpoint reader: a directory with ``config.json`` and safetensors weights (``model.safetensors.index.json``
+ shards, or one ``*.safetensors`` file without an index, e.g. ``model.safetensors``), opened lazily through
memory maps and checked against the config.

Tensors come back in their stored dtype as NumPy arrays backed by the file's memory map (read-only; pages
are read when touched), so opening the 27B checkpoint never holds its 30 GB in RAM. Stored names are mapped
to canonical names (docs/INTERFACES.md §1): ``model.language_model.X`` → ``model.X``; ``model.X``,
``lm_head.weight`` and ``mtp.*`` stay; ``model.visual.*`` is ignored. Shapes and dtypes:
``shared/spec/qwen35-checkpoint.md`` §2; fp8 block dequantisation: §5.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Protocol, runtime_checkable

import ml_dtypes
import numpy as np

from loader.config import FULL, ConfigError, ModelConfig, _json_kind

BF16, FP8 = "bfloat16", "float8_e4m3fn"
INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
SCALE_SUFFIX = "_scale_inv"   # "<module>.weight" + this
MM_PREFIX, TEXT_PREFIX, VISION_PREFIX = "model.language_model.", "model.", "model.visual."
MAX_HEADER_BYTES = 100 << 20
PARTIAL_KEY = "qwen_mk_partial"  # index metadata key of a partial `make-checkpoint --max-shards` write (its reason)

# safetensors dtype strings <-> NumPy dtypes (only what a Qwen3.5 checkpoint may hold)
ST_DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
             "F32": np.dtype(np.float32), "F16": np.dtype(np.float16)}
ST_NAMES = {v.name: k for k, v in ST_DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint the engine cannot use; the message names the file, the tensor and what was expected."""


class CheckpointConfigError(CheckpointError, ConfigError):
    """config.json describes a model the engine does not implement (also a ConfigError)."""


@runtime_checkable
class WeightSource(Protocol):
    """Where the engine gets weights (docs/INTERFACES.md §1): canonical names, stored dtypes."""

    config: ModelConfig

    def names(self) -> list[str]:
        """Canonical names of every tensor, in model order."""
        ...

    def get(self, name: str) -> np.ndarray:
        """Tensor ``name`` in its stored dtype (fp8 e4m3fn or bf16). Raises KeyError naming it when absent."""
        ...


# ---------------------------------------------------------------------------------------------- expected tensors
def _layer_tensors(cfg: ModelConfig, p: str, kind: str, out: dict) -> None:
    h, f = cfg.hidden_size, cfg.intermediate_size
    w8 = FP8 if cfg.quant_method == "fp8" else BF16

    def lin(name: str, rows: int, cols: int) -> None:
        out[p + name + ".weight"] = ((rows, cols), w8)
        if w8 == FP8:
            out[p + name + ".weight" + SCALE_SUFFIX] = ((math.ceil(rows / 128), math.ceil(cols / 128)), BF16)

    out[p + "input_layernorm.weight"] = ((h,), BF16)
    if kind == FULL:
        lin("self_attn.q_proj", cfg.q_proj_rows, h)
        lin("self_attn.k_proj", cfg.kv_rows, h)
        lin("self_attn.v_proj", cfg.kv_rows, h)
        lin("self_attn.o_proj", h, cfg.attn_out_dim)
        out[p + "self_attn.q_norm.weight"] = ((cfg.head_dim,), BF16)
        out[p + "self_attn.k_norm.weight"] = ((cfg.head_dim,), BF16)
    else:
        nv = cfg.linear_num_value_heads
        lin("linear_attn.in_proj_qkv", cfg.gdn_conv_dim, h)
        lin("linear_attn.in_proj_z", cfg.gdn_value_dim, h)
        out[p + "linear_attn.in_proj_b.weight"] = ((nv, h), BF16)
        out[p + "linear_attn.in_proj_a.weight"] = ((nv, h), BF16)
        out[p + "linear_attn.conv1d.weight"] = ((cfg.gdn_conv_dim, 1, cfg.linear_conv_kernel_dim), BF16)
        out[p + "linear_attn.dt_bias"] = ((nv,), BF16)
        out[p + "linear_attn.A_log"] = ((nv,), BF16)
        out[p + "linear_attn.norm.weight"] = ((cfg.linear_value_head_dim,), BF16)
        lin("linear_attn.out_proj", h, cfg.gdn_value_dim)
    out[p + "post_attention_layernorm.weight"] = ((h,), BF16)
    lin("mlp.gate_proj", f, h)
    lin("mlp.up_proj", f, h)
    lin("mlp.down_proj", h, f)


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor a checkpoint of ``cfg`` holds, canonical name → (shape, dtype name), in model order:
    embedding, layers 0…L-1, final norm, lm_head, MTP. fp8 weights are followed by their ``weight_scale_inv``
    ([ceil(out/128), ceil(in/128)] bf16); with ``quant_method=None`` every tensor is bf16 and there are no
    scales. Vision tensors are not listed (the engine ignores them)."""
    h = cfg.hidden_size
    out: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((cfg.vocab_size, h), BF16)}
    for i, kind in enumerate(cfg.layer_types):
        _layer_tensors(cfg, f"model.layers.{i}.", kind, out)
    out["model.norm.weight"] = ((h,), BF16)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((cfg.vocab_size, h), BF16)
    if cfg.mtp_num_hidden_layers:
        out["mtp.fc.weight"] = ((h, 2 * h), BF16)
        out["mtp.pre_fc_norm_embedding.weight"] = ((h,), BF16)
        out["mtp.pre_fc_norm_hidden.weight"] = ((h,), BF16)
        for j in range(cfg.mtp_num_hidden_layers):
            _layer_tensors(cfg, f"mtp.layers.{j}.", FULL, out)
        out["mtp.norm.weight"] = ((h,), BF16)
    return out


def stored_name(cfg: ModelConfig, name: str) -> str:
    """The name a checkpoint in ``cfg``'s layout stores canonical tensor ``name`` under."""
    if cfg.multimodal and name.startswith(TEXT_PREFIX):
        return MM_PREFIX + name[len(TEXT_PREFIX):]
    return name


def canonical_name(stored: str) -> str | None:
    """Canonical name of a stored tensor name; None for vision tensors (ignored)."""
    if stored.startswith(VISION_PREFIX):
        return None
    if stored.startswith(MM_PREFIX):
        return TEXT_PREFIX + stored[len(MM_PREFIX):]
    return stored


def dequantize(w: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """NumPy reference of the fp8 block dequantisation (spec §5):
    ``W[n, k] = fp32(w[n, k]) · fp32(scale_inv[n // 128, k // 128])`` (a multiply: ``_inv`` is a legacy name).

    w: [N, K] float8_e4m3fn; scale_inv: [ceil(N/128), ceil(K/128)] bfloat16 (or float32). Returns float32
    [N, K]. Raises ValueError on wrong ranks, dtypes or a scale shape that does not match w."""
    if w.ndim != 2 or np.dtype(w.dtype) != np.dtype(ml_dtypes.float8_e4m3fn):
        raise ValueError(f"dequantize: w must be a 2-D float8_e4m3fn array, got {w.dtype} {w.shape}")
    want = (math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128))
    if scale_inv.shape != want:
        raise ValueError(f"dequantize: scale_inv shape {scale_inv.shape} does not match w {w.shape}: expected {want}")
    if np.dtype(scale_inv.dtype) not in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)):
        raise ValueError(f"dequantize: scale_inv must be bfloat16 or float32, got {scale_inv.dtype}")
    s = scale_inv.astype(np.float32)
    s = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[: w.shape[0], : w.shape[1]]
    return w.astype(np.float32) * s


# ---------------------------------------------------------------------------------------------- safetensors
def read_header(path: Path) -> tuple[dict[str, tuple[np.dtype, tuple[int, ...], int, int]], int]:
    """Parse a safetensors file's header. Returns ({stored name: (dtype, shape, start, end)}, data offset) with
    absolute byte offsets into the file. Raises CheckpointError naming the file and tensor for a malformed
    header, an unknown dtype, a size mismatch or a file shorter than its header says (truncated). A vision
    tensor (``model.visual.*``, ignored by the engine) of a dtype the engine does not know is listed with dtype
    None and offsets 0, unchecked."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path}: not a safetensors file (header length {n}, file size {size})")
            hdr = json.loads(fh.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard file is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from None
    base = 8 + n
    out = {}
    for name, info in hdr.items():
        if name == "__metadata__":
            continue
        st = info.get("dtype")
        if st not in ST_DTYPES and name.startswith(VISION_PREFIX):  # never read: its dtype does not matter
            out[name] = (None, tuple(int(d) for d in info.get("shape", ())), 0, 0)
            continue
        if st not in ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {st!r}; expected one of {sorted(ST_DTYPES)}")
        dt, shape = ST_DTYPES[st], tuple(int(d) for d in info["shape"])
        b, e = (int(x) for x in info["data_offsets"])
        if e - b != math.prod(shape) * dt.itemsize:
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {b}..{e} hold {e - b} bytes; shape {shape} "
                                  f"{st} needs {math.prod(shape) * dt.itemsize}")
        if base + e > size:
            raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte {base + e} but the file has "
                                  f"{size} bytes")
        out[name] = (dt, shape, base + b, base + e)
    return out, base


# ---------------------------------------------------------------------------------------------- the reader
class Checkpoint:
    """A checkpoint directory opened lazily (implements :class:`WeightSource`).

    ``Checkpoint.open(path)`` parses config.json and every shard header, maps stored names to canonical
    names and (by default) validates everything against :func:`expected_tensors`. ``get`` returns a
    read-only array backed by the shard's memory map; nothing is read until it is touched.
    """

    def __init__(self, path: Path, config: ModelConfig, entries: dict[str, tuple], warnings: list[str] | None = None):
        self.path, self.config = path, config
        self._entries = entries          # canonical -> (file, stored name, dtype, shape, start, end)
        self._maps: dict[Path, np.memmap] = {}
        self.warnings = list(warnings or [])  # what was tolerated (one line each); Engine.load prints them
        order = list(expected_tensors(config))
        self._names = [n for n in order if n in entries] + sorted(set(entries) - set(order))

    # -- WeightSource
    def names(self) -> list[str]:
        return list(self._names)

    def get(self, name: str) -> np.ndarray:
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor {name!r} in this checkpoint")
        f, _, dt, shape, b, e = self._entries[name]
        if f not in self._maps:
            self._maps[f] = np.memmap(f, dtype=np.uint8, mode="r")
        a = self._maps[f][b:e].view(dt).reshape(shape)
        if name.endswith(SCALE_SUFFIX) and dt == ST_DTYPES["F32"]:
            return self._scale_to_bf16(name, a)
        return a

    def _scale_to_bf16(self, name: str, v: np.ndarray) -> np.ndarray:
        """A float32 scale tensor as bfloat16 (DeepSeek's checkpoints store F32 scales; the engine's kernels read
        bf16). Exact or refused: raises CheckpointError naming the file, the tensor and the first finite value that
        bfloat16 does not hold (non-finite values pass through, for :meth:`validate` to report)."""
        f, s, *_ = self._entries[name]
        out = v.astype(ml_dtypes.bfloat16)
        back = out.astype(np.float32)
        bad = np.isfinite(v) & (back.view(np.uint32) != np.ascontiguousarray(v).view(np.uint32))
        if bad.any():
            i = tuple(int(x) for x in np.argwhere(bad)[0])
            raise CheckpointError(f"{f}: scale tensor {s!r} is F32 and {int(bad.sum())} of its {v.size} value(s) are "
                                  f"not exactly representable in bfloat16, first {float(v[i])!r} at block {i} (bfloat16 "
                                  f"rounds it to {float(back[i])!r}); expected BF16 scales, or F32 ones that bfloat16 "
                                  "holds exactly")
        out.flags.writeable = False
        return out

    def byte_range(self, name: str) -> tuple[Path, int, int] | None:
        """(shard path, first byte, end byte) of tensor ``name``'s bits in its file, when :meth:`get` returns them
        as stored; None when ``get`` converts them (an F32 scale, returned as bf16). Raises KeyError naming it."""
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor {name!r} in this checkpoint")
        f, _, dt, _, b, e = self._entries[name]
        if name.endswith(SCALE_SUFFIX) and dt == ST_DTYPES["F32"]:
            return None
        return f, b, e

    def file_of(self, name: str) -> tuple[Path, str]:
        """(shard path, stored name) of canonical tensor ``name``. Raises KeyError."""
        f, s, *_ = self._entries[name]
        return f, s

    # -- opening
    @classmethod
    def open(cls, path: str | Path, *, validate: bool = True) -> "Checkpoint":
        """Open the checkpoint directory ``path``. Raises CheckpointError (CheckpointConfigError for a config
        the engine does not implement) naming the file and tensor at fault."""
        root = Path(path)
        if not root.is_dir():
            raise CheckpointError(f"{root}: not a checkpoint directory")
        try:
            cfg = ModelConfig.from_file(root / "config.json")
        except ConfigError as e:
            raise CheckpointConfigError(str(e)) from None
        files = _shard_files(root)
        entries: dict[str, tuple] = {}
        for f, listed in files.items():
            header, _ = read_header(f)
            if listed is not None:
                absent, unlisted = sorted(listed - set(header)), sorted(set(header) - listed)
                if absent:
                    raise CheckpointError(f"{root / INDEX_FILE}: tensor {absent[0]!r} is mapped to "
                                          f"{f.relative_to(root)}, which does not hold it ({len(absent)} such "
                                          "tensor(s))")
                if unlisted:
                    raise CheckpointError(f"{f}: tensor {unlisted[0]!r} is not listed in {INDEX_FILE}")
            for s, (dt, shape, b, e) in header.items():
                c = canonical_name(s)
                if c is None:
                    continue
                if c in entries:
                    raise CheckpointError(f"{f}: tensor {s!r} duplicates {entries[c][1]!r} in "
                                          f"{entries[c][0].relative_to(root)} (both are {c!r})")
                entries[c] = (f, s, dt, shape, b, e)
        cfg, warns = _without_absent_mtp(root, cfg, entries)
        ck = cls(root, cfg, entries, warns)
        if validate:
            ck.validate()
        return ck

    def validate(self) -> None:
        """Check names, shapes, dtypes, scale pairing and scale values against the config. Raises
        CheckpointError on the first problem: config.json's quantisation against the shards first (see
        :meth:`_check_quantization`), then unexpected or unused tensors, then the expected tensors in model order."""
        want = expected_tensors(self.config)
        self._check_quantization(want)
        for c, (f, s, dt, shape, _, _) in self._entries.items():
            if c in want:
                continue
            if c.endswith(SCALE_SUFFIX):
                w = c[: -len(SCALE_SUFFIX)]
                why = f"weight {w!r} is expected in {want[w][1]}" if w in want else f"there is no weight {w!r}"
                raise CheckpointError(f"{f}: scale tensor {s!r} is not used: {why}")
            raise CheckpointError(f"{f}: unexpected tensor {s!r} (canonical {c!r}) for this config")
        for c, (shape, dtn) in want.items():
            if c not in self._entries:
                if c.endswith(SCALE_SUFFIX):
                    w = c[: -len(SCALE_SUFFIX)]
                    wf = self._entries[w][0] if w in self._entries else self.path
                    raise CheckpointError(f"{wf}: fp8 weight {stored_name(self.config, w)!r} has no scale tensor "
                                          f"{stored_name(self.config, c)!r}")
                absent = [n for n in want if n not in self._entries]
                more = (f"; {len(absent)} of the {len(want)} expected tensors are missing, the last "
                        f"{stored_name(self.config, absent[-1])!r}") if len(absent) > 1 else ""
                raise CheckpointError(f"{self.path}: incomplete checkpoint: missing tensor "
                                      f"{stored_name(self.config, c)!r} (expected {dtn} {shape}){more}")
            f, s, dt, got, _, _ = self._entries[c]
            if c.endswith(SCALE_SUFFIX) and dt == ST_DTYPES["F32"] and dtn == BF16:
                dt = ST_DTYPES["BF16"]  # converted exactly by get() (checked below, as every scale is read)
            if dt.name != dtn or got != shape:
                raise CheckpointError(f"{f}: tensor {s!r}: expected {ST_NAMES[dtn]} {shape}"
                                      f", got {ST_NAMES.get(dt.name, dt.name)} {got}")
            if c.endswith(SCALE_SUFFIX):
                v = self.get(c).astype(np.float32)
                bad = ~np.isfinite(v)
                if bad.any():
                    i = tuple(int(x) for x in np.argwhere(bad)[0])
                    raise CheckpointError(f"{f}: scale tensor {s!r} holds {int(bad.sum())} non-finite value(s), "
                                          f"first {v[i]} at block {i}; expected finite scales")

    def _check_quantization(self, want: dict[str, tuple[tuple[int, ...], str]]) -> None:
        """Raise CheckpointConfigError naming config.json when its quantisation does not fit: fp8 tensors in the
        shards but no ``quantization_config`` (else every fp8 weight or scale would be blamed on its shard), or a
        ``modules_to_not_convert`` entry covering a module the engine loads as fp8 (HF would load that one
        unquantised). An entry covers a module when it is a substring of the module's dotted name, stored
        (``model.language_model.layers.0.mlp.gate_proj``) or canonical (``model.layers.0.mlp.gate_proj``): HF's
        FP8 integration skips a linear when ``any(key in name for key in modules_to_not_convert)``, so ``mlp``,
        ``layers.1`` or ``proj`` cover fp8 modules as ``gate_proj`` does. The real list names only bf16 modules
        by full name (spec §1.2), none of them inside an fp8 module's name."""
        cj = self.path / "config.json"
        if self.config.quant_method is None:
            fp8 = [(f, s) for f, s, dt, *_ in self._entries.values() if dt.name == FP8]
            if fp8:
                scales = sum(s.endswith(SCALE_SUFFIX) for _, s, *_ in self._entries.values())
                f, s = fp8[0]
                raise CheckpointConfigError(
                    f"{cj}: 'quantization_config' is missing but the shards hold fp8 e4m3 weights ({len(fp8)} F8_E4M3 "
                    f"tensor(s), {scales} weight{SCALE_SUFFIX} tensor(s), e.g. {s!r} in {f.relative_to(self.path)}); "
                    "expected an fp8 quantization_config (quant_method 'fp8', fmt 'e4m3', weight_block_size "
                    "[128, 128]), or bfloat16 weights without one")
            return
        fp8 = [c[: -len(".weight")] for c, (_, dtn) in want.items() if dtn == FP8]
        fp8 = [(stored_name(self.config, m), m) for m in fp8]  # (stored, canonical) name of every fp8 module
        first = {e: next((sm for sm, m in fp8 if e in sm or e in m), None) for e in self.config.modules_to_not_convert}
        hits = [(e, sm) for e, sm in first.items() if sm is not None]
        if hits:
            (e, sm), n = hits[0], len(hits)
            raise CheckpointConfigError(
                f"{cj}: config field 'quantization_config.modules_to_not_convert' lists {e!r}, which covers "
                f"{sm!r} ({n} such entr{'y' if n == 1 else 'ies'}); the engine loads that module as fp8 e4m3 with "
                "128x128 block scales: expected only bfloat16 modules (embeddings, norms, lm_head, in_proj_a/b, "
                "conv1d, mtp.fc, vision), as HF leaves unquantised every module whose dotted name contains an entry")


def _without_absent_mtp(root: Path, cfg: ModelConfig, entries: dict) -> tuple[ModelConfig, list[str]]:
    """(config, warnings): a checkpoint whose config.json promises an MTP head (``mtp_num_hidden_layers`` 1) but
    that holds no ``mtp.*`` tensor at all, while every other expected tensor is there (a release that stripped the
    head, a text-only conversion), loads as a model without one (``mtp_num_hidden_layers`` 0), with a warning:
    speculative decoding is then off (``host.speculate.unavailable``). A partial ``mtp.*`` set, or one missing with
    other tensors missing too, stays an incomplete checkpoint (:meth:`Checkpoint.validate`)."""
    if not cfg.mtp_num_hidden_layers or any(c.startswith("mtp.") for c in entries):
        return cfg, []
    want = expected_tensors(cfg)
    if any(c not in entries for c in want if not c.startswith("mtp.")):
        return cfg, []
    n = sum(c.startswith("mtp.") for c in want)
    return cfg.replace(mtp_num_hidden_layers=0), [
        f"{root}: no mtp.* tensors (config.json's mtp_num_hidden_layers {cfg.mtp_num_hidden_layers} expects the MTP "
        f"head's {n}): loaded without the MTP head; speculative decoding is off"]


def _shard_files(root: Path) -> dict[Path, set[str] | None]:
    """Shard path -> stored names the index maps to it (None for a single-file checkpoint without an index).

    With ``model.safetensors.index.json`` (HF's sharded layout) the index decides: every file it names must be
    there, else the checkpoint is incomplete (a ``qwen-mk make-checkpoint --max-shards`` write, an interrupted
    download) and the error lists the absent files. Without an index the directory must hold exactly one
    ``*.safetensors`` file (``model.safetensors``, or e.g. ``model-00001-of-00001.safetensors``): its header is
    the tensor map (hidden files, e.g. macOS ``._*`` copies, are not counted). Several files without an index are
    refused (which file holds what is the index's job). An index entry that is not a relative file name inside
    the directory is refused (see :func:`_index_entry`), as is one naming a subdirectory."""
    idx = root / INDEX_FILE
    if idx.is_file():
        try:
            index = json.loads(idx.read_text())
            wm = index["weight_map"]
            files: dict[Path, set[str]] = {}
            written: dict[Path, str] = {}  # shard path -> its entry as the index writes it (for messages)
            for name, fn in wm.items():
                f = _index_entry(root, idx, name, fn)
                files.setdefault(f, set()).add(name)
                written.setdefault(f, fn)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{idx}: expected a JSON object with a 'weight_map' object of tensor name -> "
                                  f"shard file name ({e!r})") from None
        dirs = sorted(f for f in files if f.is_dir())
        if dirs:
            f = dirs[0]
            raise CheckpointError(f"{idx}: tensor {sorted(files[f])[0]!r} is mapped to {written[f]!r}, which is a "
                                  "directory, not a shard file; expected a shard file name relative to the checkpoint "
                                  f"directory {root}")
        absent = sorted(f for f in files if not f.is_file())
        if absent:
            listed = "; ".join(f"{written[f]!r} ({len(files[f])} tensor(s), e.g. {sorted(files[f])[0]!r})"
                               for f in absent[:4]) + (f"; and {len(absent) - 4} more" if len(absent) > 4 else "")
            meta = index.get("metadata") if isinstance(index, dict) else None
            partial = meta.get(PARTIAL_KEY) if isinstance(meta, dict) else None
            raise CheckpointError(
                f"{root}: incomplete checkpoint: {len(absent)} of {len(files)} shard file(s) listed in {INDEX_FILE} "
                f"{'is' if len(absent) == 1 else 'are'} missing: {listed}"
                + (f" (a partial write: {partial})" if partial else ""))
        return dict(files)
    found = sorted(p for p in root.glob("*.safetensors") if p.is_file() and not p.name.startswith("."))
    if len(found) == 1:
        return {found[0]: None}
    if not found:
        raise CheckpointError(f"{root}: neither {INDEX_FILE} nor {SINGLE_FILE} found (expected the index with "
                              "its shards, or exactly one *.safetensors file)")
    names = ", ".join(p.name for p in found[:4]) + (f", … ({len(found)} in all)" if len(found) > 4 else "")
    raise CheckpointError(f"{root}: {len(found)} *.safetensors files ({names}) but no {INDEX_FILE}: a checkpoint of "
                          f"several shards needs its index (tensor name -> shard file); without one exactly one "
                          "*.safetensors file is expected")


def _index_entry(root: Path, idx: Path, name: str, fn: object) -> Path:
    """Path of the shard the index maps tensor ``name`` to (entry ``fn``, relative to ``root``). Raises
    CheckpointError naming the index, the tensor and the entry as written (``repr``) when the entry is not a string
    (or holds a NUL), is absolute (inside ``root`` or not: absolute paths are not allowed), names ``root`` itself
    (``""``, ``"."``), or leaves ``root`` (``..`` past the top, or through a symlinked directory). A symlinked
    shard file is followed (HF's hub cache links every file to its blob store); a subdirectory inside ``root`` is
    allowed."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{idx}: tensor {name!r} is mapped to {fn!r}, {why}; expected a shard file name "
                               f"relative to the checkpoint directory {root}")

    if not isinstance(fn, str):
        raise CheckpointError(f"{idx}: tensor {name!r} is mapped to {json.dumps(fn)} (a JSON {_json_kind(fn)}); "
                              "expected a shard file name string")
    if "\0" in fn:
        raise bad("which holds a NUL character")
    if os.path.isabs(fn):
        raise bad("an absolute path (absolute paths are not allowed)")
    norm = os.path.normpath(fn)
    if norm == os.curdir:
        raise bad("which names the checkpoint directory itself, not a shard file")
    real = os.path.realpath(os.path.dirname(os.path.join(root, fn)))
    top = os.path.realpath(root)
    if norm == os.pardir or norm.startswith(os.pardir + os.sep) or os.path.commonpath([real, top]) != top:
        raise CheckpointError(f"{idx}: tensor {name!r} is mapped to {fn!r}, which is outside the checkpoint "
                              f"directory {root}; expected a shard file name relative to it")
    return root / fn
