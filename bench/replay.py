"""Agent-trajectory replay: the whole engine on recorded conversations, at a fixed token count per step.

``python3 -m bench.replay [--model qwen3.5-tiny-trained | --preset qwen3.5-27b] [--executors cpu]
[--configs resident,stateless,grammar_off,speculate] [--trajectories t0_1536,...] [--max-context N]
[--max-steps N] [--fixture F] [--out DIR] [--where cpu]``;
``python3 -m bench.replay plot JSON... --out PNG`` draws the stacked bars from result files (``bench.replay_plot``).

For each trajectory of the fixture (``bench.trajectories.record``) and each step, the session is handed the
recorded token stream so far (every earlier step's appended and generated ids, then this step's appended ids) and
generates exactly as many tokens as the recording did: greedy, ``max_new_tokens`` = the recorded count and no stop
id (``stop_ids=[]``), so every configuration does the same work. With the tool grammar on, a reply the grammar ends
stops at its EOS: that is the recorded count whenever the replay reproduces the recording (``ids_match``). The next
step always continues from the recorded ids, so a reply that differs makes the session re-run from its checkpoint
(``re_prefilled``). Configurations (``--configs``):

- ``resident``: one session per trajectory (prefix reuse); tool grammar on (``tool_choice="auto"``); no speculation;
- ``stateless``: a fresh session every step: the whole history is prefilled again (a server without residency);
- ``grammar_off``: resident, the tool calls parsed but not constrained (``tool_grammar=False``);
- ``speculate``: resident, grammar off (a grammar turns speculation off), ``speculate="auto"``; where the executor
  cannot speculate the step's ``speculate`` field says why (``Timings.speculate``).

Per step: prompt, appended, prefilled, reused and re-prefilled tokens (prefilled beyond the ids new to a resident
session: the appended ids and the previous reply's last id), generated vs recorded count and ids_match, wall, TTFT,
prefill, decode and host ms (host = wall - prefill - decode: argument checks, grammar set-up, session open,
result assembly), decode ms per token, tokens per round, grammar mask ms. Totals per trajectory and config, and the
residency speed-up (stateless / resident wall time, per trajectory and over the trajectories both ran). Writes
``bench/results/e2e/replay_<model>_<where>.json`` (or ``--out``) after every run (``complete`` false until the
last), so a run cut by a timeout keeps what it measured.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import sys
import time
from pathlib import Path

from bench.harness import commit, cpu_name, device_meta
from bench.replay_plot import main as plot_main
from bench.trajectories.record import FIXTURE, load
from host.engine import Engine
from host.executors import CPU_KINDS, default_kind

OUT = Path(__file__).resolve().parent / "results" / "e2e"
CONFIGS = {  # name: (resident, grammar, speculate)
    "resident": (True, True, "off"), "stateless": (False, True, "off"),
    "grammar_off": (True, False, "off"), "speculate": (True, False, "auto")}
# Rough rates for the estimate printed before a run: (prefill ms/token at 0 context, extra ms/token per 1k context,
# decode ms/token); measured on this project's machines (docs/replay.md), only to size a run.
RATES = {("cpu", "tiny"): (3.0, 1.6, 90.0), ("gpu", "tiny"): (0.05, 0.0, 2.0), ("gpu", "27b"): (0.55, 0.027, 9.0)}


def select(trajs: list[dict], names: str | None, max_context: int | None, max_steps: int | None) -> list[dict]:
    """The trajectories to replay: by name (comma-separated; None = all), each cut to its first ``max_steps``
    steps and to the steps whose prompt plus reply fits in ``max_context`` tokens; empty ones dropped."""
    want = None if names is None else names.split(",")
    out = []
    for t in trajs:
        if want is not None and t["name"] not in want:
            continue
        steps, n = [], 0
        for s in t["steps"][:max_steps]:
            n += len(s["append"]) + len(s["generated"])
            if max_context is not None and n > max_context:
                break
            steps.append(s)
        if steps:
            out.append({**t, "steps": steps, "context": sum(len(s["append"]) + len(s["generated"]) for s in steps)})
    return out


def work(trajs: list[dict], config: str) -> dict:
    """Tokens a configuration runs: prefill (appended ids, or the whole prompt every step when stateless) as
    (tokens, sum of tokens × context in k-tokens), and generated tokens."""
    pre = attn = gen = 0
    for t in trajs:
        ctx = 0
        for s in t["steps"]:
            run = ctx + len(s["append"]) if not CONFIGS[config][0] else len(s["append"])
            pre += run
            attn += run * (ctx + len(s["append"])) / 2e3
            ctx += len(s["append"]) + len(s["generated"])
            gen += len(s["generated"])
    return {"prefill_tokens": pre, "prefill_ktoken_context": attn, "generated_tokens": gen}


def estimate_s(trajs: list[dict], configs: list[str], where: str, size: str) -> float:
    """Seconds the run should take at RATES (an estimate; printed before starting)."""
    p0, p1, d = RATES.get((where, size), RATES[("gpu", "27b")])
    tot = 0.0
    for c in configs:
        w = work(trajs, c)
        tot += (w["prefill_tokens"] * p0 + w["prefill_ktoken_context"] * p1 + w["generated_tokens"] * d) / 1e3
    return tot


def replay_one(eng, traj: dict, config: str, history: str = "recorded") -> dict:
    """Replay one trajectory under ``config``; returns {"trajectory", "config", "steps": [...], "totals": {...}}.
    ``history``: ``recorded`` (the next step continues from the recorded reply: a reply that differs is re-run
    from the session's checkpoint) or ``generated`` (from the reply this replay generated, the recorded count of
    ids: for synthetic weights, whose replies never match, so every configuration still does the recorded work)."""
    resident, grammar, spec = CONFIGS[config]
    tools = traj["tools"]
    kw = dict(tools=tools, tool_choice="auto", reasoning=True, stop_ids=[], speculate=spec, tool_grammar=grammar)
    hist: list[int] = []
    rows = []
    s = eng.new_session() if resident else None
    try:
        for k, st in enumerate(traj["steps"]):
            mark = len(hist)
            hist = hist + st["append"]
            want = len(st["generated"])
            t0 = time.perf_counter()
            if not resident:
                s = eng.new_session()
            r = s.generate(hist, max_new_tokens=want, checkpoint_at=[mark], **kw).result()
            if not resident:
                s.close()
            wall = (time.perf_counter() - t0) * 1e3
            tm = r.timings
            new = len(st["append"]) + (1 if k else 0)
            gram = r.grammar or {}
            rows.append({
                "step": k, "kind": st["kind"], "prompt_tokens": len(hist), "appended_tokens": len(st["append"]),
                "prefilled_tokens": tm.prefilled_tokens, "reused_tokens": tm.reused_tokens,
                "re_prefilled_tokens": max(0, tm.prefilled_tokens - new), "recorded_tokens": want,
                "generated_tokens": tm.generated_tokens, "ids_match": list(r.ids) == st["generated"],
                "wall_ms": round(wall, 3), "ttft_ms": round(tm.ttft_ms, 3), "prefill_ms": round(tm.prefill_ms, 3),
                "decode_ms": round(tm.decode_ms, 3), "host_ms": round(wall - tm.prefill_ms - tm.decode_ms, 3),
                "decode_ms_per_token": None if tm.ms_per_token is None else round(tm.ms_per_token, 4),
                "tokens_per_round": tm.tokens_per_round, "speculate": tm.speculate,
                "grammar_mask_ms": round(gram["mask_ms"], 3) if "mask_ms" in gram else None})
            hist = hist + (st["generated"] if history == "recorded" else list(r.ids))
    finally:
        if s is not None:
            s.close()
    return {"trajectory": traj["name"], "config": config, "history": history, "steps": rows, "totals": totals(rows)}


def totals(rows: list[dict]) -> dict:
    """Sums over a trajectory's steps; ``decode_ms_per_token`` = decode ms / tokens after each step's first."""
    keys = ["prefilled_tokens", "reused_tokens", "re_prefilled_tokens", "appended_tokens", "recorded_tokens",
            "generated_tokens", "wall_ms", "ttft_ms", "prefill_ms", "decode_ms", "host_ms"]
    out = {k: round(sum(r[k] for r in rows), 3) for k in keys}
    out["grammar_mask_ms"] = round(sum(r["grammar_mask_ms"] or 0.0 for r in rows), 3)
    out["steps"], out["ids_match_steps"] = len(rows), sum(r["ids_match"] for r in rows)
    after_first = sum(max(0, r["generated_tokens"] - 1) for r in rows)
    out["decode_ms_per_token"] = round(out["decode_ms"] / after_first, 4) if after_first else None
    out["context_tokens"] = rows[-1]["prompt_tokens"] + rows[-1]["generated_tokens"] if rows else 0
    return out


def check_accounting(run: dict) -> list[str]:
    """What is wrong with one replay's accounting (empty when nothing): every step generated its recorded count;
    a resident step whose previous reply matched the recording prefilled only its new ids (appended + the previous
    reply's last id) and reused the rest, none re-prefilled; a stateless step reused nothing and prefilled its whole
    prompt; prompt = reused + prefilled; the totals are the sums of the steps."""
    bad = []
    resident = CONFIGS[run["config"]][0]
    prev_match = True
    for r in run["steps"]:
        k = r["step"]
        if r["generated_tokens"] != r["recorded_tokens"]:
            bad.append(f"step {k}: generated {r['generated_tokens']}, recorded {r['recorded_tokens']}")
        if r["reused_tokens"] + r["prefilled_tokens"] != r["prompt_tokens"] and r["re_prefilled_tokens"] == 0:
            bad.append(f"step {k}: reused {r['reused_tokens']} + prefilled {r['prefilled_tokens']} != prompt "
                       f"{r['prompt_tokens']}")
        if resident and prev_match:
            new = r["appended_tokens"] + (1 if k else 0)
            if r["prefilled_tokens"] != new or r["re_prefilled_tokens"]:
                bad.append(f"step {k}: resident prefilled {r['prefilled_tokens']} (re-prefilled "
                           f"{r['re_prefilled_tokens']}), expected only its {new} new ids")
        if not resident and (r["reused_tokens"] or r["prefilled_tokens"] != r["prompt_tokens"]):
            bad.append(f"step {k}: stateless reused {r['reused_tokens']}, prefilled {r['prefilled_tokens']} of "
                       f"{r['prompt_tokens']}")
        prev_match = r["ids_match"] or run.get("history") == "generated"  # the session holds its own reply
    want = totals(run["steps"])
    for key, v in want.items():
        if run["totals"].get(key) != v:
            bad.append(f"totals: {key} = {run['totals'].get(key)}, the steps sum to {v}")
    return bad


def speedups(runs: list[dict]) -> dict:
    """Per executor: stateless / resident total wall time, per trajectory and over the trajectories both ran."""
    out = {}
    for ex in sorted({r["executor"] for r in runs}):
        by = {(r["trajectory"], r["config"]): r["totals"]["wall_ms"] for r in runs if r["executor"] == ex}
        both = [t for (t, c) in by if c == "resident" and (t, "stateless") in by]
        if both:
            out[ex] = {"per_trajectory": {t: round(by[(t, "stateless")] / by[(t, "resident")], 3) for t in both},
                       "total": round(sum(by[(t, "stateless")] for t in both) / sum(by[(t, "resident")] for t in both),
                                      3), "trajectories": both}
    return out


def _warm(eng, traj: dict, config: str) -> None:
    """One short untimed generation under ``config``: compiles the grammar, builds the MTP head, first kernels."""
    resident, grammar, spec = CONFIGS[config]
    st = traj["steps"][0]
    s = eng.new_session()
    try:
        s.generate(st["append"], max_new_tokens=4, stop_ids=[], tools=traj["tools"], tool_choice="auto",
                   reasoning=True, speculate=spec, tool_grammar=grammar).result()
    finally:
        s.close()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plot"]:
        return plot_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python3 -m bench.replay", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory or name (default: the trained small model)")
    ap.add_argument("--preset", default=None, help="a synthetic preset instead (qwen3.5-27b, tiny)")
    ap.add_argument("--executors", default=None, help="comma-separated (default: the engine's default)")
    ap.add_argument("--configs", default="resident,stateless,grammar_off,speculate")
    ap.add_argument("--config-max-context", default="",
                    help="CONFIG=TOKENS,...: replay that config only on trajectories up to this context")
    ap.add_argument("--history", choices=("recorded", "generated"), default="recorded",
                    help="what the next step continues from (replay_one); generated for synthetic weights")
    ap.add_argument("--trajectories", default=None, help="names, comma-separated (default: all)")
    ap.add_argument("--max-context", type=int, default=None, help="drop steps past this context (tokens)")
    ap.add_argument("--max-steps", type=int, default=None, help="replay at most this many steps per trajectory")
    ap.add_argument("--fixture", default=None, help="trajectory file (default bench/fixtures/trajectories.json.gz)")
    ap.add_argument("--where", default=None, help="label of the machine in the file name (default cpu / gpu)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)

    fix = load(a.fixture or FIXTURE)
    trajs = select(fix["trajectories"], a.trajectories, a.max_context, a.max_steps)
    configs = a.configs.split(",")
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not trajs:
        ap.error(f"unknown configs {bad} (known: {list(CONFIGS)})" if bad else "no trajectory selected")
    executors = a.executors.split(",") if a.executors else [default_kind()]
    where = a.where or ("cpu" if all(e in CPU_KINDS for e in executors) else "gpu")
    size = "27b" if a.preset and "27b" in a.preset else "tiny"

    limits = {k: int(v) for k, v in (x.split("=") for x in a.config_max_context.split(",") if x)}

    def plan(c):
        return [t for t in trajs if t["context"] <= limits.get(c, 1 << 60)]

    est = sum(estimate_s(plan(c), [c], "cpu" if e in CPU_KINDS else "gpu", size) for e in executors for c in configs)
    print(f"replay: {len(trajs)} trajectories ({', '.join(t['name'] + ':' + str(t['context']) for t in trajs)}), "
          f"configs {configs}, executors {executors}; estimated {est:.0f} s (rough rates, bench.replay.RATES)",
          file=sys.stderr, flush=True)
    load0 = os.getloadavg()
    t_run = time.perf_counter()
    runs, engines = [], []
    cap = max(t["context"] for t in trajs) + 64
    Path(a.out).mkdir(parents=True, exist_ok=True)
    machine = _machine(where)

    def write(complete: bool) -> Path:
        """The result file as it stands (after every run: a run cut by a timeout keeps what it measured)."""
        model = engines[0]["model"]
        doc = {"benchmark": "replay", "model": model, "where": where, "complete": complete,
               "machine": machine, "nproc": os.cpu_count(), "loadavg_before": [round(x, 2) for x in load0],
               "loadavg_after": [round(x, 2) for x in os.getloadavg()], "commit": commit(),
               "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "command": "python3 -m bench.replay " + " ".join(argv),
               "fixture": {"path": str(a.fixture or FIXTURE.name), "meta": fix["meta"]},
               "configs": {c: dict(zip(("resident", "grammar", "speculate"), CONFIGS[c])) for c in configs},
               "config_max_context": limits, "history": a.history, "engines": engines, "estimate_s": round(est, 1),
               "run_s": round(time.perf_counter() - t_run, 1), "residency_speedup": speedups(runs), "runs": runs}
        p = Path(a.out) / f"replay_{model}_{where}.json"
        p.write_text(json.dumps(doc, indent=1) + "\n")
        return p

    for ex in executors:
        t0 = time.perf_counter()
        eng = Engine.load(a.preset or a.model, executor=ex, capacity=cap, slots=2, quiet=True)
        load_s = time.perf_counter() - t0
        engines.append({"executor": eng.executor.name, "detail": eng.executor.detail, "load_s": round(load_s, 2),
                        "model": a.preset or eng.model_dir.name, "capacity": cap})
        for c in configs:
            _warm(eng, trajs[0], c)
            for t in plan(c):
                run = replay_one(eng, t, c, a.history)
                run["executor"] = eng.executor.name
                run["accounting_problems"] = check_accounting(run)
                runs.append(run)
                write(False)
                tt = run["totals"]
                print(f"{ex} {c} {t['name']}: {tt['wall_ms'] / 1e3:.2f} s (prefill {tt['prefill_ms'] / 1e3:.2f}, "
                      f"decode {tt['decode_ms'] / 1e3:.2f}, host {tt['host_ms'] / 1e3:.2f}), prefilled "
                      f"{tt['prefilled_tokens']}, re-prefilled {tt['re_prefilled_tokens']}, ids match "
                      f"{tt['ids_match_steps']}/{tt['steps']}", file=sys.stderr, flush=True)
        del eng
        gc.collect()
    p = write(True)
    print(f"wrote {p}; residency speed-up {json.dumps(speedups(runs))}", file=sys.stderr)
    return 0


def _machine(where: str) -> str:
    if where == "cpu":
        return cpu_name()
    try:
        return device_meta()["device"]
    except Exception:  # noqa: BLE001 - no CuPy / no device: name the host CPU
        return cpu_name()


if __name__ == "__main__":
    sys.exit(main())
