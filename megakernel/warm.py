"""Warm-up of CuPy's on-disk kernel cache: compile, in parallel processes, every module a decode step and a
megakernel of a preset load (the megakernel's decode / M-row / fused-reduce / timing builds and each discrete
kernel with the defines its launcher passes), so the first run of an engine does not wait on NVRTC.

``python3 -m megakernel.warm PRESET [PRESET ...]`` (``scripts/mk_check.sh`` runs it first).
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from discrete import attention, gdn
from discrete.build import load_module
from discrete.device_state import control_defines
from discrete.lm_head import DEFAULT_DEFINES, TOPK
from loader.config import preset as get_preset
from megakernel import build
from megakernel.runner import DEFAULT_FUSE, mk_defines


def warm_jobs(preset: str) -> list[tuple]:
    """(preset, sources, defines, cooperative) of every module a decode step + megakernel of ``preset``
    compiles, with the defines their launchers pass (a mismatch only costs a cache miss later). For the
    megakernel (cooperative) ``defines`` holds ``mk_defines``' knobs: fuse_reduce, timing, m1 (and extra)."""
    cfg = get_preset(preset)
    mk = [(preset, [str(build.SOURCE)], {"fuse_reduce": f, "timing": t, "m1": m1}, True)
          for f, t, m1 in ((True, False, True), (DEFAULT_FUSE, False, True), (True, False, False),
                           (DEFAULT_FUSE, False, False), (DEFAULT_FUSE, True, True))]
    return mk + [(preset, ["gemv.cu"], None, False), (preset, ["lm_head.cu"], {"QMK_TOPK": TOPK, **DEFAULT_DEFINES}, False),
            (preset, ["embed.cu"], None, False), (preset, ["gdn.cu"], gdn.extra_defines(cfg), False),
            (preset, ["attention.cu"], attention.extra_defines(cfg), False),
            (preset, ["finish.cu"], control_defines(), False), (preset, ["hashgen.cu"], None, False)]


def _warm_one(job) -> str:
    t = time.perf_counter()
    try:
        cfg = get_preset(job[0])
        if job[3]:  # the megakernel: job[2] = mk_defines' knobs
            k = job[2]
            build.load(cfg, mk_defines(cfg, k["timing"], k.get("extra"), k["fuse_reduce"], k.get("m1", False)))
        else:
            load_module(cfg, job[1], job[2]).compile()
        return f"{job[0]} {Path(job[1][0]).name} {job[2] if job[3] else ''} " \
               f"{time.perf_counter() - t:.1f} s"
    except Exception as e:  # report, never stop the others
        return f"{job[0]} {job[1]}: FAILED {type(e).__name__}: {str(e)[:2000]}"


def warm(presets: list[str], workers: int = 16, jobs: list | None = None) -> None:
    """Compile every module of ``presets`` (or the given ``warm_jobs``-style jobs) in parallel processes,
    filling CuPy's on-disk kernel cache; prints one line per module (time, or the failure)."""
    jobs = jobs if jobs is not None else [j for p in presets for j in warm_jobs(p)]
    with ProcessPoolExecutor(min(workers, len(jobs))) as ex:
        for line in ex.map(_warm_one, jobs):
            print("warm:", line, flush=True)


def main(argv: list[str]) -> int:
    """``PRESET [PRESET ...]``: warm those presets; returns the exit status (2 on no preset)."""
    if not argv:
        print("usage: python3 -m megakernel.warm PRESET [PRESET ...]")
        return 2
    warm(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
