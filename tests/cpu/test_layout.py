"""Package layout: imports point one way (loader <- assembler <- discrete, megakernel <- host), loader and
assembler never import CuPy, and each package resolves inside this repository."""
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
