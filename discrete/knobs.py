"""The registry of every ``QMK_*`` compile-time define of the CUDA sources: its default, values, the sources that
read it, why it exists and which Python code passes it.

Kinds:

* ``knob``: an overridable build knob, ``#ifndef QMK_X`` / ``#define QMK_X <default>`` in the source; a launcher,
  benchmark or tool may pass another value. None changes a result (the bit-identity gates check it).
* ``flag``: ``#ifdef QMK_X``; off unless a Python code path defines it (a debug or layout-check build).
* ``required``: ``#ifndef QMK_X`` / ``#error`` in the source; the translation unit must define it.
* ``config``: generated from the ModelConfig by ``discrete.build`` (every translation unit has them).
* ``layout``: generated from a host-side NumPy dtype or source hash (control block, MkParams), so host and
  device agree on offsets.
* ``launch``: read by a Python launcher from its ``defines`` dict; never reaches the compiler.

``tests/cpu/test_knobs.py`` parses every ``#ifndef``/``#ifdef QMK_*`` of ``discrete/kernels`` and ``megakernel``
and every define the Python code passes, and fails on an unregistered name, a stale entry or a default that
differs from the source. ``docs/knobs.md`` is generated from this table: ``python3 -m discrete.knobs > docs/knobs.md``.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

KINDS = ("knob", "flag", "required", "config", "layout", "launch")


@dataclass(frozen=True)
class Knob:
    """One ``QMK_*`` define. ``default``: the source's default text (``#define`` right-hand side, comment
    stripped) for ``knob``; None for the other kinds. ``values``: type and admissible range, in words.
    ``sources``: repository paths that read it. ``set_by``: Python code paths (``path`` or ``path:function``)
    that pass it; a ``knob`` with none would be dead. ``why``: what it is for (and what it measured)."""

    name: str
    kind: str
    default: str | None
    values: str
    sources: tuple[str, ...]
    set_by: tuple[str, ...]
    why: str


_K = "discrete/kernels/"
_MK = "megakernel/megakernel.cu"
_GEMV_BENCH = "bench/bench_gemv.py"
_VARIANTS = "tools/mk_variants.py"
_RUNNER = "megakernel/build.py:kernel_defines"

KNOBS: tuple[Knob, ...] = (
    # ---------------------------------------------------------------- discrete kernels (shared with the megakernel)
    Knob("QMK_PAGE", "knob", "256", "int, tokens per KV page", (_K + "attention.cuh",),
         ("discrete/attention.py:extra_defines",), "KV page size; the launcher passes the page pool's value"),
    Knob("QMK_MAX_ROWS", "knob", "8", "int, 1..8", (_K + "attention.cuh", _K + "gdn.cuh"),
         ("discrete/attention.py:extra_defines", "discrete/gdn.py:extra_defines"),
         "rows a verify step carries (assembler.numerics.MAX_ROWS); gemv.cuh defines the same value unconditionally"),
    Knob("QMK_ATTN_PARTS", "knob", "(132 / QMK_N_KV_HEADS)", "int ≥ 1", (_K + "attention.cuh",),
         ("discrete/attention.py:extra_defines",),
         "attention partitions per KV head (assembler.numerics.attn_partitions)"),
    Knob("QMK_ATTN_SCALE", "knob", "(1.0f / __fsqrt_rn((float)QMK_HEAD_DIM))", "fp32 literal",
         (_K + "attention.cuh",), ("discrete/attention.py:extra_defines",),
         "fp32(head_dim^-0.5) as a hex-exact literal from the launcher, so every path uses the reference's bits"),
    Knob("QMK_CONV_RING", "knob", "16", "power of two ≥ QMK_MAX_ROWS + 3", (_K + "gdn.cuh",),
         ("discrete/gdn.py:extra_defines",), "slots of the GDN conv-state ring"),
    Knob("QMK_GDN_QDIV", "knob", "__fsqrt_rn((float)QMK_GDN_DK)", "fp32 literal", (_K + "gdn.cuh",),
         ("discrete/gdn.py:extra_defines",), "fp32(sqrt(d_k)), the recurrent rule's divisor, as the reference's bits"),
    Knob("QMK_LD_L2_PREFETCH", "knob", "0", "0, 128 or 256 (bytes)", (_K + "common.cuh",),
         ("discrete/lm_head.py:DEFAULT_DEFINES", _GEMV_BENCH),
         "L2 prefetch-size hint of the streamed weight loads; the lm_head builds with 256 (measured faster there), "
         "bench_gemv A/Bs 0"),
    Knob("QMK_GEMV_STAGES", "knob", "2", "int ≥ 1, units in flight per warp", (_K + "gemv.cuh",),
         ("discrete/lm_head.py:DEFAULT_DEFINES", _GEMV_BENCH),
         "depth of the GEMV register pipeline; bench_gemv A/Bs 3 for the lm_head"),
    Knob("QMK_GEMV_X_MASK", "knob", "0", "0 (clamped row loads) or 2 (row-0 loads, masked)", (_K + "gemv.cuh",),
         (_GEMV_BENCH,), "how lanes past M load activations; bench_gemv A/Bs 2 for the lm_head"),
    Knob("QMK_GEMV_RING_MAX", "knob", "0", "0 or 2..8 (ring units per warp)", (_K + "gemv.cuh",),
         ("discrete/gemv.py:Gemv",),
         "the general GEMV kernels' shared-memory weight ring (0: the register-ring tile, measured faster); "
         "discrete/gemv.py reads it from its defines to size the ring"),
    Knob("QMK_TOPK", "knob", "32", "power of two, QMK_TOPK² ≤ 1024", (_K + "lm_head.cuh",),
         ("discrete/lm_head.py", "megakernel/warm.py:warm_jobs"), "head candidates kept per block for top-k"),
    Knob("QMK_LMH_MIN_BLOCKS", "knob", "4", "int ≥ 1", (_K + "lm_head.cuh",), (_GEMV_BENCH,),
         "__launch_bounds__ min blocks of the lm_head kernel; bench_gemv A/Bs 3"),
    Knob("QMK_SAMPLE_THREADS", "knob", "256", "int, multiple of 32", (_K + "sample.cuh",),
         ("discrete/sampling.py",), "threads per block of the sampling kernel (discrete/sampling.py THREADS)"),
    Knob("QMK_SAMPLE_PER", "knob", "8", "int ≥ 1", (_K + "sample.cuh",), ("discrete/sampling.py",),
         "scores per sampling thread, held in registers (discrete/sampling.py PER)"),
    Knob("QMK_VALID_VOCAB", "config", None, "int ≤ QMK_VOCAB", (_K + "lm_head.cuh", _MK),
         ("discrete/build.py:config_defines",), "ids past it are padding rows greedy/top-k never pick; the source "
         "falls back to QMK_VOCAB"),
    Knob("QMK_RMS_EPS", "required", None, "fp32 literal", (_K + "norm.cuh",), ("discrete/build.py:translation_unit",),
         "the config's rms_norm_eps as a hex-exact literal"),
    Knob("QMK_ROPE_THETA", "config", None, "float literal", (), ("discrete/build.py:translation_unit",),
         "the config's rope_theta; no source reads it (attention takes the inv_freq table)"),
    # ---------------------------------------------------------------- megakernel
    Knob("QMK_MK_M1", "knob", "0", "0 or 1", (_MK,), (_RUNNER,),
         "GEMV tiles and the GDN step built for M = 1 (1-row programs; measured faster); a program of more rows traps"),
    Knob("QMK_MK_RING", "knob", "0", "0 or 2..8 (ring slots per warp)", (_MK,), (_RUNNER,),
         "GEMV weight-ring slots per warp (runner.ring_slots: as many as shared memory allows, ≤ RING_MAX)"),
    Knob("QMK_MK_FUSE_REDUCE", "knob", "1", "0 or 1", (_MK,), (_RUNNER,),
         "build the fused split-K reduce into mk_gemv; only a fuse_reduce program needs it (the branch alone cost "
         "the other program 0.57 ms/token)"),
    Knob("QMK_MK_PREFETCH", "knob", "0", "0 or 1 (needs QMK_MK_RING ≥ 2)", (_MK,), (_RUNNER,),
         "a GEMV issues its first RING − 1 ring units before waiting for its input"),
    Knob("QMK_MK_KEYS", "knob", "1", "0 or 1", ("megakernel/include/mk_gemv.cuh",), (_VARIANTS,),
         "the head keeps per-SM best keys and the ARGMAX reads those (isa.py ARGMAX_KEYS); mk_variants A/Bs 0"),
    Knob("QMK_MK_ARGMAX_VEC", "knob", "1", "0 or 1", ("megakernel/include/mk_head.cuh",), (_VARIANTS,),
         "ARGMAX with 16-byte logit loads in flight; mk_variants A/Bs the scalar form"),
    Knob("QMK_MK_GDN_MR", "knob", "0", "0 or 1..QMK_MAX_ROWS", ("megakernel/include/mk_gdn.cuh",), (_VARIANTS,),
         "rows the GDN step's registers are sized for (0: 1 in the M = 1 build, else QMK_MAX_ROWS)"),
    Knob("QMK_MK_GDN_STATE_PREFETCH", "knob", "0", "0 or 1", ("megakernel/include/mk_gdn.cuh",), (_VARIANTS,),
         "GDN state copied to shared memory before the step's wait; measured slower, kept as an mk_variants A/B"),
    Knob("QMK_MK_POLL_ACQUIRE", "knob", "1", "0 or 1", (_MK,), (_VARIANTS,),
         "poll counters with acquire loads (0: relaxed polls, then one acquire; measured slower)"),
    Knob("QMK_MK_SPIN_NS", "knob", "0", "int ≥ 0, nanoseconds", (_MK,), (_VARIANTS,),
         "__nanosleep between counter polls (32 measured within noise)"),
    Knob("QMK_MK_XN_REUSE", "knob", "1", "0 or 1", (_MK,), (_VARIANTS,),
         "a GDN step reuses the normed row its SM's in-projection left in shared memory"),
    Knob("QMK_MK_BUMP_FENCE", "knob", "0", "0 or 1", ("megakernel/include/sync.cuh",), (_VARIANTS,),
         "a __threadfence before block_bump's release (not needed: docs/megakernel.md \"Sync protocol\")"),
    Knob("QMK_MK_SMEM_LIMIT", "flag", None, "int, bytes", (_MK,), (_RUNNER,),
         "static_assert that the shared-memory layout fits the per-block limit"),
    Knob("QMK_MK_TIMING", "flag", None, "defined or not", (_MK,), (_RUNNER,),
         "per-instruction globaltimer stamps (megakernel/timings.py, qwen-mk inspect --timings)"),
    Knob("QMK_MKP_SIZE", "flag", None, "int, bytes", ("megakernel/include/mk_params.h",), (_RUNNER,),
         "static_asserts of the MkParams / MkWeight / MkLayer layout against build.py's dtypes"),
    Knob("QMK_MKP_OFF_PAGE_STRIDE", "layout", None, "int, byte offset", ("megakernel/include/mk_params.h",),
         (_RUNNER,), "MkParams.page_stride offset (PARAMS_DTYPE)"),
    Knob("QMK_MKP_OFF_SEED", "layout", None, "int, byte offset", ("megakernel/include/mk_params.h",), (_RUNNER,),
         "MkParams.seed offset (PARAMS_DTYPE)"),
    Knob("QMK_MKP_OFF_DELAY_NS", "layout", None, "int, byte offset", ("megakernel/include/mk_params.h",),
         (_RUNNER,), "MkParams.delay_ns offset (PARAMS_DTYPE)"),
    Knob("QMK_MKW_SIZE", "layout", None, "int, bytes", ("megakernel/include/mk_params.h",), (_RUNNER,),
         "sizeof(MkWeight) (WEIGHT_DTYPE)"),
    Knob("QMK_MKL_SIZE", "layout", None, "int, bytes", ("megakernel/include/mk_params.h",), (_RUNNER,),
         "sizeof(MkLayer) (LAYER_DTYPE)"),
    Knob("QMK_MK_SRC", "layout", None, "hex literal", (), (_RUNNER,),
         "hash of the megakernel sources, read by no source: it is in the translation unit's text, so an edited "
         "header never reuses a stale cached module"),
    # ---------------------------------------------------------------- control block (discrete/control.py layout)
    *(Knob(f"QMK_CTRL_{n}", "layout", None, "int, int32 word index", (),
           ("discrete/device_state.py:control_defines",), f"control-block word of '{n.lower()}' (discrete/control.py); "
           "passed to finish.cu, read by no source (the kernels use control.h's struct)")
      for n in ("STEP", "POS", "STOP", "MAX_POS", "N_EOS", "EOS", "TOKENS", "OUT", "MAX_EOS")),
    # ---------------------------------------------------------------- Python-only launch choices
    Knob("QMK_GEMV_M1", "launch", None, "-1 (auto), 0 general, 1 cp.async ring, 2 register ring, 3 TMA",
         (), ("discrete/gemv.py:Gemv", _GEMV_BENCH), "which GEMV kernel family a 1-row launch uses (gemv.py PY_KNOBS)"),
    Knob("QMK_GEMV_TMA_KPB", "launch", None, "int, K-blocks per TMA box", (), ("discrete/gemv.py:Gemv", _GEMV_BENCH),
         "TMA box depth of the M = 1 TMA kernels (gemv.py PY_KNOBS)"),
)

# generated from ModelConfig by discrete.build.config_defines: one entry each, kind "config"
CONFIG_FIELDS = {
    "QMK_HIDDEN": "hidden_size", "QMK_FFN": "intermediate_size", "QMK_VOCAB": "vocab_size",
    "QMK_N_Q_HEADS": "num_attention_heads", "QMK_N_KV_HEADS": "num_key_value_heads", "QMK_HEAD_DIM": "head_dim",
    "QMK_ROTARY_DIM": "rotary_dim", "QMK_GQA_GROUP": "gqa_group", "QMK_GDN_NK": "linear_num_key_heads",
    "QMK_GDN_NV": "linear_num_value_heads", "QMK_GDN_DK": "linear_key_head_dim",
    "QMK_GDN_DV": "linear_value_head_dim", "QMK_GDN_CONV_DIM": "gdn_conv_dim", "QMK_GDN_KEY_DIM": "gdn_key_dim",
    "QMK_GDN_VALUE_DIM": "gdn_value_dim", "QMK_GDN_HEAD_GROUP": "gdn_head_group",
    "QMK_CONV_K": "linear_conv_kernel_dim", "QMK_N_LAYERS": "num_hidden_layers",
}
KNOBS = KNOBS + tuple(Knob(n, "config", None, "int", (), ("discrete/build.py:config_defines",), f"ModelConfig.{f}")
                      for n, f in CONFIG_FIELDS.items())
BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}

# Removed: QMK_GDN_STAMPS (phase clocks for a removed probe), QMK_GEMV_FINISH_CALL, QMK_GEMV_CP_L2,
# QMK_PDL_PREFETCH_UNITS, QMK_GEMV_WARPS, QMK_GEMV_BF16_WARPS, QMK_LMH_WARPS, QMK_GEMV_TMA_WARPS, QMK_GEMM_STAGES
# (set by nothing; the last six stay as plain constants of their sources, mirrored by the Python launchers).


# Constants of the CUDA sources that a Python launcher repeats: (define, source, "module:ATTR"); the test checks
# that both sides hold the same value.
MIRRORS = (
    ("QMK_GEMV_WARPS", _K + "gemv.cuh", "discrete.partition:FP8_WARPS"),
    ("QMK_GEMV_BF16_WARPS", _K + "gemv.cuh", "discrete.partition:BF16_WARPS"),
    ("QMK_GEMV_UNIT_BYTES", _K + "gemv.cuh", "discrete.gemv:UNIT_BYTES"),
    ("QMK_GEMV_RING_MAX", _K + "gemv.cuh", "discrete.gemv:RING_MAX"),
    ("QMK_GEMV_TMA_WARPS", _K + "gemv.cu", "discrete.gemv:TMA_WARPS"),
    ("QMK_GEMM_STAGES", _K + "gemm.cuh", "discrete.gemm:STAGES"),
    ("QMK_LMH_WARPS", _K + "lm_head.cuh", "discrete.lm_head:LMH_WARPS"),
    ("QMK_TOPK", _K + "lm_head.cuh", "discrete.lm_head:TOPK"),
    ("QMK_SAMPLE_THREADS", _K + "sample.cuh", "discrete.sampling:THREADS"),
    ("QMK_SAMPLE_PER", _K + "sample.cuh", "discrete.sampling:PER"),
    ("QMK_SAMPLE_MAX_BLOCKS", _K + "sample.cuh", "discrete.sampling:MAX_BLOCKS"),
)


def source_value(text: str, name: str) -> int:
    """The integer of the first ``#define NAME <int>`` in ``text``. Raises ValueError when there is none."""
    m = re.search(rf"^\s*#\s*define\s+{name}\s+(\d+)\b", text, re.M)
    if m is None:
        raise ValueError(f"no integer #define {name}")
    return int(m.group(1))


