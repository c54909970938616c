"""The GPU test record: what a run of ``tests/gpu`` on a device verified, and the CPU-side check that the
sources landing are the ones that run verified.

Hashed set (paths relative to the repository root, '/'-separated): every ``*.cu``, ``*.cuh``, ``*.h`` and
``*.py`` under ``discrete/`` and ``megakernel/``, plus every ``*.py`` under ``tests/gpu/`` and the tolerance
policy the GPU tests apply, ``tests/tolerance.py`` (a GPU test or tolerance that was added or edited but never run
is unverified too). Folders named ``__pycache__``, ``*.egg-info`` or
starting with '.' are skipped. Each file's SHA-256 is recorded; the combined hash is the SHA-256 of the
lines ``"<path>\\0<sha256>\\n"`` in path order.

The record (``tests/gpu/RECORD.json``) is written by ``tests/gpu/conftest.py`` through
:class:`RecordCollector` and checked by :func:`verify` (``tests/cpu/test_gpu_record.py``).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD_PATH = ROOT / "tests" / "gpu" / "RECORD.json"
CUDA_EXTS = (".cu", ".cuh", ".h")
HASHED = (("discrete", CUDA_EXTS + (".py",)), ("megakernel", CUDA_EXTS + (".py",)), ("tests/gpu", (".py",)),
          ("tests/tolerance.py", (".py",)))  # (folder or file, suffixes)
SCHEMA = 1
BAD_OUTCOMES = ("failed", "error", "xpassed")


def _skipped_dir(rel: Path) -> bool:
    return any(p == "__pycache__" or p.startswith(".") or p.endswith(".egg-info") for p in rel.parts[:-1])


def file_hashes(root: Path = ROOT) -> dict[str, str]:
    """SHA-256 (hex) of every file in the hashed set under ``root``, keyed by relative posix path."""
    out = {}
    for folder, exts in HASHED:
        base = Path(root) / folder
        if not base.exists():
            continue
        for p in (base.rglob("*") if base.is_dir() else [base]):
            rel = p.relative_to(root)
            if p.is_file() and p.suffix in exts and not _skipped_dir(rel):
                out[rel.as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return dict(sorted(out.items()))


def combined_hash(hashes: dict[str, str]) -> str:
    """One SHA-256 over (path, file hash) pairs in path order."""
    h = hashlib.sha256()
    for path in sorted(hashes):
        h.update(f"{path}\0{hashes[path]}\n".encode())
    return h.hexdigest()


def diff_files(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Lines 'changed: p', 'added: p', 'removed: p' between two hash maps, in path order."""
    out = []
    for p in sorted(set(old) | set(new)):
        if p not in old:
            out.append(f"added: {p}")
        elif p not in new:
            out.append(f"removed: {p}")
        elif old[p] != new[p]:
            out.append(f"changed: {p}")
    return out


