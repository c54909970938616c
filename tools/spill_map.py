"""Where the megakernel spills, by source line (offline, no GPU): compiles ``mk_main`` with nvcc as
``discrete.compile_check`` does (same translation unit, ``-lineinfo``), disassembles it with ``nvdisasm
--print-line-info`` and counts the local-memory spill instructions (STL / LDL) under the innermost source line each
belongs to — e.g. spill stores that a change elsewhere in ``mk_main`` moved inside the GEMV loop (gemv.cuh / the
mma), or a step spilling its inputs right after loading them (docs/megakernel.md).

``python3 -m tools.spill_map [--preset P] [--general] [--fuse-reduce] [-D NAME=VALUE ...] [--top N]
[--by-file] [--sass FILE]``. Needs nvcc and nvdisasm (PATH, /usr/local/cuda/bin, or the ``nvidia`` / ``triton``
pip packages' bin folders); exits 2 naming the missing tool.
"""
from __future__ import annotations

import argparse
import collections
import glob
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from discrete.compile_check import KERNEL_DIR, get_preset, nvcc_path, translation_unit  # noqa: E402
from loader.config import preset  # noqa: E402
from megakernel.runner import mk_defines  # noqa: E402

LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
INSN = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);")


def find_tool(name: str) -> str | None:
    """Path of a CUDA binary tool: PATH, /usr/local/cuda/bin, then the bin folders of pip-installed CUDA packages."""
    cuda = Path("/usr/local/cuda/bin") / name
    hit = shutil.which(name) or (str(cuda) if cuda.is_file() else None)
    if hit:
        return hit
    for pat in (f"{sys.prefix}/lib/python*/site-packages/nvidia/*/bin/{name}",
                f"{sys.prefix}/lib/python*/site-packages/triton/backends/nvidia/bin/{name}"):
        found = sorted(glob.glob(pat))
        if found:
            return found[0]
    return None


def spills(sass: str) -> collections.Counter:
    """Counter of ((file name, line), 'STL' | 'LDL') over the disassembly ``sass`` (nvdisasm --print-line-info)."""
    cur, out = ("?", 0), collections.Counter()
    for line in sass.splitlines():
        m = LINE.search(line)
        if m:
            cur = (Path(m.group(1)).name, int(m.group(2)))
            continue
        m = INSN.match(line)
        if m:
            op = m.group(1).split()
            op = op[1] if op and op[0].startswith("@") and len(op) > 1 else (op[0] if op else "")
            if op.startswith(("STL", "LDL")):
                out[(cur, op[:3])] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3.5-27b")
    ap.add_argument("--general", action="store_true", help="the general-M build (default: the M = 1 build)")
    ap.add_argument("--fuse-reduce", action="store_true", help="the fused split-K reduce build")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="extra define NAME=VALUE")
    ap.add_argument("--top", type=int, default=25, help="source lines to list")
    ap.add_argument("--by-file", action="store_true", help="totals per source file only")
    ap.add_argument("--sass", default=None, help="also write the disassembly here")
    a = ap.parse_args(argv)
    nvcc, nvdisasm = nvcc_path(), find_tool("nvdisasm")
    if not nvcc or not nvdisasm:
        print(f"spill_map: needs nvcc and nvdisasm (found nvcc={nvcc}, nvdisasm={nvdisasm})", file=sys.stderr)
        return 2
    extra = {}
    for d in a.defines:
        k, _, v = d.partition("=")
        extra[k] = v or 1
    cfg = preset(a.preset)
    defs = mk_defines(cfg, fuse_reduce=a.fuse_reduce, m1=not a.general, extra=extra or None)
    src = ROOT / "megakernel" / "megakernel.cu"
    tu = translation_unit(get_preset(a.preset), [str(src)], defs)
    incs = [KERNEL_DIR, ROOT / "megakernel", ROOT / "megakernel" / "include"]
    with tempfile.TemporaryDirectory(prefix="qmk-spill-") as tmp:
        (Path(tmp) / "mk.cu").write_text(tu)
        p = subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-std=c++17", "-lineinfo", "-ftz=true",
                            *(f"-I{d}" for d in incs), "-o", f"{tmp}/mk.cubin", f"{tmp}/mk.cu"],
                           capture_output=True, text=True)
        if p.returncode:
            print(p.stderr[-4000:], file=sys.stderr)
            return 1
        sass = subprocess.run([nvdisasm, "--print-line-info", f"{tmp}/mk.cubin"], capture_output=True,
                              text=True, check=True).stdout
    if a.sass:
        Path(a.sass).write_text(sass)
    c = spills(sass)
    print(f"mk_main ({a.preset}, {'general' if a.general else 'M = 1'}{', fused reduce' if a.fuse_reduce else ''}): "
          f"{sum(v for (_, k), v in c.items() if k == 'STL')} STL, {sum(v for (_, k), v in c.items() if k == 'LDL')} "
          "LDL instructions")
    if a.by_file:
        f = collections.Counter()
        for ((name, _), k), v in c.items():
            f[(name, k)] += v
        for (name, k), v in sorted(f.items(), key=lambda kv: -kv[1]):
            print(f"{v:5d} {k} {name}")
        return 0
    for ((name, line), k), v in c.most_common(a.top):
        print(f"{v:5d} {k} {name}:{line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
