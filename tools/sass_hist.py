"""Opcode histogram of a kernel's hottest loop in SASS, offline (no GPU): what a GEMV unit costs in instructions.

``python3 -m tools.sass_hist [--unit discrete/kernels/gemv.cu] [--kernel gemv_fp8_partial_m1r]
[--preset qwen3.5-27b] [--define NAME=VALUE ...] [--json]``

Builds the unit's translation unit exactly as ``discrete.compile_check`` does (the preset's defines, plus
``--define``), compiles it with nvcc for sm_90 to a cubin, disassembles the kernel with ``cuobjdump -sass`` and
finds the backward-branch bodies holding HMMA instructions, densest first (the K-block loops of the GEMV tiles);
prints the bodies' opcode counts (predicates and modifiers stripped: ``IMAD.SHL.U32`` counts as IMAD) and the
HMMA count, so per-unit costs follow from counts / (HMMA per unit: 8 for fp8, 4 for bf16).

cuobjdump is not in this machine's CUDA install; ``spill_map.find_tool`` finds the copy the triton package ships
(or one from ``pip install nvidia-cuda-cuobjdump``); ``--cuobjdump`` names another. Counts are static (measured from
the binary), not timings.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from discrete.build import KERNEL_DIR, translation_unit  # noqa: E402
from discrete.compile_check import ROOT, nvcc_path, unit_defines  # noqa: E402
from loader.config import preset as get_preset  # noqa: E402
from tools.spill_map import find_tool  # noqa: E402

LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
BRANCH = re.compile(r"BRA\s+(?:\S+,\s*)?0x([0-9a-f]+)")


def build_cubin(unit: Path, preset: str, defines: dict, out: Path) -> str:
    """Compile ``unit`` as compile_check does (its first define variant, plus ``defines``) into ``out``; returns
    ptxas's report. Raises RuntimeError with the compiler's message on failure."""
    cfg = get_preset(preset)
    src = str(unit.resolve().relative_to(KERNEL_DIR)) if unit.resolve().is_relative_to(KERNEL_DIR) \
        else str(unit.resolve())
    var = (unit_defines(unit, cfg) or [{}])[0]
    tu = translation_unit(cfg, [src], {**var, **defines} or None)
    with tempfile.TemporaryDirectory(prefix="qmk-sass-") as tmp:
        tu_path = Path(tmp) / f"{unit.stem}.sass_tu.cu"  # not the unit's own name: it includes the unit
        tu_path.write_text(tu)
        incs = [str(d) for d in (KERNEL_DIR, ROOT / "megakernel", ROOT / "megakernel" / "include", unit.parent)
                if d.is_dir()]
        cmd = [nvcc_path(), "-cubin", "-arch=sm_90", "-std=c++17", "-lineinfo", "-ftz=true", "-Xptxas", "-v",
               *(f"-I{d}" for d in incs), "-o", str(out), str(tu_path)]
        p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"sass_hist: nvcc failed on {unit}:\n{p.stderr[-4000:]}")
    return p.stderr


def hot_loops(sass: str) -> list[tuple[collections.Counter, int, tuple[int, int]]]:
    """(opcode counts, HMMA count, (start, end) addresses) of every backward-branch body holding HMMA, densest
    first (HMMA per instruction: the K-block loops of the GEMV tiles before the loops that merely contain them)."""
    ins = []
    for line in sass.splitlines():
        m = LINE.match(line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    loops = []
    for addr, text in ins:
        b = BRANCH.search(text)
        if not b or int(b.group(1), 16) >= addr:
            continue
        lo = int(b.group(1), 16)
        body = [t for a, t in ins if lo <= a <= addr]
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
        if ops["HMMA"]:
            loops.append((ops, ops["HMMA"], (lo, addr)))
    return sorted(loops, key=lambda x: (-x[1] / sum(x[0].values()), x[2]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--unit", default="discrete/kernels/gemv.cu")
    ap.add_argument("--kernel", default="gemv_fp8_partial_m1r")
    ap.add_argument("--preset", default="qwen3.5-27b")
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE, added to the unit's defines")
    ap.add_argument("--cuobjdump", default=None, help="default: spill_map.find_tool (PATH, /usr/local/cuda/bin, "
                    "pip-installed nvidia packages)")
    ap.add_argument("--top", type=int, default=1, help="how many loops to show (densest first)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    a.cuobjdump = a.cuobjdump or find_tool("cuobjdump")
    if not a.cuobjdump:
        print("sass_hist: cuobjdump not found (see the module docstring: the nvidia-cuda-cuobjdump wheel)",
              file=sys.stderr)
        return 2
    defines = {}
    for d in a.define:
        k, _, v = d.partition("=")
        defines[k] = int(v) if v.lstrip("-").isdigit() else v
    with tempfile.TemporaryDirectory(prefix="qmk-sass-") as tmp:
        cub = Path(tmp) / "k.cubin"
        build_cubin(Path(a.unit), a.preset, defines, cub)
        p = subprocess.run([a.cuobjdump, "-sass", "-fun", a.kernel, str(cub)], capture_output=True, text=True)
    if p.returncode or "Function" not in p.stdout:
        print(f"sass_hist: cuobjdump found no kernel {a.kernel!r}: {p.stderr.strip()}", file=sys.stderr)
        return 1
    loops = hot_loops(p.stdout)[:a.top]
    res = {"unit": a.unit, "kernel": a.kernel, "preset": a.preset, "defines": defines,
           "loops": [{"range": [hex(lo), hex(hi)], "hmma": h, "instructions": sum(o.values()),
                      "opcodes": dict(o.most_common())} for o, h, (lo, hi) in loops]}
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"{a.kernel} ({a.unit}, {a.preset}, {defines or 'no extra defines'}): {len(loops)} densest HMMA loops")
    for o, h, (lo, hi) in loops:
        print(f"  loop {hex(lo)}-{hex(hi)}: {sum(o.values())} instructions, {h} HMMA")
        print("    " + " ".join(f"{k}:{v}" for k, v in o.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
