"""bench/bench_load.py on the tiny preset without a GPU: write (NumPy, 2 processes) into a temporary sibling renamed
into place, the disk read rate, the load through the file path, every file tensor against NumPy's draw, the same
greedy ids from the files as from the preset; and the disk reader on its own."""
from __future__ import annotations

import json

from bench import bench_load


def test_bench_load_tiny_cpu_end_to_end(tmp_path):
    d = tmp_path / "ck"
    assert bench_load.main(["--preset", "tiny", "--executor", "cpu", "--workers", "2", "--tokens", "3",
                            "--dir", str(d), "--keep", "--out", str(tmp_path / "res")]) == 0
    doc = json.loads((tmp_path / "res" / "load_tiny_cpu.json").read_text())
    assert doc["ok"] and doc["checks"]["greedy"]["same"] and doc["checks"]["file_tensors"]["mismatch"] is None
    assert doc["checks"]["file_tensors"]["tensors"] == 181 and doc["write"]["shards"] == 1
    assert doc["disk_read"]["bytes"] == doc["load"]["bytes"] == sum(f.stat().st_size for f in d.glob("*.safetensors"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ck.tmp")]


def test_disk_read_rate_reads_every_byte(tmp_path):
    f = tmp_path / "a.safetensors"
    f.write_bytes(b"x" * (3 * 4096 + 100))
    r = bench_load.disk_read_rate([f])
    assert r["bytes"] == f.stat().st_size and r["files"] == 1 and r["mode"]