SOURCE_GLOBS = ("discrete/kernels/*.cu", "discrete/kernels/*.cuh", "discrete/kernels/*.h", "megakernel/**/*.cu",
                "megakernel/**/*.cuh", "megakernel/**/*.h")
PYTHON_DIRS = ("discrete", "megakernel", "host", "bench", "tools")
_IFNDEF = re.compile(r"^\s*#\s*ifndef\s+(QMK_\w+)")
_IFDEF = re.compile(r"^\s*#\s*(?:ifdef\s+(QMK_\w+)|if\s+defined\s*\(?\s*(QMK_\w+))")
_COND = re.compile(r"^\s*#\s*if")
_END = re.compile(r"^\s*#\s*endif")
_PASSED = (re.compile(r"[\"'](QMK_[A-Z0-9_]+)[\"']\s*:"),            # {"QMK_X": v}
           re.compile(r"\[\s*[\"'](QMK_[A-Z0-9_]+)[\"']\s*\]\s*="),   # d["QMK_X"] = v
           re.compile(r"\.get\(\s*[\"'](QMK_[A-Z0-9_]+)[\"']"),       # defines.get("QMK_X", ...)
           re.compile(r"#define (QMK_[A-Z0-9_]+) \{"))                # f"#define QMK_X {value}"


