"""Kernel code never lands unverified: the CUDA sources must match the last passing GPU test record
(tests/gpu/RECORD.json), and bench/README.md must match bench/results/*.json. The checkers themselves are
tested on temporary trees, including the real tests/gpu/conftest.py run in a subprocess."""
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `pytest` without `python3 -m` does not put the repo root on sys.path
    sys.path.insert(0, str(ROOT))
from tests import gpu_record as gr  # noqa: E402


def test_landing_sources_match_the_gpu_record():
    problems = gr.verify()
    assert not problems, "GPU verification record does not cover these sources:\n" + "\n".join(problems)


def test_bench_readme_is_generated_from_results():
    from bench import report
    want = report.render(report.load_results(report.RESULTS_DIR))
    have = report.README.read_text() if report.README.is_file() else ""
    assert have == want, "bench/README.md is stale: run `python3 -m bench.report` and commit it"


# ---- the checker on temporary trees ----

def _tree(tmp_path):
    files = {"discrete/kernels/a.cu": "// a\n", "discrete/kernels/a.cuh": "// h\n", "discrete/launch.py": "x=1\n",
             "megakernel/include/isa.h": "// isa\n", "megakernel/mk.py": "y=2\n",
             "tests/gpu/test_k.py": "def test_k(): pass\n", "tests/tolerance.py": "TOL=1\n",
             "tests/helpers.py": "not hashed", "discrete/__pycache__/launch.cpython-311.pyc": "junk", "discrete/kernels/notes.txt": "not hashed"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def _rep(nodeid, when, outcome, duration=0.01, **kw):
    return SimpleNamespace(nodeid=nodeid, when=when, outcome=outcome, duration=duration, longrepr=None, **kw)


def _passing(root, nodeid="tests/gpu/test_k.py::test_k"):
    col = gr.RecordCollector(root)
    col.expect([nodeid])
    for when in ("setup", "call", "teardown"):
        col.add_report(_rep(nodeid, when, "passed"))
    return col


def _write(col, root):
    return gr.write_record(col.record({"name": "fake"}), root / "tests/gpu/RECORD.json")


def test_hashed_set(tmp_path):
    root = _tree(tmp_path)
    assert sorted(gr.file_hashes(root)) == ["discrete/kernels/a.cu", "discrete/kernels/a.cuh",
                                            "discrete/launch.py", "megakernel/include/isa.h", "megakernel/mk.py",
                                            "tests/gpu/test_k.py", "tests/tolerance.py"]


def test_clean_record_passes_and_copy_goes_to_record_out(tmp_path, monkeypatch):
    root = _tree(tmp_path / "repo")
    monkeypatch.setenv("QMK_RECORD_OUT", str(tmp_path / "out.json"))
    written = _write(_passing(root), root)
    assert written[1] == tmp_path / "out.json" and written[1].read_text() == written[0].read_text()
    assert gr.verify(root) == []
    rec = json.loads(written[0].read_text())
    assert rec["counts"]["passed"] == 1 and rec["complete"] and rec["tests"][0]["duration_s"] == pytest.approx(0.03)


@pytest.mark.parametrize("edit, line", [
    ("change", "changed: discrete/kernels/a.cuh"), ("add", "added: megakernel/new.cu"),
    ("remove", "removed: discrete/launch.py"), ("test", "changed: tests/gpu/test_k.py")])
def test_changed_files_since_the_gpu_run_fail_and_are_listed(tmp_path, edit, line):
    root = _tree(tmp_path)
    _write(_passing(root), root)
    if edit == "change":
        (root / "discrete/kernels/a.cuh").write_text("// h edited\n")
    elif edit == "add":
        (root / "megakernel/new.cu").write_text("// new\n")
    elif edit == "remove":
        (root / "discrete/launch.py").unlink()
    else:
        (root / "tests/gpu/test_k.py").write_text("def test_k(): assert 1\n")
    (problem,) = gr.verify(root)
    assert "1 file(s) changed since the GPU run" in problem and line in problem
    assert "scripts/gpu_tests.sh" in problem


def test_unhashed_files_do_not_matter(tmp_path):  # negative control for the test above
    root = _tree(tmp_path)
    _write(_passing(root), root)
    (root / "discrete/kernels/notes.txt").write_text("edited")
    (root / "discrete/__pycache__/launch.cpython-311.pyc").write_text("rebuilt")
    assert gr.verify(root) == []


@pytest.mark.parametrize("when, outcome", [("call", "failed"), ("setup", "error"), ("teardown", "error")])
def test_failure_in_the_record_fails(tmp_path, when, outcome):
    root = _tree(tmp_path)
    col = _passing(root)
    bad = "tests/gpu/test_k.py::test_bad"
    col.expect([bad])
    col.add_report(_rep(bad, "setup", "failed" if when == "setup" else "passed"))
    if when != "setup":
        col.add_report(_rep(bad, "call", "failed" if when == "call" else "passed"))
        col.add_report(_rep(bad, "teardown", "failed" if when == "teardown" else "passed"))
    _write(col, root)
    problems = "\n".join(gr.verify(root))
    assert "did not pass" in problems and f"{outcome}: {bad}" in problems


def test_missing_record_fails_only_when_cuda_sources_exist(tmp_path):
    root = _tree(tmp_path)
    (problem,) = gr.verify(root)
    assert "no GPU test record" in problem and "discrete/kernels/a.cu" in problem
    for p in ("discrete/kernels/a.cu", "discrete/kernels/a.cuh", "megakernel/include/isa.h"):
        (root / p).unlink()
    assert gr.verify(root) == []


def test_incomplete_or_empty_or_garbled_records_fail(tmp_path):
    root = _tree(tmp_path)
    col = _passing(root)
    col.deselect(["tests/gpu/test_k.py::test_other"])
    _write(col, root)
    assert "deselected" in "\n".join(gr.verify(root))
    (root / "tests/gpu/test_more.py").write_text("def test_m(): pass\n")
    col = _passing(root)
    _write(col, root)
    assert "test files not collected: tests/gpu/test_more.py" in "\n".join(gr.verify(root))
    (root / "tests/gpu/test_more.py").unlink()
    col = gr.RecordCollector(root)
    col.add_report(_rep("tests/gpu/test_k.py::test_k", "setup", "skipped"))
    assert not col.ran_any()
    _write(col, root)
    assert "passed no test" in "\n".join(gr.verify(root))
    (root / "tests/gpu/RECORD.json").write_text("{not json")
    assert "not a GPU test record" in "\n".join(gr.verify(root))


def test_partial_runs_merge_into_a_complete_record(tmp_path):
    root = _tree(tmp_path)
    k, j = "tests/gpu/test_k.py::test_k", "tests/gpu/test_k.py::test_j"
    recs = []
    for run, skip in ((k, j), (j, k)):
        col = _passing(root, run)
        col.deselect([skip])
        recs.append(col.record({"name": "fake"}))
        assert not recs[-1]["complete"] and "deselected" in recs[-1]["incomplete_reasons"][0]
    merged = gr.merge_records(recs, root)
    assert merged["complete"] and merged["counts"]["passed"] == 2 and merged["deselected"] == []
    gr.write_record(merged, root / "tests/gpu/RECORD.json")
    assert gr.verify(root) == []
    assert not gr.merge_records(recs[:1], root)["complete"]  # one half alone stays incomplete
    (root / "discrete/launch.py").write_text("x=2\n")
    other = _passing(root, j).record({"name": "fake"})
    with pytest.raises(ValueError, match="different sources"):
        gr.merge_records([recs[0], other], root)


# ---- the real conftest in a subprocess, with a fake device plugin that lives only in the temp tree ----

_FAKE = '''
def pytest_plugin_registered(plugin, manager):
    if getattr(plugin, "__name__", "") == "conftest" and hasattr(plugin, "gpu_status"):
        plugin.gpu_status = lambda: (True, "fake device")
        plugin.device_info = lambda: {"name": "FAKE", "driver_version": "0"}
'''


def _run_conftest(tmp_path, tests: str, *args, fake=True):
    (tmp_path / "tests/gpu").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "tests/gpu/conftest.py", tmp_path / "tests/gpu/conftest.py")
    shutil.copy(ROOT / "tests/gpu_record.py", tmp_path / "tests/gpu_record.py")
    (tmp_path / "tests/__init__.py").write_text("")
    (tmp_path / "tests/gpu/test_probe.py").write_text(textwrap.dedent(tests))
    (tmp_path / "fakegpu.py").write_text(_FAKE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: device\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(["-p", "fakegpu"] if fake else []),
           "tests/gpu", *args]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "QMK_RECORD_OUT": str(tmp_path / "out")}
    (tmp_path / "out").mkdir(exist_ok=True)
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)


