"""Offline sm_90 compile check of every CUDA translation unit, with ptxas resource reports (no GPU needed).

``python3 -m discrete.compile_check [--preset P] [--json] [--no-cache] [-j N] [FILE.cu ...]``

Each ``.cu`` file under ``discrete/kernels/`` and ``megakernel/`` (found by glob, so new files are picked up
automatically) is one translation unit, built by :func:`discrete.build.translation_unit` so that the
``QMK_*`` defines of each preset (default: both ``tiny`` and ``qwen3.5-27b``) are applied exactly as at run
time, then compiled with ``nvcc -cubin -arch=<arch> -std=c++17 -lineinfo -ftz=true -Xptxas -v`` (include dirs
``discrete/kernels``, ``megakernel``, ``megakernel/include`` and the unit's own folder).

Source markers (comments, one per line):

* ``// qmk: hot`` on the line directly above a ``__global__`` declaration (or above its ``template<...>`` or
  ``extern "C"`` line; other ``//`` comment lines may sit between) marks that kernel *hot*. Kernels whose names start with
  ``gemv``, ``lm_head``, ``gdn``, ``attn`` or ``mk_`` (after an optional ``qmk_``) are hot without a marker.
  A hot kernel fails the check if ptxas reports any spill store/load, stack frame or local memory, beyond
  the documented ceiling ``LOCAL_BUDGETS`` gives a few named kernels (mk_main, qmk_attn_prep). A marker
  that is not directly above a ``__global__`` is itself an error.
* ``// qmk: arch sm_90a`` (anywhere in the ``.cu`` file) lists the architectures to compile that unit for,
  replacing the default ``sm_90``; write ``// qmk: arch sm_90 sm_90a`` to get both.
* Run-time defines beyond ``config_defines`` (``QMK_MAX_ROWS``, ``QMK_PAGE``, ...) come from the Python module
  that launches the unit: ``// qmk: defines discrete.gdn:compile_defines`` names a function
  ``(cfg: ModelConfig) -> dict | list[dict]`` returning the ``extra_defines`` the engine passes to
  ``load_module`` (a list = one compile per variant, e.g. per row count). Without the marker the function
  ``compile_defines`` of ``discrete/<stem>.py`` (``megakernel/<stem>.py`` for megakernel units) is used when
  that module defines it. The module must import without a GPU.

The check fails (exit status 1) on a compile error (the compiler's message with file/line is shown), on a
hot kernel with spills/stack/local memory, and on a misplaced hot marker. Results of successful compiles are
cached under ``~/.cache/qwen-mk/compile/`` (``$QMK_COMPILE_CACHE`` overrides), keyed by the translation-unit
text, flags and nvcc version, and validated against the hashes of every repository file the unit included
(from ``nvcc -MD``), so an edited header recompiles exactly the units that include it.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from discrete.build import KERNEL_DIR, translation_unit
from loader.config import preset as get_preset

ROOT = KERNEL_DIR.parents[1]
SOURCE_DIRS = (KERNEL_DIR, ROOT / "megakernel")
PRESETS = ("tiny", "qwen3.5-27b")
DEFAULT_ARCHS = ("sm_90",)
HOT_PREFIXES = ("gemv", "lm_head", "gdn", "attn", "mk_")
CACHE_DIR = Path(os.environ.get("QMK_COMPILE_CACHE", "~/.cache/qwen-mk/compile")).expanduser()
HOT_RE = re.compile(r"//\s*qmk:\s*hot\b")
ARCH_RE = re.compile(r"//\s*qmk:\s*arch\s+([\w ]+)")
DEFINES_RE = re.compile(r"//\s*qmk:\s*defines\s+([\w.]+):(\w+)")
HEADER_EXTS = (".cuh", ".h")


@dataclass
class KernelReport:
    """ptxas resources of one entry function; sizes in bytes."""
    symbol: str
    name: str
    registers: int = 0
    barriers: int = 0
    smem: int = 0
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    lmem: int = 0
    hot: bool = False


@dataclass
class UnitResult:
    """One (unit, preset, arch, extra-defines variant) compile: ``ok`` is False on a compiler error (``log``
    holds the message); ``variant`` is 'K=V,...' of the extra defines ('' for none)."""
    unit: str
    preset: str
    arch: str
    variant: str
    ok: bool
    log: str
    kernels: list[KernelReport] = field(default_factory=list)
    cached: bool = False
    seconds: float = 0.0


def _rel(p: Path | str) -> str:
    p = Path(p)
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def find_units(dirs=SOURCE_DIRS) -> list[Path]:
    """Every ``.cu`` file (recursively) under ``dirs``, sorted."""
    return sorted(p for d in dirs if Path(d).is_dir() for p in Path(d).rglob("*.cu"))


def unit_archs(path: Path) -> tuple[str, ...]:
    """Architectures a unit asks for with ``// qmk: arch ...``; DEFAULT_ARCHS without a marker."""
    archs: list[str] = []
    for m in ARCH_RE.finditer(path.read_text()):
        archs += [a for a in m.group(1).split() if a not in archs]
    bad = [a for a in archs if not re.fullmatch(r"sm_\d+a?", a)]
    if bad:
        raise ValueError(f"{_rel(path)}: '// qmk: arch' expects names like sm_90 or sm_90a, got {bad}")
    return tuple(archs) or DEFAULT_ARCHS


