"""The real checkpoint path at full scale (issue 24): write a synthetic checkpoint to disk, measure the disk's
sequential read rate, load it through the file path, and prove it equal to the weights drawn on the device.

``python3 -m bench.bench_load [--preset qwen3.5-27b] [--executor graph|megakernel|cpu] [--device auto|gpu|cpu]
[--dir DIR] [--keep] [--tokens 16] [--workers N] [--serial] [--buffers 3] [--buffer-mb 128] [--out DIR]``;
``python3 -m bench.bench_load --cpu-write-rate 1,2`` times the CPU writer alone (below).

1. Write: ``loader.synthetic.write_checkpoint`` of ``--preset`` (seed 0) into a temporary sibling of ``--dir``,
   renamed into place when complete; tensors drawn on the GPU (``host.gpu_checkpoint``) or by NumPy in
   ``--workers`` processes (``--device``). Every shard is fsync'd, so the time includes reaching the disk.
2. Disk: every shard read once with ``O_DIRECT`` (page cache bypassed; 64 MiB aligned reads) for the disk's
   sequential read rate in this run; where ``O_DIRECT`` is refused, read after ``POSIX_FADV_DONTNEED``.
3. Load: shards dropped from the page cache (fsync + ``POSIX_FADV_DONTNEED``), then ``Engine.load(DIR,
   executor)`` timed: config, headers, validation, upload (``WeightsGPU.from_source``: the staged pipeline of
   ``loader.staging``) and the executor's build. The rate is the checkpoint's bytes over that time; beside it its
   fraction of the disk rate of step 2, and the upload's own statistics (its bytes, seconds, GB/s and fraction of
   the disk rate; how long the reader waited for a free buffer and the copier for a filled one). A load faster
   than 1.5x the disk rate is flagged ``page_cache_suspected`` (the drop did not take). ``--serial`` also times
   the serial upload (``from_source(pipeline=False)``: one tensor at a time from pageable memory) after a second
   cache drop, in the same run. ``--buffers`` / ``--buffer-mb`` set the staging ring.
4. Equal: ``Engine.load(preset, executor)`` draws the same weights on the device (``WeightsGPU.from_synthetic``);
   every device tensor of the two (fused projections, scales, norms, tables) is compared bit for bit, the first
   mismatch named. On the cpu executor (and with ``--cpu-compare`` on a GPU) every tensor read from the files is
   compared with ``SyntheticWeights.get``. Then a greedy generation of ``--tokens`` from one prompt on both
   engines must give the same ids.
Writes ``load_<preset>_<executor>.json`` into ``--out`` (default bench/results/e2e). Exit 1 when a check fails.

``--cpu-write-rate W1,W2,..`` (no GPU needed): the CPU writer's rate with each worker count on a sample of the
27B (the first 12 chunks of ``embed_tokens``, bf16; every tensor of layer 0, mostly fp8), written to a file in
``--dir``'s parent, and the full write's time derived from the checkpoint's bf16 and fp8 bytes at those rates.
Writes ``load_cpu_write.json``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from bench.harness import commit, cpu_name, device_meta
from discrete.weights_gpu import Proj, WeightsGPU
from host.engine import Engine
from host.executors import CPU_KINDS, default_kind
from host.gpu_checkpoint import gpu_chunks, gpu_usable
from loader import staging, synthetic
from loader.checkpoint import Checkpoint, FP8, expected_tensors
from loader.config import preset
from loader.synthetic import SyntheticWeights, write_checkpoint
from loader.workers import WorkerPool

READ_BLOCK = 64 << 20
PROMPT = "def fibonacci(n):"


# ---------------------------------------------------------------------------------------------- disk
def shard_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def drop_cache(files) -> None:
    """fsync each file, then ask the kernel to drop its (now clean) pages: the next read comes from the disk."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_all(fd: int, buf) -> int:
    n = 0
    while (k := os.readv(fd, [buf])) > 0:
        n += k
    return n