def test_conftest_records_a_run_on_a_device(tmp_path):
    p = _run_conftest(tmp_path, "def test_ok(gpu):\n    assert gpu['name'] == 'FAKE'\n"
                                "def test_bad():\n    assert 1 == 2\n")
    assert "1 failed, 1 passed" in p.stdout, p.stdout + p.stderr
    rec = json.loads((tmp_path / "tests/gpu/RECORD.json").read_text())
    assert (tmp_path / "out/RECORD.json").read_text() == (tmp_path / "tests/gpu/RECORD.json").read_text()
    assert rec["device"]["name"] == "FAKE" and rec["complete"] and rec["counts"]["failed"] == 1
    assert "failed: tests/gpu/test_probe.py::test_bad" in "\n".join(gr.verify(tmp_path))
    two = "def test_ok(gpu):\n    pass\ndef test_two():\n    pass\n"
    p = _run_conftest(tmp_path, two)
    assert "2 passed" in p.stdout and gr.verify(tmp_path) == [], p.stdout
    good = (tmp_path / "tests/gpu/RECORD.json").read_text()
    p = _run_conftest(tmp_path, two, "-k", "two")  # partial run: only the $QMK_RECORD_OUT copy is written
    assert "incomplete run" in p.stdout and (tmp_path / "tests/gpu/RECORD.json").read_text() == good, p.stdout
    partial = json.loads((tmp_path / "out/RECORD.json").read_text())
    assert not partial["complete"] and "1 test(s) deselected" in partial["incomplete_reasons"][0]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: runs would be recorded")
