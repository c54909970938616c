"""The knob registry (discrete/knobs.py) against the CUDA sources and the Python code that passes defines."""
from pathlib import Path

from discrete import knobs

ROOT = Path(__file__).resolve().parents[2]


def test_registry_matches_the_tree():
    """Every #ifndef/#ifdef QMK_* of the sources and every define the Python code passes is registered with the
    source's default; no registered knob is stale."""
    assert knobs.problems(ROOT) == []


def test_docs_page_is_generated_from_the_table():
    assert (ROOT / "docs" / "knobs.md").read_text() == knobs.markdown()


def test_parser_reads_defaults_flags_and_required():
    text = ("#ifndef QMK_A\n// why\n#define QMK_A (1 + 2)  // comment\n#endif\n"
            "#ifndef QMK_B\n#if X\n#define QMK_B 9\n#endif\n#define QMK_B 3\n#endif\n"
            "#ifdef QMK_C\n#endif\n#if defined(QMK_D)\n#endif\n"
            "#ifndef QMK_E\n#error \"QMK_E must be defined\"\n#endif\n")
    assert knobs.source_defines(text) == [("QMK_A", "knob", "(1 + 2)", 1), ("QMK_B", "knob", "3", 5),
                                          ("QMK_C", "flag", None, 11), ("QMK_D", "flag", None, 13),
                                          ("QMK_E", "required", None, 15)]


def test_python_scan_skips_environment_variables():
    text = 'd = {"QMK_A": 1}\nd["QMK_B"] = 2\nx = defines.get("QMK_C", 0)\nos.environ.get("QMK_COMMIT")\n' \
           'lines.append(f"#define QMK_D {v}")\n'
    assert knobs.python_defines(text) == {"QMK_A", "QMK_B", "QMK_C", "QMK_D"}


def _tree(tmp_path: Path, cu: str, py: str = "") -> Path:
    (tmp_path / "discrete" / "kernels").mkdir(parents=True)
    (tmp_path / "discrete" / "kernels" / "k.cuh").write_text(cu)
    (tmp_path / "discrete" / "launch.py").write_text(py)
    return tmp_path


def test_negative_controls(tmp_path):
    """An unregistered knob, a changed default, a stale entry, an unregistered Python define: each is reported."""
    k = knobs.Knob("QMK_T", "knob", "4", "int", ("discrete/kernels/k.cuh",), ("discrete/launch.py",), "test")
    ok = _tree(tmp_path / "ok", "#ifndef QMK_T\n#define QMK_T 4\n#endif\n", 'd = {"QMK_T": 2}\n')
    assert knobs.problems(ok, (k,)) == []
    bad = _tree(tmp_path / "bad", "#ifndef QMK_T\n#define QMK_T 5\n#endif\n#ifndef QMK_U\n#define QMK_U 1\n#endif\n",
                'd = {"QMK_T": 2, "QMK_V": 1}\n')
    msgs = knobs.problems(bad, (k,))
    assert any("QMK_T defaults to '5'" in m for m in msgs), msgs
    assert any("QMK_U (knob) is not in" in m for m in msgs), msgs
    assert any("passes QMK_V" in m for m in msgs), msgs
    stale = _tree(tmp_path / "stale", "", 'd = {"QMK_T": 2}\n')
    assert any("(stale)" in m for m in knobs.problems(stale, (k,)))


def test_python_mirrors_hold_the_source_values():
    """Each constant a Python launcher repeats (block sizes, ring bytes, stages) equals the CUDA source's."""
    import importlib
    for name, src, where in knobs.MIRRORS:
        mod, attr = where.split(":")
        assert getattr(importlib.import_module(mod), attr) == knobs.source_value((ROOT / src).read_text(), name), where
    assert knobs.source_value("#define QMK_Q 7  // x\n", "QMK_Q") == 7  # negative control: the parser reads values
    try:
        knobs.source_value("#define QMK_Q (1 + 2)\n", "QMK_Q")
    except ValueError:
        pass
    else:
        raise AssertionError("a non-integer define must not parse")