def source_defines(text: str) -> list[tuple[str, str, str | None, int]]:
    """Overridable defines of one CUDA source: (name, kind, default, line) for every ``#ifndef QMK_X`` (kind
    ``knob`` with the ``#define`` right-hand side inside the block, comment stripped; ``required`` when the block
    has an ``#error`` instead) and every ``#ifdef QMK_X`` / ``#if defined(QMK_X)`` (``flag``, default None).
    Raises ValueError for an ``#ifndef QMK_X`` block that neither defines it nor errors."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = _IFNDEF.match(line)
        if m:
            name, depth, default, err = m.group(1), 0, None, False
            for ln in lines[i + 1:]:
                if _COND.match(ln):
                    depth += 1
                elif _END.match(ln):
                    if depth == 0:
                        break
                    depth -= 1
                elif depth == 0:
                    d = re.match(rf"^\s*#\s*define\s+{name}\b(.*)$", ln)
                    if d and default is None:
                        default = d.group(1).split("//")[0].strip()
                    err = err or bool(re.match(r"^\s*#\s*error\b", ln))
            if default is None and not err:
                raise ValueError(f"line {i + 1}: #ifndef {name} neither defines it nor stops with #error")
            out.append((name, "knob" if default is not None else "required", default, i + 1))
            continue
        m = _IFDEF.match(line)
        if m:
            out.append((m.group(1) or m.group(2), "flag", None, i + 1))
    return out


def python_defines(text: str) -> set[str]:
    """``QMK_*`` names a Python source passes as defines: dict keys, ``d["QMK_X"] =`` assignments,
    ``.get("QMK_X"`` reads and generated ``#define QMK_X {...}`` lines; lines naming ``environ`` (environment
    variables such as QMK_COMMIT) are skipped."""
    found: set[str] = set()
    for line in text.splitlines():
        if "environ" in line:
            continue
        for rx in _PASSED:
            found.update(rx.findall(line))
    return found


def problems(root: Path, table: tuple[Knob, ...] | None = None) -> list[str]:
    """Every disagreement between ``table`` (default KNOBS) and the tree at ``root``: an unregistered source or
    Python define, a default or kind that differs from the source, a registered knob/flag/required name no
    source has (stale), a ``sources`` / ``set_by`` file that does not exist or does not name it, a knob nothing
    sets. Returns messages (empty: consistent)."""
    table = KNOBS if table is None else table
    by = {k.name: k for k in table}
    out: list[str] = []
    seen: dict[str, list[str]] = {}
    for pat in SOURCE_GLOBS:
        for p in sorted(root.glob(pat)):
            rel = str(p.relative_to(root))
            for name, kind, default, line in source_defines(p.read_text()):
                seen.setdefault(name, []).append(rel)
                k = by.get(name)
                if k is None:
                    out.append(f"{rel}:{line}: {name} ({kind}) is not in discrete/knobs.py")
                elif kind == "knob" and k.kind == "config":
                    continue  # a fallback for a generated value (QMK_VALID_VOCAB)
                elif k.kind != kind:
                    out.append(f"{rel}:{line}: {name} is a {kind} in the source, {k.kind} in discrete/knobs.py")
                elif k.default != default:
                    out.append(f"{rel}:{line}: {name} defaults to {default!r}, discrete/knobs.py says {k.default!r}")
    for d in PYTHON_DIRS:
        for p in sorted((root / d).rglob("*.py")):
            if p.resolve() == Path(__file__).resolve():
                continue  # this table's own examples
            for name in sorted(python_defines(p.read_text())):
                if name not in by:
                    out.append(f"{p.relative_to(root)}: passes {name}, which is not in discrete/knobs.py")
    for k in table:
        if k.kind not in KINDS:
            out.append(f"{k.name}: unknown kind {k.kind!r}")
        if k.kind in ("knob", "flag", "required") and k.name not in seen:
            out.append(f"{k.name}: registered as a {k.kind}, but no source has #ifndef/#ifdef {k.name} (stale)")
        if k.kind == "knob" and not k.set_by:
            out.append(f"{k.name}: a knob nothing sets")
        for f in k.sources + tuple(s.split(":")[0] for s in k.set_by):
            p = root / f
            if not p.is_file() or k.name not in p.read_text():
                out.append(f"{k.name}: {f} does not exist or does not name it")
    return out


def markdown() -> str:
    """docs/knobs.md: the table above as Markdown (one section per kind). Returns the page text."""
    head = {"knob": "Build knobs (`#ifndef` with a default; overriding one never changes a result)",
            "flag": "Flags (`#ifdef`: off unless defined)", "required": "Required (`#error` when missing)",
            "config": "Generated from the ModelConfig (`discrete.build`)",
            "layout": "Generated layouts (host dtypes, source hash)",
            "launch": "Launch choices read by Python (never reach the compiler)"}
    out = ["# Compile-time defines (`QMK_*`)", "",
           "Generated from `discrete/knobs.py` (`python3 -m discrete.knobs > docs/knobs.md`); "
           "`tests/cpu/test_knobs.py` checks that every `#ifndef`/`#ifdef QMK_*` in `discrete/kernels` and "
           "`megakernel`, and every define the Python code passes, is in that table with the source's default, "
           "and that this page is current. Add a knob there first, with who sets it and why.", ""]
    for kind in KINDS:
        rows = [k for k in KNOBS if k.kind == kind]
        out += [f"## {head[kind]}", ""]
        if kind == "config":
            out += [", ".join(f"`{k.name}` ({k.why})" for k in rows), ""]
            continue
        out += ["| name | default | values | read by | set by | why |", "|---|---|---|---|---|---|"]
        for k in rows:
            d = f"`{k.default}`" if k.default is not None else "—"
            src = ", ".join(s.split("/")[-1] for s in k.sources) or "—"
            out.append(f"| `{k.name}` | {d} | {k.values} | {src} | {', '.join(k.set_by)} | {k.why} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(markdown())
