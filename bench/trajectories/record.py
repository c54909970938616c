"""Record agent trajectories: the trained small model is the agent against the local tools (``tools``).

``python3 -m bench.trajectories.record [--targets 1536,3072,6144,12288] [--seed 0] [--max-new-tokens 64]
[--max-steps 24] [--paste-max 3000] [--executor cpu] [--out bench/fixtures/trajectories.json.gz]``;
``... record merge A B ... --out F`` joins files (trajectories renamed ``t<rank>_<target>`` by target).

Each trajectory: a system prompt with the seven training tools (``tools.train.conversations.ALL_TOOLS``) rendered by
the checkpoint's chat template, a first user task, then steps. A step generates the model's reply (greedy, the tool
grammar on with ``tool_choice="auto"``, at most ``--max-new-tokens``, stopping at EOS); its tool calls, parsed by
the engine (``host.reply``), are run and their results appended as the template's ``<tool_response>`` user turn;
a reply without calls (or the third tool round in a row) is followed by the next user turn of the trajectory's
seeded plan: a tool question (calculator, weather, store, directory, docstring, file head) or a pasted stretch of a
standard-library file to review (this is what makes long contexts). A trajectory ends when its context reaches its
target or after ``--max-steps``. Appended turns are encoded as ``Engine.render_chat`` encodes a prompt
(template markup with control ids, caller text as ordinary tokens); the recorder checks once that its turn ids
equal the template's rendering.

Per step the fixture keeps the ids appended before the step, the ids the model generated (EOS included), the
finish reason and the called tools. Recorded ids are the truth: the replay never re-tokenises anything.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

from bench.harness import commit, cpu_name
from bench.trajectories.tools import Toolbox
from host.engine import Engine
from host.prompt_text import _shield_str, encode_prompt
from loader.config import IM_END_ID, TOOL_CALL_END_ID
from tools.train.conversations import ALL_TOOLS, CITIES, KEYS, MODULES, STDLIB, VALUES, _expr

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "trajectories.json.gz"
SYSTEM = "You are a coding assistant with tools. Use them when they help, then answer briefly."
PASTE_TOKENS = (600, 3000)   # a pasted file stretch: tokens, at least / at most


def _turn_text(kind: str, contents: list[str]) -> str:
    """Template text after an assistant turn's ``<|im_end|>``: a user turn or a tool-response turn, then the
    generation prompt with thinking on (the form ``ChatTemplate.render`` gives; checked by ``_check_turns``)."""
    body = [_shield_str(c, "turn", "messages") for c in contents]
    if kind == "tool":
        text = "\n".join(f"<tool_response>\n{c}\n</tool_response>" for c in body)
    else:
        text = body[0]
    return f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n<think>\n"


def turn_ids(eng, kind: str, contents: list[str]) -> list[int]:
    """Ids of a user (``kind="user"``, one content) or tool-response turn (``"tool"``, one content per call)
    appended after an assistant reply that ended with ``<|im_end|>``."""
    return encode_prompt(eng.tokenizer, _turn_text(kind, contents))


def _check_turns(eng, tools) -> None:
    """Raise AssertionError unless ``turn_ids`` equals the chat template's rendering of the same turns."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+2"}}}
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    for kind, tail in (("tool", [{"role": "tool", "content": "3 <|im_end|>"}, {"role": "tool", "content": "x"}]),
                       ("user", [{"role": "user", "content": "next\n```py\nx = 1\n```"}])):
        full = eng.render_chat(msgs + tail, tools)
        end_call = max(i for i, t in enumerate(full) if t == TOOL_CALL_END_ID)
        cut = full.index(IM_END_ID, end_call) + 1  # the assistant turn's <|im_end|>
        mine = turn_ids(eng, kind, [m["content"] for m in tail])
        assert full[cut:] == mine, f"{kind} turn: recorder ids differ from the template's rendering"