def disk_read_rate(files) -> dict:
    """Sequential read of every file, bypassing the page cache: O_DIRECT into an aligned 64 MiB buffer, or plain
    reads after POSIX_FADV_DONTNEED where the file system refuses O_DIRECT. Returns bytes, seconds, GB/s, mode."""
    buf = mmap.mmap(-1, READ_BLOCK)  # page-aligned, as O_DIRECT needs
    direct = getattr(os, "O_DIRECT", None)
    total, modes = 0, set()
    t0 = time.perf_counter()
    for f in files:
        n = None
        if direct is not None:
            try:
                fd = os.open(f, os.O_RDONLY | direct)
                try:
                    n = _read_all(fd, buf)
                finally:
                    os.close(fd)
                modes.add("O_DIRECT")
            except OSError:  # EINVAL: this file system does not do O_DIRECT
                n = None
        if n is None:
            drop_cache([f])
            fd = os.open(f, os.O_RDONLY)
            try:
                n = _read_all(fd, buf)
            finally:
                os.close(fd)
            modes.add("fadvise DONTNEED")
        total += n
    s = time.perf_counter() - t0
    return {"bytes": total, "seconds": round(s, 3), "gbps": round(total / s / 1e9, 3), "mode": sorted(modes),
            "files": len(files)}


# ---------------------------------------------------------------------------------------------- compare
def device_tensors(wg) -> dict:
    """name -> device array of every tensor a ``WeightsGPU`` holds (the views ``a``/``b`` are inside ``ba``)."""
    out = {"embed": wg.embed, "final_norm": wg.final_norm, "lm_head": wg.lm_head}
    for i, L in enumerate(wg.layers):
        for k, v in L.items():
            if k in ("a", "b"):
                continue
            if isinstance(v, Proj):
                out[f"layers.{i}.{k}.w"] = v.w
                if v.scale is not None:
                    out[f"layers.{i}.{k}.scale"] = v.scale
            else:
                out[f"layers.{i}.{k}"] = v
    return out


def compare_device(wa, wb) -> dict:
    """Bit comparison of two ``WeightsGPU``: {"tensors", "bytes", "mismatch": None or (name, first flat index)}."""
    import cupy as cp
    ta, tb = device_tensors(wa), device_tensors(wb)
    if list(ta) != list(tb):
        return {"tensors": len(ta), "bytes": 0, "mismatch": ("tensor lists differ", -1)}
    nbytes = 0
    for n, a in ta.items():
        b = tb[n]
        if a.shape != b.shape or a.dtype != b.dtype:
            return {"tensors": len(ta), "bytes": nbytes, "mismatch": (f"{n}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}", -1)}
        if not bool(cp.array_equal(a, b)):
            return {"tensors": len(ta), "bytes": nbytes, "mismatch": (n, int(cp.argmax((a != b).ravel())))}
        nbytes += a.nbytes
    return {"tensors": len(ta), "bytes": int(nbytes), "mismatch": None}


def compare_files(d: Path, cfg, seed: int) -> dict:
    """Every tensor read from checkpoint ``d`` against ``SyntheticWeights.get`` (bits; NumPy, slow for the 27B)."""
    ck, syn = Checkpoint.open(d), SyntheticWeights(cfg, seed)
    if ck.names() != syn.names():
        return {"tensors": len(ck.names()), "bytes": 0, "mismatch": ("tensor lists differ", -1)}
    nbytes = 0
    for n in ck.names():
        a, b = np.asarray(ck.get(n)), syn.get(n)
        ua, ub = (x.view(np.uint8 if x.dtype.itemsize == 1 else np.uint16) for x in (a, b))
        if ua.shape != ub.shape or not np.array_equal(ua, ub):
            idx = -1 if ua.shape != ub.shape else int(np.argmax((ua != ub).ravel()))
            return {"tensors": len(ck.names()), "bytes": nbytes, "mismatch": (n, idx)}
        nbytes += a.nbytes
    return {"tensors": len(ck.names()), "bytes": int(nbytes), "mismatch": None}


# ---------------------------------------------------------------------------------------------- write
def write(cfg, d: Path, seed: int, device: str, workers: int) -> dict:
    """Write the checkpoint into a temporary sibling of ``d`` and rename it into place (``d`` must not exist)."""
    gen = None
    if device in ("auto", "gpu"):
        ok, why = gpu_usable()
        if ok:
            gen = gpu_chunks
        elif device == "gpu":
            raise SystemExit(f"bench_load: --device gpu: {why}")
    if d.exists():
        raise SystemExit(f"bench_load: --dir {d} exists; give a new directory")
    tmp = d.parent / f".{d.name}.tmp-{os.getpid()}"
    try:
        res = write_checkpoint(cfg, tmp, seed, tokenizer="require", workers=workers, generate=gen,
                               log=lambda m: print(f"bench_load: {m}", file=sys.stderr, flush=True),
                               progress=f"{cfg.name} -> {d}")
        t0 = time.perf_counter()
        drop_cache(shard_files(tmp))  # fsync: the write is on the disk
        res["seconds"] += time.perf_counter() - t0
        os.rename(tmp, d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"drawn": "gpu" if gen else f"cpu, {workers} process(es)", "bytes": res["bytes"],
            "seconds": round(res["seconds"], 2), "gbps": round(res["bytes"] / res["seconds"] / 1e9, 3),
            "shards": res["shards"]}


