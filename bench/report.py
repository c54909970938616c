"""Regenerate ``bench/README.md`` from ``bench/results/*.json``: ``python3 -m bench.report [--check]``.

Two result layouts are read (both written on the device by the benchmarks):

* ``bench/harness.py`` ``result_file`` (``bench_gemv``): top level ``benchmark``, ``device``, ``driver``,
  ``commit``, ``date``, ``results``; each result ``shape`` (a shape name), ``N``, ``K``, ``weight``, ``M``,
  ``variant``, ``correct``, ``median_ms``, ``bytes``, ``gbps``, ``pct_of_4468`` (timing absent when the
  correctness check failed).
* the plain layout (``bench_mixers``): top level ``device``, ``driver``, ``commit``, ``date``, ``results``;
  each result ``name``, ``shape`` (str or list), ``bytes``, ``ms``, ``gbps``, ``frac_of_measured_bw``.

Kernel = ``name``, else ``benchmark variant``; shape = ``shape`` plus ``N×K``, ``weight`` and ``M=`` when
given. GB/s (decimal) defaults to ``bytes / ms / 1e6``, the fraction to ``gbps / 4468``. The table is the current
result of each benchmark: per benchmark (top-level ``benchmark``, else the file's stem) only its newest file
counts, and within it, per (kernel, shape), the entry of the newest ``date`` (ties: the later file name). Only
top-level ``*.json`` files are read for the table (not ``e2e/``, ``mtp/`` or the gzip'd timing dump); the
agent-trajectory replay's files ``e2e/replay_*.json`` get a section of their own (:func:`replay_section`). The
README is never edited by hand; ``tests/cpu/test_gpu_record.py`` fails when it differs from :func:`render` of the
JSON files.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
README = BENCH_DIR / "README.md"
# HBM read bandwidth of the project's H200, measured 2026-11-29 (shared/spec/h200.md): grid-stride uint4 read
MEASURED_BW_GBPS = 4468.0


def _shape(s) -> str:
    return "×".join(str(d) for d in s) if isinstance(s, (list, tuple)) else str(s)


def _row(doc: dict, r: dict, where: str) -> dict:
    if "name" not in r and "shape" not in r:
        raise ValueError(f"{where} has neither 'name' nor 'shape'")
    name = str(r.get("name") or " ".join(str(x) for x in (doc.get("benchmark"), r.get("variant")) if x))
    shape = " ".join(x for x in (_shape(r.get("shape", "")),
                                 f"{r['N']}×{r['K']}" if "N" in r and "K" in r else "",
                                 str(r.get("weight", "")), f"M={r['M']}" if "M" in r else "") if x)
    ms = r.get("ms", r.get("median_ms"))
    correct = r.get("correct")
    row = {"name": name, "shape": shape, "ms": None, "gbps": None, "frac": None,
           "check": {True: "pass", False: "FAILED"}.get(correct, "–")}
    if ms is None:
        if correct is False:
            return row  # failed its correctness check: not timed
        raise ValueError(f"{where} ({name}) lacks 'ms' / 'median_ms'")
    ms = float(ms)
    gbps = r.get("gbps")
    if gbps is None:
        if not r.get("bytes") or ms <= 0:
            raise ValueError(f"{where} ({name}) needs 'gbps', or 'bytes' and ms > 0")
        gbps = r["bytes"] / ms / 1e6
    frac = r.get("frac_of_measured_bw")
    if frac is None:
        frac = r["pct_of_4468"] / 100 if "pct_of_4468" in r else float(gbps) / MEASURED_BW_GBPS
    return {**row, "ms": ms, "gbps": float(gbps), "frac": float(frac)}


def load_results(results_dir: Path = RESULTS_DIR) -> list[dict]:
    """Every result row of every ``*.json`` in ``results_dir``, normalised and joined with its file's device,
    driver, commit, date and file name. Raises ValueError naming the file and the missing/invalid field."""
    rows = []
    for f in sorted(Path(results_dir).glob("*.json")):
        try:
            doc = json.loads(f.read_text())
        except ValueError as e:
            raise ValueError(f"{f}: not valid JSON ({e})") from None
        for key in ("device", "date", "results"):
            if key not in doc:
                raise ValueError(f"{f}: missing top-level field {key!r} (layouts: bench/report.py docstring)")
        meta = {"benchmark": str(doc.get("benchmark") or f.stem),
                "device": str(doc["device"]), "driver": str(doc.get("driver") or ""),
                "commit": str(doc.get("commit") or "unknown")[:10], "date": str(doc["date"]), "file": f.name}
        rows += [{**_row(doc, r, f"{f}: results[{i}]"), **meta} for i, r in enumerate(doc["results"])]
    return rows


def latest(rows: list[dict]) -> list[dict]:
    """The current rows: only each benchmark's newest file, then the newest row per (name, shape); sorted by
    benchmark, name, shape."""
    newest: dict[str, tuple[str, str]] = {}
    for r in rows:
        newest[r["benchmark"]] = max(newest.get(r["benchmark"], ("", "")), (r["date"], r["file"]))
    best: dict[tuple[str, str], dict] = {}
    for r in rows:
        if r["file"] != newest[r["benchmark"]][1]:
            continue
        k = (r["name"], r["shape"])
        if k not in best or (r["date"], r["file"]) >= (best[k]["date"], best[k]["file"]):
            best[k] = r
    return sorted(best.values(), key=lambda r: (r["benchmark"], r["name"], r["shape"]))


REPLAY_PNG = "replay.png"  # drawn by ``python3 -m bench.replay plot`` next to the replay result files


def replay_section(e2e_dir: Path) -> list[str]:
    """Markdown lines of the agent-trajectory replay (``bench/replay.py``): per result file ``replay_*.json`` in
    ``e2e_dir``, per executor and configuration, the totals over its trajectories (wall, prefill, decode, host
    seconds; tokens prefilled and generated) and the residency speed-up; a link to the PNG when it exists. No
    lines when there is no replay result."""
    files = sorted(Path(e2e_dir).glob("replay_*.json"))
    if not files:
        return []
    out = ["", "## Agent-trajectory replay", "",
           "Recorded agent conversations replayed at the recorded token count per step (`bench/replay.py`,",
           "`docs/replay.md`); seconds summed over the trajectories each configuration ran.", ""]
    if (Path(e2e_dir) / REPLAY_PNG).is_file():
        out += [f"![where the replay's time went](results/e2e/{REPLAY_PNG})", ""]
    out += ["| file | model | machine | executor | config | trajectories | tokens (max context) | wall s | prefill s "
            "| decode s | host s | prefilled | generated | date | commit |",
            "|---|---|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|---|"]
    speed = []
    for f in files:
        d = json.loads(f.read_text())
        for ex in dict.fromkeys(r["executor"] for r in d["runs"]):
            for c in dict.fromkeys(r["config"] for r in d["runs"]):
                rs = [r["totals"] for r in d["runs"] if r["executor"] == ex and r["config"] == c]
                if not rs:
                    continue
                s = {k: sum(t[k] for t in rs) for k in ("wall_ms", "prefill_ms", "decode_ms", "host_ms",
                                                        "prefilled_tokens", "generated_tokens")}
                out.append(f"| {f.name} | {d['model']} | {d['machine']} | {ex} | {c} | {len(rs)} | "
                           f"{max(t['context_tokens'] for t in rs):,} | {s['wall_ms'] / 1e3:.1f} | "
                           f"{s['prefill_ms'] / 1e3:.1f} | {s['decode_ms'] / 1e3:.1f} | {s['host_ms'] / 1e3:.2f} | "
                           f"{s['prefilled_tokens']:,} | {s['generated_tokens']:,} | {d['date'][:10]} | "
                           f"{str(d['commit'])[:7]} |")
        for ex, sp in d.get("residency_speedup", {}).items():
            speed.append(f"{d['model']} on {ex} ({d['machine']}): stateless / resident = {sp['total']:.2f}× over "
                         f"{', '.join(sp['trajectories'])}")
    if speed:
        out += ["", "Residency speed-up (the article measured 2.4× on its subset):", ""] + [f"- {x}" for x in speed]
    return out


def render(rows: list[dict], e2e_dir: Path = RESULTS_DIR / "e2e") -> str:
    """README text (Markdown) for the given rows, then the replay section of ``e2e_dir``
    (:func:`replay_section`)."""
    out = ["# Benchmarks", "",
           "Generated by `python3 -m bench.report` from `bench/results/*.json`; do not edit by hand (a CPU test",
           "fails when this file differs from the JSON files). The current result of each benchmark",
           "(`bench/bench_*.py`, one file each), measured on the device in its row; `check` is the benchmark's",
           "correctness gate. Bandwidth is decimal GB/s; the fraction is of the H200's measured HBM read bandwidth,",
           f"{MEASURED_BW_GBPS:,.0f} GB/s (`shared/spec/h200.md`). Experiments and their verdicts: `EXPERIMENTS.md`.",
           ""]
    rows = latest(rows)
    if not rows:
        return "\n".join(out + ["No results yet (`bench/results/` holds no JSON file)."] + replay_section(e2e_dir)
                         + [""])
    bw = f"{MEASURED_BW_GBPS:,.0f}"
    out += [f"| kernel | shape | check | ms | GB/s | % of {bw} GB/s | device | driver | commit | date | file |",
            "|---|---|---|--:|--:|--:|---|---|---|---|---|"]
    for r in rows:
        t = ("–", "–", "–") if r["ms"] is None else \
            (f"{r['ms']:.4f}", f"{r['gbps']:,.0f}", f"{100 * r['frac']:.1f} %")
        out.append(f"| {r['name']} | {r['shape']} | {r['check']} | {t[0]} | {t[1]} | {t[2]} | {r['device']} | "
                   f"{r['driver']} | {r['commit']} | {r['date']} | {r['file']} |")
    return "\n".join(out + replay_section(e2e_dir) + [""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.report", description="regenerate bench/README.md")
    ap.add_argument("--check", action="store_true", help="exit 1 if bench/README.md is stale; write nothing")
    a = ap.parse_args(argv)
    text = render(load_results(RESULTS_DIR))
    if a.check:
        stale = not README.is_file() or README.read_text() != text
        print("bench/README.md is " + ("stale: run python3 -m bench.report" if stale else "up to date"))
        return int(stale)
    README.write_text(text)
    print(f"wrote {README} ({len(latest(load_results(RESULTS_DIR)))} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