class Plan:
    """The seeded user turns of one trajectory: tool questions and pasted file stretches."""

    def __init__(self, r: random.Random, eng):
        self.r, self.eng, self.expr = r, eng, _expr
        self.cities, self.keys, self.values, self.modules = CITIES, KEYS, VALUES, MODULES
        self.files = sorted(p for p in STDLIB.glob("*.py") if 8_000 < p.stat().st_size < 200_000)
        self.dirs = sorted(p.name for p in STDLIB.iterdir() if p.is_dir() and not p.name.startswith(("_", "site-")))
        self.stored: list[str] = []

    def first(self) -> str:
        """The trajectory's task."""
        f = self.r.choice(self.files).name
        return self.r.choice([f"I am reviewing lib/{f}. Show me its first 30 lines.",
                              f"What is in lib/{self.r.choice(self.dirs)}? Then tell me about lib/{f}.",
                              f"Start by computing {self.expr(self.r)}, then we will read some code."])

    def question(self) -> str:
        r = self.r
        k = r.randrange(7)
        if k == 0:
            return r.choice([f"What is {self.expr(r)}?", f"Compute {self.expr(r)}."])
        if k == 1:
            return f"What's the weather in {r.choice(self.cities)} in {r.choice(['celsius', 'fahrenheit'])}?"
        if k == 2:
            key, v = r.choice(self.keys), r.choice(self.values)
            self.stored.append(key)
            return f"Remember that the {key} is {v}."
        if k == 3 and self.stored:
            return f"What is the {r.choice(self.stored)}?"
        if k == 4:
            return f"What is in lib/{r.choice(self.dirs)}?"
        if k == 5:
            m = r.choice(self.modules)
            return f"What does {m} do?"
        return f"Show me the first {r.randint(10, 60)} lines of lib/{r.choice(self.files).name}."

    def paste(self, tokens: int) -> str:
        """A review request holding about ``tokens`` tokens of a standard-library file (whole lines)."""
        p = self.r.choice(self.files)
        lines = p.read_text(encoding="utf-8", errors="replace").splitlines()
        a = self.r.randrange(max(1, len(lines) - 40))
        out, n = [], 0
        for line in lines[a:]:
            n += len(self.eng.tokenizer.encode_text(line + "\n"))
            out.append(line)
            if n >= tokens:
                break
        body = "\n".join(out)
        ask = self.r.choice(["What does this code do?", "Is there a bug here?", "Summarise this in one line.",
                             "Which functions are defined here?"])
        return f"Here is lib/{p.name} from line {a + 1}:\n```python\n{body}\n```\n{ask}"