def unit_defines(path: Path, cfg) -> list[dict]:
    """Extra-define variants for one unit and config (see module docstring); ``[{}]`` when the unit has no
    provider. Raises ValueError naming the unit and provider when it cannot be imported or returns junk."""
    m = DEFINES_RE.search(path.read_text())
    if m:
        mod_name, fn_name = m.groups()
    else:
        base = path.resolve().parent
        pkg = "megakernel" if base.is_relative_to(ROOT / "megakernel") else "discrete"
        mod_name, fn_name = f"{pkg}.{path.stem}", "compile_defines"
        if not base.is_relative_to(ROOT) or not (ROOT / pkg / f"{path.stem}.py").is_file():
            return [{}]
    where = f"{_rel(path)}: defines provider {mod_name}:{fn_name}"
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name, None)
    except Exception as e:
        raise ValueError(f"{where} failed to import: {type(e).__name__}: {e}") from None
    if fn is None:
        if m:
            raise ValueError(f"{where} does not exist")
        return [{}]
    out = fn(cfg)
    out = [out] if isinstance(out, dict) else list(out)
    if not out or not all(isinstance(d, dict) and all(isinstance(k, str) for k in d) for d in out):
        raise ValueError(f"{where} must return a dict or a non-empty list of dicts of str keys, got {out!r}")
    return out


def _variant(d: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(d.items()))


_LB_RE = re.compile(r"__(?:launch_bounds|maxnreg|cluster_dims)__\s*\((?:[^()]|\([^()]*\))*\)")
_NAME_RE = re.compile(r"\bvoid\s+(\w+)\s*[(<]")


def hot_markers(path: Path) -> tuple[set[str], list[str]]:
    """Scan one source for ``// qmk: hot`` markers. Returns (names of marked kernels, errors for markers
    that do not sit directly above a ``__global__`` declaration, as 'file:line: message')."""
    lines = path.read_text().splitlines()
    names: set[str] = set()
    used: set[int] = set()
    for i, line in enumerate(lines):
        if "__global__" not in line.split("//")[0]:
            continue
        rest = _LB_RE.sub(" ", " ".join(lines[i:i + 6]).split("__global__", 1)[1])
        m = _NAME_RE.search(rest)
        j = i - 1  # walk up through comments and a template / extern "C" line
        while j >= 0 and lines[j].strip().startswith(("//", "template", 'extern "C"')):
            if HOT_RE.search(lines[j]) and m:
                names.add(m.group(1))
                used.add(j)
            j -= 1
        if HOT_RE.search(line) and m:  # marker as a trailing comment on the declaration line
            names.add(m.group(1))
            used.add(i)
    errors = [f"{_rel(path)}:{i + 1}: '// qmk: hot' is not directly above a __global__ declaration"
              for i, line in enumerate(lines) if HOT_RE.search(line) and i not in used]
    return names, errors


def demangle(symbol: str) -> str:
    """Unqualified function name of an Itanium-mangled (or extern "C") symbol: '_ZN3qmk6attn_tILi1EEEvPf'
    -> 'attn_t'. Template arguments and parameter types are dropped."""
    if not symbol.startswith("_Z"):
        return symbol
    s, i, name = symbol, 2, symbol
    if i < len(s) and s[i] == "N":
        i += 1
    while i < len(s) and s[i].isdigit():
        j = i
        while s[j].isdigit():
            j += 1
        n = int(s[i:j])
        name, i = s[j:j + n], j + n
    return name