def cpu_write_rate(workers: list[int], where: Path) -> dict:
    """The CPU writer (``loader.synthetic``'s jobs in a ``WorkerPool``) on a sample of the 27B per worker count,
    and the full write's time derived from the checkpoint's bf16 and fp8 bytes at the sampled rates."""
    cfg = preset("qwen3.5-27b")
    src = synthetic.SyntheticWeights(cfg, 0)
    exp = expected_tensors(cfg)
    samples = {"bf16 (embed_tokens, 12 chunks)": list(synthetic._jobs(src, ["model.embed_tokens.weight"]))[:12],
               "layer 0 (every tensor, mostly fp8)": list(synthetic._jobs(src, [n for n in exp
                                                                                 if n.startswith("model.layers.0.")]))}
    nbytes = {"bf16": 0, "fp8": 0}
    for n, (shape, dtn) in exp.items():
        nbytes["fp8" if dtn == FP8 or n.endswith("_scale_inv") else "bf16"] += math.prod(shape) * np.dtype(
            getattr(ml_dtypes, dtn)).itemsize
    f = where / f".bench_load_cpu_write-{os.getpid()}.bin"
    rows = []
    try:
        for w in workers:
            rates = {}
            for label, jobs in samples.items():
                t0, total, scales = time.perf_counter(), 0, {}
                with WorkerPool(w) as pool, open(f, "wb") as fh:
                    for job, (data, sc) in pool.ordered(synthetic._run_job, iter(jobs)):
                        if job[0] == "scale":
                            data = np.concatenate(scales.pop(job[1])).tobytes()
                        elif sc is not None:
                            scales.setdefault(job[1].name, []).append(sc)
                        fh.write(data)
                        total += len(data)
                s = time.perf_counter() - t0
                rates[label] = {"bytes": total, "seconds": round(s, 2), "mb_s": round(total / s / 1e6, 1)}
            bf, l0 = (rates[k]["mb_s"] * 1e6 for k in samples)
            est = nbytes["bf16"] / bf + nbytes["fp8"] / l0
            rows.append({"workers": w, "measured": rates, "derived_full_write_s": round(est),
                         "derived_full_write_min": round(est / 60, 1)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        f.unlink(missing_ok=True)
    return {"checkpoint_bytes": nbytes, "results": rows}


def serial_upload(d: Path, files, disk_gbps: float) -> dict:
    """The serial upload (``WeightsGPU.from_source(pipeline=False)``) of checkpoint ``d`` after a cache drop, timed
    with its open; the device copy is freed after."""
    import cupy as cp

    drop_cache(files)
    t0 = time.perf_counter()
    w = WeightsGPU.from_source(Checkpoint.open(d), pipeline=False)
    s = time.perf_counter() - t0
    n = w.nbytes
    del w
    cp.get_default_memory_pool().free_all_blocks()
    return {"device_bytes": int(n), "seconds": round(s, 2), "gbps": round(n / s / 1e9, 3),
            "frac_of_disk": round(n / s / 1e9 / disk_gbps, 3)}


def _staging_defaults(a) -> None:
    """--buffers / --buffer-mb: the staging ring of every upload in this process."""
    if a.buffers:
        staging.DEFAULT_BUFFERS = a.buffers
    if a.buffer_mb:
        staging.DEFAULT_BUFFER_BYTES = a.buffer_mb << 20


# ---------------------------------------------------------------------------------------------- main
def _meta(gpu: bool) -> dict:
    if gpu:
        meta = device_meta()
    else:
        meta = {"device": cpu_name()}
    return {**meta, "host_cpu": cpu_name(), "nproc": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()],
            "commit": commit(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def _greedy(engine, ids, n: int) -> list[int]:
    return list(engine.generate(ids, max_new_tokens=n, temperature=0, stop_ids=[]).result().ids)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.bench_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3.5-27b")
    ap.add_argument("--executor", default=None, help="graph | megakernel | cpu | cpu-vm (default: graph on a GPU, "
                    "else cpu)")
    ap.add_argument("--device", default="auto", choices=["auto", "gpu", "cpu"], help="where the write draws tensors")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dir", default=None, help="checkpoint directory to write (new; default: a temporary one, "
                    "deleted at the end unless --keep)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--cpu-compare", action="store_true", help="also compare every file tensor with NumPy's draw")
    ap.add_argument("--serial", action="store_true", help="also time the serial upload (pipeline=False)")
    ap.add_argument("--buffers", type=int, default=None, help="staging buffers (default: loader.staging's)")
    ap.add_argument("--buffer-mb", type=int, default=None, help="staging buffer size in MiB")
    ap.add_argument("--cpu-write-rate", default=None, help="only time the CPU writer with these worker counts")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "e2e"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    if a.cpu_write_rate:
        where = Path(a.dir).parent if a.dir else Path(tempfile.gettempdir())
        doc = {"benchmark": "load_cpu_write", **_meta(False),
               **cpu_write_rate([int(x) for x in a.cpu_write_rate.split(",")], where)}
        out.mkdir(parents=True, exist_ok=True)
        (out / "load_cpu_write.json").write_text(json.dumps(doc, indent=1) + "\n")
        return 0

    cfg = preset(a.preset)
    kind = a.executor or default_kind()
    gpu = kind not in CPU_KINDS
    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="qmk-load-")) / a.preset
    ok, doc = True, {"benchmark": "load", "preset": a.preset, "executor": kind, **_meta(gpu)}
    try:
        doc["write"] = write(cfg, base, 0, a.device, a.workers)
        print(json.dumps({"write": doc["write"]}), flush=True)
        files = shard_files(base)
        ck_bytes = sum(f.stat().st_size for f in files)
        doc["disk_read"] = disk_read_rate(files)
        print(json.dumps({"disk_read": doc["disk_read"]}), flush=True)
        _staging_defaults(a)
        disk = doc["disk_read"]["gbps"]
        drop_cache(files)
        t0 = time.perf_counter()
        eng = Engine.load(base, executor=kind, quiet=True)
        load_s = time.perf_counter() - t0
        gbps = ck_bytes / load_s / 1e9
        up = getattr(eng.executor, "upload_stats", None)
        if up:
            up = {**up, "frac_of_disk": round(up["gbps"] / disk, 3) if up["gbps"] else None}
        doc["load"] = {"bytes": ck_bytes, "seconds": round(load_s, 2), "gbps": round(gbps, 3),
                       "frac_of_disk": round(gbps / disk, 3), "page_cache_suspected": gbps > 1.5 * disk,
                       "executor_weights_s": round(getattr(eng.executor, "load_s", float("nan")), 2),
                       "upload": up, "executor_detail": eng.executor.detail}
        print(json.dumps({"load": doc["load"]}), flush=True)
        if a.serial and gpu:
            doc["serial_upload"] = serial_upload(base, files, disk)
            print(json.dumps({"serial_upload": doc["serial_upload"]}), flush=True)
        t0 = time.perf_counter()
        ref = Engine.load(a.preset, executor=kind, quiet=True)
        doc["synthetic_load_s"] = round(time.perf_counter() - t0, 2)
        checks = {}
        if gpu:
            checks["device_weights"] = compare_device(eng.executor.dstep.w, ref.executor.dstep.w)
        if not gpu or a.cpu_compare:
            checks["file_tensors"] = compare_files(base, cfg, 0)
        ids = eng.encode(PROMPT)
        ga, gb = _greedy(eng, ids, a.tokens), _greedy(ref, ids, a.tokens)
        checks["greedy"] = {"prompt": PROMPT, "tokens": a.tokens, "ids_file": ga, "ids_synthetic": gb,
                            "same": ga == gb}
        ok = ga == gb and all(c["mismatch"] is None for k, c in checks.items() if k != "greedy")
        doc["checks"], doc["ok"] = checks, ok
        print(json.dumps({"checks": checks}), flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(base if a.dir else base.parent, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    p = out / f"load_{a.preset}_{kind}.json"
    p.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"bench_load: {'ok' if ok else 'CHECK FAILED'}; wrote {p}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
