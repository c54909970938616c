"""Package layout: imports point one way (loader <- assembler <- discrete, megakernel <- host), loader and
assembler never import CuPy, each package resolves inside this repository, and the modules of one folder (assembler/ref
above all: ops re-exports, its siblings import dense) import each other without a cycle."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ORDER = {"loader": 0, "assembler": 1, "discrete": 2, "megakernel": 2, "host": 3}


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0]


@pytest.mark.parametrize("pkg", sorted(ORDER))
def test_imports_point_one_way(pkg):
    bad = []
    for f in sorted((ROOT / pkg).rglob("*.py")):
        for mod in _imports(f):
            if mod in ORDER and ORDER[mod] > ORDER[pkg]:
                bad.append(f"{f.relative_to(ROOT)} imports {mod}")
            if mod == "discrete" and pkg == "megakernel":
                continue
            if pkg in ("loader", "assembler") and mod in ("cupy", "cuda"):
                bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("pkg", sorted(ORDER))
def test_package_resolves_in_repo(pkg):
    import importlib
    m = importlib.import_module(pkg)
    assert Path(m.__file__).resolve().parent == ROOT / pkg


def _module_graph(folder: str) -> dict[str, set[str]]:
    """Module name -> the modules of the same folder it imports, at module top or inside a function."""
    base = ROOT / folder
    prefix = folder.replace("/", ".")
    names = {f"{prefix}.{f.stem}" for f in base.glob("*.py") if f.stem != "__init__"}
    graph = {}
    for mod in sorted(names):
        tree = ast.parse((base / f"{mod.rsplit('.', 1)[1]}.py").read_text())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
        graph[mod] = (deps & names) - {mod}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path that starts and ends at the same module, or None."""
    state, path = {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                return path[path.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        state[m] = "done"
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


@pytest.mark.parametrize("folder", ["assembler", "assembler/ref", "loader", "discrete", "megakernel", "host",
                                    "host/commands", "host/server"])
def test_no_import_cycle_in_folder(folder):
    assert (c := _cycle(_module_graph(folder))) is None, " -> ".join(c)


def test_ref_ops_re_exports_the_families():
    """ops re-exports the op families; attention, sampling and mtp import the dense ops from dense, never ops."""
    graph = _module_graph("assembler/ref")
    assert {"assembler.ref.attention", "assembler.ref.dense", "assembler.ref.mtp"} <= graph["assembler.ref.ops"]
    for fam in ("attention", "sampling", "mtp"):
        assert graph[f"assembler.ref.{fam}"] & {"assembler.ref.dense", "assembler.ref.ops"} == {"assembler.ref.dense"}


def test_cycle_walk_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_test_module_basenames_are_unique():
    """pytest imports test modules by basename (rootdir, no packages), so two ``test_x.py`` in different folders
    stop the whole run at collection; conftest.py files are exempt (pytest loads them per folder)."""
    from collections import Counter
    root = Path(__file__).resolve().parents[2] / "tests"
    names = Counter(p.name for p in root.rglob("test_*.py") if "__pycache__" not in p.parts)
    assert not [n for n, c in names.items() if c > 1], sorted(n for n, c in names.items() if c > 1)
    assert names["test_sampling.py"] == 1 and names["test_sampling_device.py"] == 1  # the scan sees both folders