def verify(root: Path = ROOT, record_path: Path | None = None) -> list[str]:
    """Problems that make the landing sources unverified (empty list = verified). Fails when CUDA sources
    exist and the record is missing or unreadable, shows a failed/errored test, no passed test or an
    incomplete run, or was taken over different sources (the changed files are listed)."""
    root = Path(root)
    record_path = Path(record_path) if record_path else root / RECORD_PATH.relative_to(ROOT)
    hashes = file_hashes(root)
    cuda = [p for p in hashes if p.endswith(CUDA_EXTS)]
    fix = "run scripts/gpu_tests.sh on the H200 and commit its tests/gpu/RECORD.json"
    if not record_path.is_file():
        if not cuda:
            return []
        return [f"no GPU test record at {record_path} but {len(cuda)} CUDA sources exist "
                f"(e.g. {', '.join(cuda[:3])}): {fix}"]
    try:
        rec = json.loads(record_path.read_text())
        counts, files, tests = rec["counts"], rec["files"], rec["tests"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{record_path}: not a GPU test record ({type(e).__name__}: {e}): {fix}"]
    problems = []
    bad = [f"  {t['outcome']}: {t['nodeid']}" for t in tests if t.get("outcome") in BAD_OUTCOMES]
    if bad or any(counts.get(k, 0) for k in BAD_OUTCOMES):
        problems.append(f"the GPU run of {rec.get('date')} on {rec.get('device', {}).get('name')} did not "
                        f"pass ({counts}):\n" + "\n".join(bad))
    if not counts.get("passed"):
        problems.append(f"the GPU run of {rec.get('date')} passed no test ({counts})")
    if not rec.get("complete"):
        problems.append("the GPU run covered only part of tests/gpu: "
                        + "; ".join(rec.get("incomplete_reasons") or ["not marked complete"]))
    if combined_hash(hashes) != rec.get("sources_hash") or hashes != files:
        changed = diff_files(files, hashes)
        problems.append(f"{len(changed)} file(s) changed since the GPU run of {rec.get('date')} "
                        f"(record {record_path.name}):\n  " + "\n  ".join(changed))
    return [p + ("" if p.endswith(fix) else f"\n-> {fix}") for p in problems]


class RecordCollector:
    """Accumulates pytest reports of tests under ``tests/gpu`` into a record dict.

    Feed it :meth:`add_report` (pytest ``TestReport``/``CollectReport``-like objects: ``nodeid``, ``when``,
    ``outcome``, ``duration`` seconds, optional ``wasxfail``, ``longrepr``), :meth:`expect` (collected node
    ids) and :meth:`deselect`; :meth:`record` builds the JSON-ready dict.
    """

    def __init__(self, root: Path = ROOT):
        self.root = Path(root)
        self.hashes = file_hashes(self.root)  # taken before the tests run
        self.tests: dict[str, dict] = {}
        self.expected: list[str] = []
        self.deselected: list[str] = []
        self.collect_errors: list[str] = []

    def expect(self, nodeids):
        self.expected += list(nodeids)

    def deselect(self, nodeids):
        self.deselected += list(nodeids)

    def add_report(self, rep) -> None:
        if getattr(rep, "when", None) in (None, "collect"):  # a collection report
            if rep.outcome == "failed":
                self.collect_errors.append(rep.nodeid)
                self.tests[rep.nodeid] = {"nodeid": rep.nodeid, "outcome": "error", "duration_s": 0.0,
                                          "message": _message(rep)}
            return
        t = self.tests.setdefault(rep.nodeid, {"nodeid": rep.nodeid, "outcome": None, "duration_s": 0.0})
        t["duration_s"] = round(t["duration_s"] + float(rep.duration or 0.0), 6)
        xfail = hasattr(rep, "wasxfail")
        if rep.outcome == "failed":
            t["outcome"] = "failed" if rep.when == "call" else "error"
            t["message"] = _message(rep)
        elif t["outcome"] in ("failed", "error"):
            pass  # a later phase does not clear an earlier failure
        elif rep.outcome == "skipped":
            t["outcome"] = "xfailed" if xfail else "skipped"
            t["message"] = _message(rep)
        elif rep.when == "call":
            t["outcome"] = "xpassed" if xfail else "passed"

    def ran_any(self) -> bool:
        """True when some test got past 'skipped' (passed, failed or errored) or collection failed."""
        return any(t["outcome"] not in (None, "skipped", "xfailed") for t in self.tests.values())

    def record(self, device: dict, extra: dict | None = None) -> dict:
        collected = set(self.expected) | set(self.deselected)
        counts, reasons = _summary(self.root, self.tests, collected, set(self.deselected), self.collect_errors)
        tests = sorted(self.tests.values(), key=lambda t: t["nodeid"])
        return {
            "schema": SCHEMA,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device,
            **(extra or {}),
            "complete": not reasons,
            "incomplete_reasons": reasons,
            "counts": counts,
            "duration_s": round(sum(t["duration_s"] for t in tests), 3),
            "tests": tests,
            "collected": sorted(collected),
            "deselected": sorted(self.deselected),
            "sources_hash": combined_hash(self.hashes),
            "files": self.hashes,
        }


def _summary(root: Path, tests: dict[str, dict], collected: set[str], deselected: set[str],
             collect_errors=()) -> tuple[dict, list[str]]:
    """(outcome counts, reasons the run is incomplete) of a set of test results."""
    counts = {k: 0 for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")}
    for t in tests.values():
        counts[t["outcome"] or "error"] += 1
    reasons = []
    unrun = sorted(n for n in collected if tests.get(n, {}).get("outcome") is None)
    desel = [n for n in unrun if n in deselected]
    if desel:
        reasons.append(f"{len(desel)} test(s) deselected (-k/-m), e.g. {desel[0]}")
    if len(unrun) > len(desel):
        reasons.append(f"{len(unrun) - len(desel)} collected test(s) did not run, e.g. "
                       f"{next(n for n in unrun if n not in deselected)}")
    on_disk = {p.relative_to(root).as_posix() for p in (Path(root) / "tests" / "gpu").rglob("test_*.py")}
    seen = {n.split("::")[0] for n in set(collected) | set(collect_errors)}
    if on_disk - seen:
        reasons.append("test files not collected: " + ", ".join(sorted(on_disk - seen)))
    return counts, reasons


def merge_records(records: list[dict], root: Path = ROOT) -> dict:
    """One record from several partial runs over the same sources and device (e.g. ``-k "not slow"`` and
    ``-k slow`` when one run does not fit a time limit); a test run twice keeps its latest result. Complete
    when together they ran every collected test of every test file. Raises ValueError on mixed sources or
    devices, or records without the ``collected`` list."""
    if not records:
        raise ValueError("merge_records: no records given")
    recs = sorted(records, key=lambda r: r["date"])
    if len({r["sources_hash"] for r in recs}) != 1:
        raise ValueError("records were taken over different sources: "
                         + ", ".join(f"{r['date']}: {r['sources_hash'][:12]}" for r in recs))
    if len({json.dumps(r["device"].get("name")) for r in recs}) != 1:
        raise ValueError("records come from different devices: " + ", ".join(str(r["device"]) for r in recs))
    if any("collected" not in r for r in recs):
        raise ValueError("a record lacks the 'collected' list (written by an older conftest): rerun it")
    tests = {t["nodeid"]: t for r in recs for t in r["tests"]}
    collected = set().union(*(r["collected"] for r in recs))
    deselected = set().union(*(r["deselected"] for r in recs))
    errors = [t["nodeid"] for t in tests.values() if "::" not in t["nodeid"]]
    counts, reasons = _summary(Path(root), tests, collected, deselected, errors)
    return {**recs[-1], "complete": not reasons, "incomplete_reasons": reasons, "counts": counts,
            "duration_s": round(sum(t["duration_s"] for t in tests.values()), 3),
            "tests": sorted(tests.values(), key=lambda t: t["nodeid"]), "collected": sorted(collected),
            "deselected": sorted(deselected - set(tests)), "merged_from": [r["date"] for r in recs],
            "args": [r.get("args") for r in recs]}


def _message(rep) -> str:
    """Last line of a report's longrepr (skip reason or error), at most 300 characters."""
    lr = getattr(rep, "longrepr", None)
    if lr is None:
        return ""
    if isinstance(lr, tuple) and len(lr) == 3:  # skip: (file, line, reason)
        return str(lr[2])[:300]
    text = str(lr).strip().splitlines()
    return text[-1][:300] if text else ""


def write_record(record: dict, path: Path | None = RECORD_PATH) -> list[Path]:
    """Write the record to ``path`` (None: skip) and, when ``$QMK_RECORD_OUT`` is set, a copy there (a
    directory gets ``RECORD.json`` inside). Returns the paths written."""
    text = json.dumps(record, indent=1) + "\n"
    targets = [Path(path)] if path else []
    out = os.environ.get("QMK_RECORD_OUT")
    if out:
        targets.append(Path(out) / "RECORD.json" if Path(out).is_dir() else Path(out))
    for t in targets:
        t.parent.mkdir(parents=True, exist_ok=True)
        t.write_text(text)
    return targets


def main(argv: list[str] | None = None) -> int:
    """``python3 -m tests.gpu_record check`` prints :func:`verify`'s verdict (exit 1 if not verified);
    ``python3 -m tests.gpu_record merge OUT.json IN.json ...`` writes :func:`merge_records` of the inputs."""
    import sys
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["check"] and len(args) == 1:
        problems = verify()
        print("GPU record: " + ("OK" if not problems else "NOT VERIFIED\n" + "\n".join(problems)))
        return int(bool(problems))
    if args[:1] == ["merge"] and len(args) >= 3:
        rec = merge_records([json.loads(Path(a).read_text()) for a in args[2:]])
        Path(args[1]).write_text(json.dumps(rec, indent=1) + "\n")
        print(f"wrote {args[1]}: complete={rec['complete']} counts={rec['counts']} "
              + "; ".join(rec["incomplete_reasons"]))
        return 0
    print(main.__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