# Local-memory debts a hot kernel may carry, each a ceiling (bytes) over every preset and variant the check
# builds (the parser reads each entry's own properties line: a helper function's line printed after the entry's
# once hid mk_main's spills). A hot kernel over its budget, or using local memory without one, fails. Lower a budget when
# a debt shrinks; raising one is a decision to write down in docs/megakernel.md, never a way to pass.
LOCAL_BUDGETS: dict[str, dict] = {
    "mk_main": {"stack_frame": 408, "spill_stores": 456, "spill_loads": 748, "lmem": 0,
                "why": "128-register cap (512 threads, one block per SM) with the GDN and attention device functions "
                       "inlined: measured 284-412 B spill stores; __noinline__ cold opcodes spill less (88 B in "
                       "mk_main) but ran 0.3 ms/token slower. Raised in session 4 for the fused-reduce build only "
                       "(348/608 -> 412/740 with the unmasked activation load; the default 27B builds are 300/528 "
                       "and 308/552; docs/megakernel.md). Session 6: the GDN step's up-front loads (weights, conv window, z) moved "
                       "them to 312/508 (M = 1), 352/612 and 448/740 (fused reduce): stores budget 448 (the megakernel "
                       "keeps one warp sum at a time; interleaved sums spilled 420-508 B and slowed its GEMVs 9 %, "
                       "docs/megakernel.md session 6). Session 8: the RMSNorm's 16-byte chunks (norm.cuh) inlined moved "
                       "spills into the GEMV loop (312 → 548 B); mk_rmsnorm is __noinline__: M = 1 build back at 312/508, "
                       "the fused-reduce build 456/748 (+8 B, the call; docs/megakernel.md session 8)"},
    "qmk_attn_prep": {"stack_frame": 40, "spill_stores": 0, "spill_loads": 0, "lmem": 0,
                      "why": "the double-precision sin/cos of RoPE keep the argument-reduction slow path "
                             "(__internal_trig_reduction_slowpathd, a 40-byte local array), taken only for huge "
                             "angles"},
}

_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PROPS_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers(.*)")
_FPROPS_RE = re.compile(r"Function properties for (\S+)")


def parse_ptxas(log: str) -> list[KernelReport]:
    """Per-entry-function resources from ``-Xptxas -v`` output (nvcc 13 format; sizes in bytes). A properties
    line counts for an entry only under its own ``Function properties for <entry>`` header: ptxas also prints
    the properties of non-inlined device functions (e.g. ``__internal_trig_reduction_slowpathd``) after an entry,
    and those must not overwrite the entry's spills (tests/cpu/test_compile_check.py pins that log shape)."""
    out: list[KernelReport] = []
    cur: KernelReport | None = None
    props_for: str | None = None
    for line in log.splitlines():
        if m := _ENTRY_RE.search(line):
            cur = KernelReport(symbol=m.group(1), name=demangle(m.group(1)))
            out.append(cur)
            props_for = None
        elif m := _FPROPS_RE.search(line):
            props_for = m.group(1)
        elif cur and props_for == cur.symbol and (m := _PROPS_RE.search(line)):
            cur.stack_frame, cur.spill_stores, cur.spill_loads = map(int, m.groups())
        elif cur and (m := _USED_RE.search(line)):
            cur.registers = int(m.group(1))
            for num, what in re.findall(r"(\d+) (?:bytes )?(\w+)", m.group(2)):
                if what == "barriers":
                    cur.barriers = int(num)
                elif what == "smem":
                    cur.smem = int(num)
                elif what == "lmem":
                    cur.lmem = int(num)
    return out


_nvcc_version: str | None = None


def nvcc_path() -> str | None:
    """The nvcc on PATH (or /usr/local/bin, /usr/local/cuda/bin), None if absent."""
    return shutil.which("nvcc") or next((p for p in ("/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc")
                                         if os.access(p, os.X_OK)), None)


def nvcc_version(nvcc: str) -> str:
    global _nvcc_version
    if _nvcc_version is None:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"V(\d+\.\d+\.\d+)", out)
        _nvcc_version = m.group(1) if m else out.strip().splitlines()[-1]
    return _nvcc_version


