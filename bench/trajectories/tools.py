"""The small deterministic local tool set the recorded agent calls: the seven tools of the training conversations
(``tools.train.conversations.ALL_TOOLS``), answered by pure functions of their arguments and a per-trajectory
key-value store.

Fixture tree: the Python standard library of the recording machine (``sysconfig.get_paths()["stdlib"]``), seen as
``lib/``; its path and the Python version are written into the fixture's metadata. Nothing here is run at replay:
the recorded tool results are ids in the fixture.
"""
from __future__ import annotations

import ast
import hashlib
import json
import operator
from pathlib import Path

from tools.train.conversations import CONDITIONS, MODULES, STDLIB, _doc_first_line

READ_DEFAULT, READ_MAX = 40, 400     # read_file: lines when the call names none, most lines returned
LIST_MAX = 40                        # list_dir: most entries returned
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def _arith(node):
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.left), _arith(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.operand))
    raise ValueError("not arithmetic")


def calculator(expression) -> str:
    """The value of an arithmetic expression (+ - * / and parentheses on numbers) as text, or an error line."""
    try:
        v = _arith(ast.parse(str(expression), mode="eval"))
    except ZeroDivisionError:
        return "error: division by zero"
    except (ValueError, SyntaxError, TypeError, RecursionError):
        return f"error: not an arithmetic expression: {str(expression)[:80]}"
    return str(int(round(v))) if abs(v - round(v)) < 1e-9 else f"{v:.6g}"


def _resolve(path) -> Path | None:
    p = str(path).strip()
    p = p[4:] if p.startswith("lib/") else p.lstrip("/")
    q = (STDLIB / p).resolve()
    return q if q == STDLIB.resolve() or STDLIB.resolve() in q.parents else None


def read_file(path, lines=None) -> str:
    """The first ``lines`` lines (default READ_DEFAULT, at most READ_MAX) of ``lib/<path>``, or an error line."""
    q = _resolve(path)
    if q is None or not q.is_file():
        return f"error: no such file: {path}"
    try:
        n = min(max(int(lines), 1), READ_MAX) if lines is not None else READ_DEFAULT
    except (TypeError, ValueError):
        n = READ_DEFAULT
    try:
        return "".join(q.read_text(encoding="utf-8").splitlines(keepends=True)[:n]).rstrip("\n")
    except UnicodeDecodeError:
        return f"error: not a text file: {path}"


def list_dir(path) -> str:
    """JSON list of the sorted entry names of ``lib/<path>`` (at most LIST_MAX, ``__pycache__`` left out)."""
    q = _resolve(path)
    if q is None or not q.is_dir():
        return f"error: no such directory: {path}"
    return json.dumps(sorted(e.name for e in q.iterdir() if e.name != "__pycache__")[:LIST_MAX])


def lookup_doc(name) -> str:
    """The first docstring line of ``name`` when its module is one of the training modules (nothing else is
    imported), else ``No documentation.``."""
    name = str(name).strip()
    mod = name.rpartition(".")[0] if "." in name else name
    ok = name in MODULES or mod in MODULES
    return (_doc_first_line(name) if ok else None) or "No documentation."


def get_weather(city, unit="celsius") -> str:
    """A deterministic made-up report: temperature and conditions drawn from the SHA-256 of the city's name."""
    h = int.from_bytes(hashlib.sha256(str(city).strip().lower().encode()).digest()[:8], "little")
    unit = unit if unit in ("celsius", "fahrenheit") else "celsius"
    t = h % 40 - 8 if unit == "celsius" else h % 72 + 18
    return json.dumps({"city": str(city), "temperature": t, "unit": unit,
                       "conditions": CONDITIONS[(h >> 16) % len(CONDITIONS)]})


class Toolbox:
    """The seven tools with one key-value store; ``run(name, arguments_json)`` answers a parsed call."""

    def __init__(self) -> None:
        self.store: dict[str, str] = {}

    def run(self, name: str, arguments: str) -> str:
        """The tool result text of one call (``arguments``: the call's JSON text); errors are results too."""
        try:
            a = json.loads(arguments) if arguments else {}
        except ValueError:
            return "error: arguments are not JSON"
        if not isinstance(a, dict):
            return "error: arguments are not an object"
        try:
            if name == "calculator":
                return calculator(a.get("expression", ""))
            if name == "read_file":
                return read_file(a.get("path", ""), a.get("lines"))
            if name == "list_dir":
                return list_dir(a.get("path", ""))
            if name == "lookup_doc":
                return lookup_doc(a.get("name", ""))
            if name == "get_weather":
                return get_weather(a.get("city", ""), a.get("unit", "celsius"))
            if name == "store_set":
                self.store[str(a.get("key"))] = str(a.get("value"))
                return json.dumps({"ok": True})
            if name == "store_get":
                k = str(a.get("key"))
                return json.dumps({"key": k, "value": self.store.get(k)})
        except (OSError, ValueError) as e:
            return f"error: {e}"
        return f"error: unknown tool {name}"