def test_conftest_skips_and_writes_nothing_without_a_device(tmp_path):
    p = _run_conftest(tmp_path, "def test_ok():\n    pass\n", fake=False)
    assert "1 skipped" in p.stdout, p.stdout + p.stderr
    assert not (tmp_path / "tests/gpu/RECORD.json").exists() and not any((tmp_path / "out").iterdir())


def test_bench_report_keeps_latest_and_derives_bandwidth(tmp_path):
    from bench import report
    def doc(date, ms, **extra):
        return {"device": "NVIDIA H200", "driver": "580.159", "commit": "abcdef1234567", "date": date,
                "results": [{"name": "gemv_fp8", "shape": [5120, 17408], "bytes": 89_128_960, "ms": ms, **extra}]}
    (tmp_path / "a.json").write_text(json.dumps(doc("2026-11-29T10:00:00Z", 0.04, gbps=2228.2,
                                                    frac_of_measured_bw=0.4987)))
    before = report.render(report.load_results(tmp_path))
    (tmp_path / "b.json").write_text(json.dumps(doc("2026-11-29T12:00:00Z", 0.025)))
    rows = report.load_results(tmp_path)
    (row,) = report.latest(rows)
    assert row["file"] == "b.json" and row["gbps"] == pytest.approx(89_128_960 / 0.025 / 1e6)
    assert row["frac"] == pytest.approx(row["gbps"] / 4468.0)
    text = report.render(rows)
    assert text != before  # a new result makes the old README stale
    assert "| gemv_fp8 | 5120×17408 | – | 0.0250 | 3,565 | 79.8 % | NVIDIA H200 | 580.159 | abcdef1234 |" in text
    base = {"shape": "down", "N": 5120, "K": 17408, "weight": "fp8", "M": 1, "correct": True}
    (tmp_path / "h.json").write_text(json.dumps({  # bench/harness.py result_file layout
        "benchmark": "gemv", "device": "NVIDIA H200", "driver": None, "commit": None, "date": "2026-11-29T13:00Z",
        "results": [{**base, "variant": "partial", "median_ms": 0.02, "bytes": 89_128_960, "gbps": 4456.4,
                     "pct_of_4468": 99.74}, {**base, "M": 8, "correct": False, "variant": "FAILED CHECK"}]}))
    text = report.render(report.load_results(tmp_path))
    assert "| gemv partial | down 5120×17408 fp8 M=1 | pass | 0.0200 | 4,456 | 99.7 % | NVIDIA H200 |  | unknown" \
        in text
    assert "| gemv FAILED CHECK | down 5120×17408 fp8 M=8 | FAILED | – | – | – |" in text
    (tmp_path / "c.json").write_text(json.dumps({"device": "x", "commit": "y", "results": []}))
    with pytest.raises(ValueError, match="c.json: missing top-level field 'date'"):
        report.load_results(tmp_path)
