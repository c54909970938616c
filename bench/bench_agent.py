"""The agent loop on the trained small model: a tool-call round trip with the grammar on and off.

``python3 -m bench.bench_agent [--executor cpu] [--n 16] [--temperatures 0,1] [--max-new-tokens 128]
[--answer-tokens 32] [--out DIR]``

Each of ``--n`` prompts (a system prompt with the seven tools of the training conversations,
``tools.train.conversations.ALL_TOOLS``, and one user question; a third of them phrased unlike the training data)
runs one round trip in a session: turn 1 generates, its tool calls are parsed by token id (``host.reply``) and
checked (the function is among the tools, the arguments are JSON that ``jsonschema`` validates against its
schema), the calls are answered with canned tool results, and turn 2 generates the final answer. Modes:

- ``grammar_on``: ``tool_choice="required"``, the tool-call structural tag masks every step (``host.grammar``);
- ``grammar_off``: ``tool_choice="auto"``, ``tool_grammar=False``: the model writes whatever it writes.

Per mode and temperature (0 = greedy; sampling with seed = prompt index): replies with at least one call,
replies whose every call parses and validates, the same among replies that attempted a call (held a
``<tool_call>`` id), invalid call regions, finish reasons, turn-2 prefill (tokens run vs reused: the turn appends to
the session's ids), and time: the mask build per token (bitmask fill + unpack, ``Constraint.mask_ms / masks``),
decode ms per token with and without the mask, and grammar compile time (first compile and cached). The gate
(exit 1, after writing): with the grammar on, every call parses and validates, and every reply that ended by
itself holds a call (a reply cut by ``--max-new-tokens`` while still reasoning, which the grammar leaves free,
has none; ``finish_reasons`` counts them).

The machine is shared: the JSON records ``nproc``, load averages before/after, the CPU and the commit. Writes
``bench/results/e2e/agent.json`` (or ``--out``/agent.json) and prints it.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.harness import commit, cpu_name
from host.engine import Engine
from host.grammar import tool_call_spec
from loader.config import TOOL_CALL_ID
from tools.train.conversations import ALL_TOOLS

OUT = Path(__file__).resolve().parent / "results" / "e2e"
SYSTEM = "You are a concise assistant that uses tools when they help."
PROMPTS = [  # in the training distribution's phrasing
    "What is 17 * 23?", "Compute (48 + 2) / 5.", "What's the weather in Oslo in celsius?",
    "What's the weather in Lima in fahrenheit?", "Show me the first 5 lines of json/__init__.py.",
    "What is in email?", "What does os.path.join do?", "Remember that the colour is blue.",
    "What is the owner?", "Explain textwrap.dedent in one line.", "Please calculate 999 - 123",
    # phrased unlike the training data
    "hey, how warm is it right now over in Nairobi?", "I need to know what 2 to the power of 10 is, use a tool",
    "Could you peek into the collections folder and tell me what files it has?",
    "store my editor preference: vim", "pls check the forecast for Sydney and also tell me 7*6",
]
RESULTS = {"calculator": "42", "get_weather": json.dumps({"temperature": 21, "conditions": "sunny"}),
           "read_file": "import os\nimport sys", "list_dir": json.dumps(["a.py", "b.py"]),
           "lookup_doc": "Join two or more pathname components.", "store_set": json.dumps({"ok": True}),
           "store_get": json.dumps({"key": "owner", "value": "Ada"})}


def check_calls(r, schemas) -> tuple[bool, list[str]]:
    """(every call of result ``r`` parsed and validates, the problems): invalid regions, unknown functions,
    arguments that are not JSON or fail their schema."""
    import jsonschema

    bad = [f"invalid region {c['index']} ({c['reason']})" for c in r.invalid_tool_calls]
    for c in r.tool_calls:
        name = c["function"]["name"]
        if name not in schemas:
            bad.append(f"unknown function {name!r}")
            continue
        try:
            jsonschema.validate(json.loads(c["function"]["arguments"]), schemas[name])
        except (ValueError, jsonschema.ValidationError) as e:
            bad.append(f"{name}: {str(e).splitlines()[0][:120]}")
    return not bad, bad


def round_trip(eng, k: int, prompt: str, tools, schemas, mode: str, temperature: float, max_new: int,
               answer_tokens: int) -> dict:
    """One prompt's two turns in a fresh session; returns the row of the JSON."""
    kw = dict(tools=tools, max_new_tokens=max_new, temperature=temperature,
              seed=k if temperature else None)
    kw.update({"tool_choice": "required"} if mode == "grammar_on" else {"tool_choice": "auto", "tool_grammar": False})
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    s = eng.new_session()
    try:
        t0 = time.perf_counter()
        r1 = s.chat(msgs, **kw).result()
        t1 = time.perf_counter()
        ok, problems = check_calls(r1, schemas)
        row = {"prompt": k, "finish_reason": r1.finish_reason, "calls": len(r1.tool_calls),
               "attempted": TOOL_CALL_ID in r1.ids, "valid": ok and bool(r1.tool_calls), "all_calls_valid": ok,
               "problems": problems, "invalid_regions": len(r1.invalid_tool_calls),
               "names": [c["function"]["name"] for c in r1.tool_calls], "turn1_s": round(t1 - t0, 3),
               "turn1_tokens": len(r1.ids), "decode_ms_per_token": (round(1e3 / r1.timings.decode_tokens_per_s, 3)
                                                                    if r1.timings.decode_tokens_per_s else None)}
        if r1.grammar is not None:
            row["mask_ms_per_token"] = r1.grammar["mask_ms_per_token"]
            row["compile_ms"], row["compile_cached"] = r1.grammar["compile_ms"], r1.grammar["cached"]
        if r1.tool_calls:
            turn = msgs + [{"role": "assistant", "content": r1.content.strip(),
                            "reasoning_content": (r1.reasoning_content or "").strip(),
                            "tool_calls": [{k2: c[k2] for k2 in ("id", "type", "function")} for c in r1.tool_calls]}]
            turn += [{"role": "tool", "content": RESULTS.get(c["function"]["name"], "ok")} for c in r1.tool_calls]
            kw2 = {k2: v for k2, v in kw.items() if k2 not in ("tool_choice", "tool_grammar")}
            kw2["max_new_tokens"] = answer_tokens
            t2 = time.perf_counter()
            r2 = s.chat(turn, **kw2).result()
            row.update(turn2_s=round(time.perf_counter() - t2, 3), turn2_finish=r2.finish_reason,
                       turn2_prefilled=r2.timings.prefilled_tokens, turn2_reused=r2.timings.reused_tokens,
                       turn2_prompt=r2.timings.prompt_tokens, turn2_calls=len(r2.tool_calls),
                       answer=r2.content.strip()[:120])
        row["round_trip_s"] = round(time.perf_counter() - t0, 3)
        return row
    finally:
        s.close()


