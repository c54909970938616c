"""Seeded synthetic agent conversations rendered by qwen-mk's chat template, so tool calls and JSON are in
the training distribution.

Each conversation offers one or more tools (JSON schema in the system prompt, the template's format), asks a
question, and the assistant answers with a short ``<think>`` block, zero to two ``<tool_call>`` blocks in the
``<function=…><parameter=…>`` format, the tool responses, and a final answer (text or a JSON object). The
tools are real computations (arithmetic, Python standard-library files and docstrings, a key-value store), so
arguments and results are consistent. ``generate(n, seed)`` is a pure function of its arguments (Python's
``random.Random(seed)``; the file list is sorted), returning rendered strings.
"""
from __future__ import annotations

import ast
import importlib
import json
import os
import random
import sysconfig
from pathlib import Path

from loader.chat_template import ChatTemplate

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _tool(name: str, desc: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": required}}}


CALC = _tool("calculator", "Evaluate an arithmetic expression with + - * / and parentheses.",
             {"expression": {"type": "string", "description": "the expression"}}, ["expression"])
READ = _tool("read_file", "Read the first lines of a text file.",
             {"path": {"type": "string"}, "lines": {"type": "integer", "description": "how many lines"}}, ["path"])
LIST = _tool("list_dir", "List the entries of a directory.", {"path": {"type": "string"}}, ["path"])
DOC = _tool("lookup_doc", "Return the first line of the docstring of a Python object.",
            {"name": {"type": "string", "description": "dotted name, e.g. os.path.join"}}, ["name"])
SET = _tool("store_set", "Store a value under a key.", {"key": {"type": "string"}, "value": {"type": "string"}},
            ["key", "value"])
GET = _tool("store_get", "Fetch the value stored under a key.", {"key": {"type": "string"}}, ["key"])
WEATHER = _tool("get_weather", "Current weather for a city.",
                {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                ["city"])
ALL_TOOLS = [CALC, READ, LIST, DOC, SET, GET, WEATHER]

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Toronto", "Sydney", "Nairobi", "Berlin", "Seoul", "Quito",
          "Madrid", "Dublin", "Hanoi", "Austin"]
CONDITIONS = ["sunny", "cloudy", "rain", "light rain", "snow", "windy", "fog", "clear"]
KEYS = ["colour", "owner", "project", "deadline", "city", "version", "status", "language", "editor", "theme"]
VALUES = ["blue", "Ada", "qwen-mk", "Friday", "Lyon", "3.11", "done", "Python", "vim", "dark", "green", "Grace"]
SYSTEMS = ["You are a helpful assistant.", "You are a concise assistant that uses tools when they help.",
           "You are a coding assistant. Answer briefly.", "Answer in JSON when asked for JSON."]
MODULES = ["os", "os.path", "json", "re", "math", "random", "string", "textwrap", "itertools", "functools",
           "collections", "pathlib", "shutil", "statistics", "datetime", "heapq", "bisect", "csv", "base64",
           "hashlib", "time", "copy", "glob", "fnmatch", "difflib", "inspect", "operator", "pprint"]


def _expr(r: random.Random, depth: int = 0) -> str:
    if depth > 1 or r.random() < 0.45:
        return str(r.randint(1, 999) if r.random() < 0.8 else round(r.uniform(0.5, 99.5), 1))
    op = r.choice(["+", "-", "*", "/"])
    a, b = _expr(r, depth + 1), _expr(r, depth + 1)
    s = f"{a} {op} {b}"
    return f"({s})" if depth and r.random() < 0.5 else s


def _num(x: float) -> str:
    if abs(x - round(x)) < 1e-9:
        return str(int(round(x)))
    return f"{x:.6g}"


def _calc(expr: str) -> str:
    try:
        return _num(eval(expr, {"__builtins__": {}}, {}))  # noqa: S307 - our own generated arithmetic
    except ZeroDivisionError:
        return "error: division by zero"


def _doc_first_line(name: str) -> str | None:
    mod, _, attr = name.rpartition(".") if "." in name else (name, "", "")
    try:
        obj = importlib.import_module(mod)
        if attr:
            obj = getattr(obj, attr)
    except (ImportError, AttributeError):
        return None
    doc = (getattr(obj, "__doc__", None) or "").strip().splitlines()
    return doc[0].strip() if doc and doc[0].strip() else None


class _Files:
    def __init__(self) -> None:
        self.files = sorted(p for p in STDLIB.glob("*.py") if p.stat().st_size < 200_000)
        self.dirs = sorted(p for p in STDLIB.iterdir() if p.is_dir() and not p.name.startswith(("_", "site-")))
        self.names: list[str] = []
        for m in MODULES:
            try:
                mod = importlib.import_module(m)
            except ImportError:
                continue
            pub = sorted(a for a in dir(mod) if not a.startswith("_") and callable(getattr(mod, a, None)))
            self.names += [f"{m}.{a}" for a in pub if _doc_first_line(f"{m}.{a}")]
        from tools.train.corpus import held_out  # deferred: corpus imports this module at its top
        self.funcs: list[tuple[str, str, str]] = []  # (file, signature line, source) of training-split files only
        for p in self.files:
            if held_out(p.relative_to(STDLIB).as_posix()):
                continue
            try:
                src = p.read_text(encoding="utf-8")
                tree = ast.parse(src)
            except (UnicodeDecodeError, SyntaxError, ValueError):
                continue
            lines = src.splitlines()
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and 3 <= node.end_lineno - node.lineno + 1 <= 30:
                    body = "\n".join(lines[node.lineno - 1: node.end_lineno])
                    if body.startswith("def "):
                        self.funcs.append((p.name, lines[node.lineno - 1], body))


def _call(fn: str, **args) -> dict:
    return {"type": "function", "function": {"name": fn, "arguments": args}}


def _think(r: random.Random, text: str) -> str:
    return text if r.random() < 0.8 else ""


def _conv_calc(r, f):
    e = _expr(r)
    v = _calc(e)
    q = r.choice([f"What is {e}?", f"Compute {e}.", f"Please calculate {e}", f"{e} = ?"])
    msgs = [{"role": "user", "content": q},
            {"role": "assistant", "content": "", "reasoning_content": _think(r, "I should use the calculator."),
             "tool_calls": [_call("calculator", expression=e)]},
            {"role": "tool", "content": v}]
    if r.random() < 0.3:
        ans = json.dumps({"expression": e, "result": v})
        msgs[0]["content"] += " Reply in JSON with keys expression and result."
    else:
        ans = r.choice([f"{e} = {v}.", f"The result is {v}.", f"It is {v}."])
    msgs.append({"role": "assistant", "content": ans})
    return [CALC], msgs


def _conv_two_calcs(r, f):
    a, b = _expr(r, 1), _expr(r, 1)
    va, vb = _calc(a), _calc(b)
    msgs = [{"role": "user", "content": f"Which is larger, {a} or {b}?"},
            {"role": "assistant", "content": "", "reasoning_content": _think(r, "Compute both, then compare."),
             "tool_calls": [_call("calculator", expression=a), _call("calculator", expression=b)]},
            {"role": "tool", "content": va}, {"role": "tool", "content": vb}]
    try:
        big = a if float(va) >= float(vb) else b
        ans = f"{a} = {va} and {b} = {vb}, so {big} is larger."
    except ValueError:
        ans = f"One of them cannot be computed: {a} = {va}, {b} = {vb}."
    msgs.append({"role": "assistant", "content": ans})
    return [CALC, r.choice(ALL_TOOLS[1:])], msgs


def _conv_read(r, f):
    p = r.choice(f.files)
    n = r.randint(3, 8)
    try:
        head = "".join(p.read_text(encoding="utf-8").splitlines(keepends=True)[:n]).rstrip("\n")
    except UnicodeDecodeError:
        return _conv_calc(r, f)
    path = f"lib/{p.name}"
    msgs = [{"role": "user", "content": r.choice([f"Show me the first {n} lines of {path}.",
                                                   f"What does {path} start with? ({n} lines)"])},
            {"role": "assistant", "content": "", "reasoning_content": _think(r, f"Read {path}."),
             "tool_calls": [_call("read_file", path=path, lines=n)]},
            {"role": "tool", "content": head},
            {"role": "assistant", "content": f"The first {n} lines of {path} are:\n\n```python\n{head}\n```"}]
    return [READ, LIST], msgs


def _conv_list(r, f):
    d = r.choice(f.dirs)
    ents = sorted(e.name for e in d.iterdir() if not e.name.startswith("__"))[:12]
    path = f"lib/{d.name}"
    msgs = [{"role": "user", "content": f"What is in {path}?"},
            {"role": "assistant", "content": "", "reasoning_content": _think(r, "List the directory."),
             "tool_calls": [_call("list_dir", path=path)]},
            {"role": "tool", "content": json.dumps(ents)},
            {"role": "assistant", "content": f"{path} holds {len(ents)} entries: " + ", ".join(ents) + "."}]
    return [LIST, READ], msgs


def _conv_doc(r, f):
    name = r.choice(f.names)
    line = _doc_first_line(name) or "No documentation."
    msgs = [{"role": "user", "content": r.choice([f"What does {name} do?", f"Explain {name} in one line.",
                                                   f"Docs for {name}?"])},
            {"role": "assistant", "content": "", "reasoning_content": _think(r, f"Look up {name}."),
             "tool_calls": [_call("lookup_doc", name=name)]},
            {"role": "tool", "content": line},
            {"role": "assistant", "content": f"`{name}`: {line}"}]
    return [DOC, CALC], msgs


def _conv_json(r, f):
    name = r.choice(f.names)
    mod, _, attr = name.rpartition(".")
    line = _doc_first_line(name) or ""
    obj = {"module": mod, "name": attr, "summary": line}
    msgs = [{"role": "user", "content": f"Give me a JSON object with the module, name and summary of {name}."},
            {"role": "assistant", "content": "", "reasoning_content": _think(r, "Answer as JSON."),
             "tool_calls": [_call("lookup_doc", name=name)]},
            {"role": "tool", "content": line},
            {"role": "assistant", "content": json.dumps(obj, indent=r.choice([None, 2]))}]
    return [DOC], msgs


def _conv_store(r, f):
    k, v = r.choice(KEYS), r.choice(VALUES)
    msgs = [{"role": "user", "content": f"Remember that the {k} is {v}."},
            {"role": "assistant", "content": "", "reasoning_content": _think(r, "Store it."),
             "tool_calls": [_call("store_set", key=k, value=v)]},
            {"role": "tool", "content": json.dumps({"ok": True})},
            {"role": "assistant", "content": f"Saved: {k} = {v}."},
            {"role": "user", "content": f"What is the {k}?"},
            {"role": "assistant", "content": "", "reasoning_content": _think(r, "Fetch it."),
             "tool_calls": [_call("store_get", key=k)]},
            {"role": "tool", "content": json.dumps({"key": k, "value": v})},
            {"role": "assistant", "content": f"The {k} is {v}."}]
    return [SET, GET], msgs


def _conv_weather(r, f):
    c = r.choice(CITIES)
    unit = r.choice(["celsius", "fahrenheit"])
    t = r.randint(-10, 35) if unit == "celsius" else r.randint(14, 95)
    cond = r.choice(CONDITIONS)
    res = {"city": c, "temperature": t, "unit": unit, "conditions": cond}
    msgs = [{"role": "user", "content": f"What's the weather in {c} in {unit}?"},
            {"role": "assistant", "content": "", "reasoning_content": _think(r, "Call the weather tool."),
             "tool_calls": [_call("get_weather", city=c, unit=unit)]},
            {"role": "tool", "content": json.dumps(res)},
            {"role": "assistant", "content": f"In {c} it is {t} degrees {unit} with {cond}."}]
    return [WEATHER, CALC], msgs


def _conv_plain(r, f):
    name = r.choice(f.names)
    line = _doc_first_line(name) or ""
    msgs = [{"role": "user", "content": f"In one sentence, what is {name}?"},
            {"role": "assistant", "content": f"`{name}`: {line}", "reasoning_content": _think(r, "I know this.")}]
    return ([DOC] if r.random() < 0.5 else None), msgs


def _conv_code(r, f):
    fn, sig, src = r.choice(f.funcs)
    name = sig[4:].split("(")[0]
    q = r.choice([sig, sig, f"Write {name}() in Python.", f"Complete this function:\n\n```python\n{sig}\n```",
                  f"How does {name} in lib/{fn} look?"])
    msgs = [{"role": "user", "content": q},
            {"role": "assistant", "content": f"```python\n{src}\n```",
             "reasoning_content": _think(r, "Write the function.")}]
    return ([READ] if r.random() < 0.3 else None), msgs


KINDS = [(_conv_code, 4), (_conv_calc, 3), (_conv_two_calcs, 1), (_conv_read, 2), (_conv_list, 1), (_conv_doc, 2), (_conv_json, 2),
         (_conv_store, 1), (_conv_weather, 2), (_conv_plain, 1)]


def generate(n: int, seed: int) -> list[str]:
    """``n`` rendered conversations (strings ending with ``<|im_end|>\\n``) from ``random.Random(seed)``."""
    r = random.Random(seed)
    f = _Files()
    tmpl = ChatTemplate.default()
    fns = [k for k, w in KINDS for _ in range(w)]
    out = []
    for _ in range(n):
        tools, msgs = r.choice(fns)(r, f)
        if r.random() < 0.5:
            msgs = [{"role": "system", "content": r.choice(SYSTEMS)}] + msgs
        out.append(tmpl.render(msgs, tools=tools, add_generation_prompt=False))
    return out


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    for s in generate(3, 0):
        print(s[-700:])
        print("=" * 60)