def record_one(eng, name: str, target: int, seed: int, max_new: int, max_steps: int, log,
               paste_max: int = PASTE_TOKENS[1]) -> dict:
    """One trajectory (module docstring) as a dict: name, target, seed, tools, system, steps[{append, generated,
    finish_reason, calls, kind}], context (tokens at the end, the last reply included)."""
    r = random.Random(f"{seed}:{name}")
    plan, box = Plan(r, eng), Toolbox()
    first = plan.first()
    hist = eng.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}], ALL_TOOLS)
    steps, append, kind, tool_rounds = [], list(hist), "task", 0
    s = eng.new_session()
    try:
        while len(steps) < max_steps:
            t0 = time.perf_counter()
            res = s.generate(hist, max_new_tokens=max_new, tools=ALL_TOOLS, tool_choice="auto", reasoning=True,
                             checkpoint_at=[len(hist) - len(append)]).result()
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in res.tool_calls]
            steps.append({"kind": kind, "append": append, "generated": list(res.ids),
                          "finish_reason": res.finish_reason, "calls": [c[0] for c in calls]})
            hist = hist + list(res.ids)
            log(f"{name} step {len(steps)}: +{len(append)} ids, {len(res.ids)} generated ({res.finish_reason}), "
                f"calls {[c[0] for c in calls]}, context {len(hist)}, {time.perf_counter() - t0:.1f} s")
            if len(hist) >= target:
                break
            close = [] if res.ids and res.ids[-1] == IM_END_ID else [IM_END_ID]
            if calls and tool_rounds < 2:
                append, kind, tool_rounds = close + turn_ids(eng, "tool", [box.run(n, a) for n, a in calls]), "tool", \
                    tool_rounds + 1
            else:
                left = target - len(hist)
                if left > PASTE_TOKENS[0] * 2 and r.random() < 0.6:
                    text = plan.paste(min(paste_max, max(PASTE_TOKENS[0], left // 2)))
                else:
                    text = plan.question()
                append, kind, tool_rounds = close + turn_ids(eng, "user", [text]), "user", 0
            hist = hist + append
    finally:
        s.close()
    return {"name": name, "target": target, "seed": seed, "tools": ALL_TOOLS, "system": SYSTEM, "task": first,
            "context": len(hist), "steps": steps}


def write(path: Path, doc: dict) -> None:
    """Write ``doc`` as compact gzip'd JSON (mtime 0, so the bytes depend only on the content)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(json.dumps(doc, separators=(",", ":")).encode())


def load(path: str | Path = FIXTURE) -> dict:
    """The fixture document: ``meta`` and ``trajectories`` (``record_one``'s dicts)."""
    with gzip.open(path, "rt") as f:
        return json.load(f)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        ap = argparse.ArgumentParser(prog="python3 -m bench.trajectories.record merge")
        ap.add_argument("files", nargs="+")
        ap.add_argument("--out", default=str(FIXTURE))
        a = ap.parse_args(argv[1:])
        docs = [load(f) for f in a.files]
        trajs = sorted((t for d in docs for t in d["trajectories"]), key=lambda t: t["target"])
        for k, t in enumerate(trajs):  # names by rank of target: t0 the shortest
            t["name"] = f"t{k}_{t['target']}"
        write(Path(a.out), {"meta": {**docs[0]["meta"], "merged_from": [d["meta"] for d in docs]},
                            "trajectories": trajs})
        print(f"{a.out}: {len(trajs)} trajectories, {os.path.getsize(a.out)} bytes")
        return 0
    ap = argparse.ArgumentParser(prog="python3 -m bench.trajectories.record", description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="1536,3072,6144,12288", help="context targets in tokens, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-steps", type=int, default=24)
    ap.add_argument("--paste-max", type=int, default=PASTE_TOKENS[1], help="most tokens of one pasted stretch")
    ap.add_argument("--executor", default="cpu", help="cpu (default), or graph / megakernel on a GPU: recorded ids "
                    "are the truth whichever executor made them (a long trajectory takes minutes on the GPU, an hour "
                    "on a 2-core CPU)")
    ap.add_argument("--out", default=str(FIXTURE))
    a = ap.parse_args(argv)

    targets = [int(x) for x in a.targets.split(",")]
    eng = Engine.load(executor=a.executor, capacity=max(targets) + 4 * 4096, slots=1, quiet=True)
    _check_turns(eng, ALL_TOOLS)
    meta = {"model": eng.model_dir.name, "executor": eng.executor.name, "commit": commit(), "seed": a.seed,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": cpu_name(),
            "command": "python3 -m bench.trajectories.record " + " ".join(argv), "max_new_tokens": a.max_new_tokens,
            "max_steps": a.max_steps, "paste_max": a.paste_max, "tool_tree": str(STDLIB),
            "python": platform.python_version(),
            "sampling": "greedy; tool grammar on (tool_choice auto); EOS stops"}
    trajs = []
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    for k, tgt in enumerate(targets):
        trajs.append(record_one(eng, f"t{k}_{tgt}", tgt, a.seed, a.max_new_tokens, a.max_steps, log,
                               a.paste_max))
        write(Path(a.out), {"meta": meta, "trajectories": trajs})  # after each: a partial run keeps what it made
    print(f"{a.out}: {len(trajs)} trajectories, {os.path.getsize(a.out)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