def _sha(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _deps(dep_file: Path, tu_path: Path) -> dict[str, str | None]:
    """Non-system files (not under /usr) the unit included, with their hashes, from an ``nvcc -MD`` file."""
    words = dep_file.read_text().replace("\\\n", " ").split(":", 1)[1].split()
    return {w: _sha(w) for w in words if not w.startswith("/usr/") and Path(w) != tu_path}


def compile_unit(unit: Path, preset: str, arch: str, cache_dir: Path | None = CACHE_DIR,
                 extra: dict | None = None) -> UnitResult:
    """Compile one unit for one preset and arch with nvcc (or take it from the cache). Raises RuntimeError
    when nvcc is absent; a compile error is reported in the result, not raised."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found on PATH, /usr/local/bin or /usr/local/cuda/bin")
    t0 = time.perf_counter()
    # discrete/kernels sources by their runtime name; others (megakernel, planted tests) by absolute path
    src = str(unit.resolve().relative_to(KERNEL_DIR)) if unit.resolve().is_relative_to(KERNEL_DIR) \
        else str(unit.resolve())
    tu = translation_unit(get_preset(preset), [src], extra or None)
    var = _variant(extra or {})
    incs = [str(d) for d in (KERNEL_DIR, ROOT / "megakernel", ROOT / "megakernel" / "include", unit.parent)
            if d.is_dir()]
    # -ftz=true: CuPy's NVRTC path always adds it (cupy/cuda/compiler.py), so the checked code is the run code
    flags = ["-cubin", f"-arch={arch}", "-std=c++17", "-lineinfo", "-ftz=true", "-Xptxas", "-v"]
    key = hashlib.sha256(json.dumps([tu, flags, incs, nvcc_version(nvcc)]).encode()).hexdigest()
    entry = cache_dir / f"{key}.json" if cache_dir else None
    if entry and entry.is_file():
        try:
            hit = json.loads(entry.read_text())
            if all(_sha(p) == h for p, h in hit["deps"].items()):
                return UnitResult(_rel(unit), preset, arch, var, True, hit["log"], parse_ptxas(hit["log"]), True,
                                  time.perf_counter() - t0)
        except (ValueError, KeyError, OSError):
            pass  # unreadable entry: recompile and overwrite
    with tempfile.TemporaryDirectory(prefix="qmk-cc-") as tmp:
        tu_path = Path(tmp) / f"{unit.stem}.{preset}.{arch}.tu.cu"
        tu_path.write_text(tu)
        cmd = [nvcc, *flags, *(f"-I{d}" for d in incs), "-MD", "-MF", f"{tmp}/deps.d",
               "-o", f"{tmp}/out.cubin", str(tu_path)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        log = (p.stdout + p.stderr).replace(str(tu_path), f"<translation unit {_rel(unit)} [{preset}]>")
        log = log.replace(str(ROOT) + "/", "")
        ok = p.returncode == 0
        deps = _deps(Path(tmp) / "deps.d", tu_path) if ok and (Path(tmp) / "deps.d").is_file() else None
    if ok and entry and deps is not None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        part = entry.with_suffix(f".{os.getpid()}.tmp")
        part.write_text(json.dumps({"unit": _rel(unit), "deps": deps, "log": log}))
        os.replace(part, entry)
    return UnitResult(_rel(unit), preset, arch, var, ok, log, parse_ptxas(log) if ok else [], False,
                      time.perf_counter() - t0)


def is_hot(name: str, marked: set[str]) -> bool:
    """Marked, or named after a hot op (a leading ``qmk_`` is ignored: ``qmk_attn_prep`` is hot)."""
    return name in marked or name.removeprefix("qmk_").startswith(HOT_PREFIXES)


@dataclass
class CheckResult:
    """All compiles of one check; ``failures`` holds one human-readable message per problem."""
    results: list[UnitResult]
    failures: list[str]
    nvcc: str
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.failures


def check(units: list[Path] | None = None, presets=PRESETS, jobs: int | None = None,
          cache_dir: Path | None = CACHE_DIR) -> CheckResult:
    """Compile every unit (default :func:`find_units`) for every preset and its archs, in parallel, and
    apply the hot-kernel rules. Raises RuntimeError when nvcc is absent."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found on PATH, /usr/local/bin or /usr/local/cuda/bin")
    t0 = time.perf_counter()
    everything = units is None
    units = [Path(u) for u in (find_units() if units is None else units)]
    repo_src = {p.resolve() for d in SOURCE_DIRS if d.is_dir() for ext in (".cu", *HEADER_EXTS)
                for p in d.rglob(f"*{ext}")}
    # markers of the units and the headers beside them are checked; the rest of the repo's only name kernels
    own = {u.resolve() for u in units} | {h.resolve() for u in units for ext in HEADER_EXTS
                                          for h in u.parent.glob(f"*{ext}")} | (repo_src if everything else set())
    marked: set[str] = set()
    failures: list[str] = []
    for p in sorted(repo_src | own):
        names, errs = hot_markers(p)
        marked |= names
        failures += errs if p in own else []
    jobs_list = []
    for u in units:
        for pr in presets:
            try:
                jobs_list += [(u, pr, a, v) for a in unit_archs(u) for v in unit_defines(u, get_preset(pr))]
            except ValueError as e:
                failures.append(str(e))
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as ex:
        results = list(ex.map(lambda j: compile_unit(*j[:3], cache_dir=cache_dir, extra=j[3]), jobs_list))
    for r in results:
        where = f"{r.unit} [{r.preset}, {r.arch}{', ' + r.variant if r.variant else ''}]"
        if not r.ok:
            hint = "" if r.variant or "#error" not in r.log else (
                "\n(hint: a unit that needs run-time defines names their provider with "
                "'// qmk: defines discrete.<module>:<function>' or defines compile_defines(cfg) in "
                "discrete/<stem>.py; see discrete/compile_check.py)")
            failures.append(f"{where}: compile error\n{r.log.strip()}{hint}")
        for k in r.kernels:
            k.hot = is_hot(k.name, marked)
            bad = [f"{v} bytes {what}" for v, what in ((k.spill_stores, "spill stores"),
                   (k.spill_loads, "spill loads"), (k.stack_frame, "stack frame"), (k.lmem, "lmem")) if v]
            budget = LOCAL_BUDGETS.get(k.name)
            if k.hot and bad and budget is not None:
                over = [f"{getattr(k, f)} bytes {f.replace('_', ' ')} > budget {budget[f]}"
                        for f in ("spill_stores", "spill_loads", "stack_frame", "lmem") if getattr(k, f) > budget[f]]
                if over:
                    failures.append(f"{where}: hot kernel {k.name} ({k.symbol}) exceeds its local-memory budget "
                                    f"(LOCAL_BUDGETS): {', '.join(over)}, {k.registers} registers")
            elif k.hot and bad:
                failures.append(f"{where}: hot kernel {k.name} ({k.symbol}) uses local memory: "
                                f"{', '.join(bad)}, {k.registers} registers")
    return CheckResult(results, failures, nvcc_version(nvcc), time.perf_counter() - t0)