def summarize(rows: list[dict]) -> dict:
    n = len(rows)
    att = [r for r in rows if r["attempted"]]
    med = lambda xs: round(statistics.median(xs), 4) if xs else None  # noqa: E731
    out = {"prompts": n, "with_call": sum(r["calls"] > 0 for r in rows),
           "all_calls_valid_with_call": sum(r["valid"] for r in rows),
           "rate_valid": round(sum(r["valid"] for r in rows) / n, 3),
           "cut_by_max_new_tokens": sum(r["finish_reason"] == "length" for r in rows), "attempted": len(att), "rate_valid_of_attempted": round(sum(r["valid"] for r in att) / len(att), 3)
           if att else None,
           "invalid_regions": sum(r["invalid_regions"] for r in rows),
           "finish_reasons": {f: sum(r["finish_reason"] == f for r in rows) for f in sorted({r["finish_reason"]
                                                                                           for r in rows})},
           "decode_ms_per_token_median": med([r["decode_ms_per_token"] for r in rows if r["decode_ms_per_token"]]),
           "round_trip_s_median": med([r["round_trip_s"] for r in rows]),
           "turn2_rows": sum("turn2_s" in r for r in rows),
           "turn2_prefilled_median": med([r["turn2_prefilled"] for r in rows if "turn2_prefilled" in r]),
           "turn2_reused_median": med([r["turn2_reused"] for r in rows if "turn2_reused" in r])}
    masks = [r["mask_ms_per_token"] for r in rows if r.get("mask_ms_per_token") is not None]
    if masks:
        out["mask_ms_per_token_median"] = med(masks)
        out["mask_ms_per_token_max"] = round(max(masks), 4)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.bench_agent", description=__doc__.split("\n")[0])
    ap.add_argument("--executor", default="cpu")
    ap.add_argument("--n", type=int, default=len(PROMPTS), help=f"prompts (at most {len(PROMPTS)})")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="turn 1 (the call)")
    ap.add_argument("--answer-tokens", type=int, default=32, help="turn 2 (the answer to the tool result)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)

    load0 = os.getloadavg()
    t0 = time.perf_counter()
    eng = Engine.load(executor=a.executor, quiet=True)
    load_s = time.perf_counter() - t0
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in ALL_TOOLS}
    prompts = PROMPTS[:a.n]
    temps = [float(x) for x in a.temperatures.split(",")]
    t_c = time.perf_counter()
    first = eng.grammars.compile(tool_call_spec(ALL_TOOLS, "required", True))
    setup_ms = (time.perf_counter() - t_c) * 1e3  # tokenizer info + compiler + first compile
    runs, rows_all = [], {}
    for temp in temps:
        for mode in ("grammar_on", "grammar_off"):
            rows = [round_trip(eng, k, p, ALL_TOOLS, schemas, mode, temp, a.max_new_tokens, a.answer_tokens)
                    for k, p in enumerate(prompts)]
            rows_all[(mode, temp)] = rows
            runs.append({"mode": mode, "temperature": temp, **summarize(rows), "rows": rows})
            print(f"{mode} T={temp}: {runs[-1]['rate_valid']:.3f} valid with a call "
                  f"({runs[-1]['all_calls_valid_with_call']}/{len(rows)}), attempted {runs[-1]['attempted']}",
                  file=sys.stderr)
    gate = all(r["all_calls_valid"] and (r["calls"] > 0 or r["finish_reason"] == "length")
               for (mode, _), rows in rows_all.items() if mode == "grammar_on" for r in rows)
    doc = {"benchmark": "agent", "device": cpu_name(), "nproc": os.cpu_count(),
           "sched_affinity": len(os.sched_getaffinity(0)), "loadavg_before": [round(x, 2) for x in load0],
           "loadavg_after": [round(x, 2) for x in os.getloadavg()], "commit": commit(),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "executor": eng.executor.name,
           "executor_detail": eng.executor.detail, "model": str(eng.model_dir.name), "load_s": round(load_s, 2),
           "tools": [t["function"]["name"] for t in ALL_TOOLS], "max_new_tokens": a.max_new_tokens,
           "answer_tokens": a.answer_tokens,
           "grammar_setup_ms": round(setup_ms, 1), "grammar_first_compile_ms": round(first[1], 1),
           "gate": {"ok": gate, "rule": "grammar_on: every call parses and validates against its schema, and every "
                                         "reply that ended by itself (not cut by max_new_tokens) holds a call"},
           "runs": runs}
    text = json.dumps(doc, indent=1)
    print(text)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "agent.json").write_text(text + "\n")
    return 0 if gate else 1


if __name__ == "__main__":
    sys.exit(main())