def format_table(res: CheckResult) -> str:
    """Human-readable report: one row per kernel, then the failures."""
    n_cached = sum(r.cached for r in res.results)
    lines = [f"compile check: {len(res.results)} compiles ({n_cached} cached) in {res.seconds:.1f} s, "
             f"nvcc {res.nvcc}",
             f"{'unit':34} {'preset':12} {'arch':7} {'kernel':28} {'regs':>4} {'smem':>6} {'stack':>5} "
             f"{'spill st/ld':>11} {'lmem':>5} hot extra defines"]
    for r in res.results:
        if not r.ok:
            lines.append(f"{r.unit:34} {r.preset:12} {r.arch:7} COMPILE ERROR {r.variant}")
        for k in r.kernels:
            lines.append(f"{r.unit:34} {r.preset:12} {r.arch:7} {k.name[:28]:28} {k.registers:4d} "
                         f"{k.smem:6d} {k.stack_frame:5d} {f'{k.spill_stores}/{k.spill_loads}':>11} "
                         f"{k.lmem:5d} {'hot' if k.hot else '   '} {r.variant}")
    lines += [f"FAIL: {f}" for f in res.failures]
    lines.append("compile check: " + ("OK" if res.ok else f"FAILED ({len(res.failures)} problems)"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m discrete.compile_check", description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help=".cu files to check (default: all under discrete/kernels, megakernel)")
    ap.add_argument("--preset", action="append", choices=PRESETS, help="preset(s) to apply (default: both)")
    ap.add_argument("--json", action="store_true", help="print the full report as JSON")
    ap.add_argument("--no-cache", action="store_true", help="ignore and do not write the compile cache")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="parallel nvcc processes (default: CPUs)")
    a = ap.parse_args(argv)
    try:
        res = check([Path(f) for f in a.files] or None, tuple(a.preset or PRESETS), a.jobs,
                    None if a.no_cache else CACHE_DIR)
    except (RuntimeError, FileNotFoundError, ValueError) as e:
        print(f"compile check: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"nvcc": res.nvcc, "seconds": res.seconds, "ok": res.ok, "failures": res.failures,
                          "results": [asdict(r) for r in res.results]}, indent=1))
    else:
        if not res.results:
            print("compile check: no .cu files under " + ", ".join(_rel(d) for d in SOURCE_DIRS))
        print(format_table(res))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
