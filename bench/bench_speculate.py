"""MTP speculative decoding on the cpu executor, trained model: real acceptance per position, tokens per round and
ms per emitted token for k = 1..7 and ``auto``, beside plain decode in the same run, on held-out code, prose and
tool-call prompts; the verify cost per M; the draft cost and acceptance with the full and the pruned draft head.

``python3 -m bench.bench_speculate [--prompts 3] [--new 64] [--reps 2] [--out bench/results/e2e]``

Held-out text, as the training split it (docs/trained-model.md): code = the held-out CPython stdlib files of the
artefact's manifest (``val_files``) read from this machine's stdlib; prose = the held-out docs sources, unpacked
from the Debian ``python3.11-doc`` .deb in /var/cache/apt/archives; tools = validation-seed conversations of
``tools.train.conversations`` (seed 2), cut at the last assistant turn. A prompt is the first ``PROMPT_TOKENS``
tokens of a file (tools: the conversation up to the generation prompt), greedy, ``--new`` tokens.

Checks before it times (a failed check aborts, exit 1): every speculative run emits the ids of plain decode.
Timing: for each prompt the modes run interleaved, ``--reps`` times, median ms per emitted token per mode; the
machine is shared (2 cores, other jobs), so the JSON carries the load averages before and after.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness import commit
from host.engine import Engine
from host.sampling import Sampler, SamplingParams
from host.speculate import Speculator
from loader import trained
from tools.train import conversations
from tools.train.corpus import VAL_SEED

PROMPT_TOKENS = 192
MODES = ["off", 1, 2, 3, 4, 5, 6, 7, "auto"]


def held_out_prompts(engine, n: int) -> dict[str, list[list[int]]]:
    """``n`` prompt id lists per split (code, prose, tools) from the training run's held-out text."""
    val = trained.manifest(trained.DEFAULT_MODEL)["corpus"]["val_files"]
    root = Path(sysconfig.get_paths()["stdlib"])
    code = [(root / f).read_text(encoding="utf-8") for f in val["code"] if (root / f).is_file()]
    code = [t for t in code if len(t) > 2000][:n]
    prose = []
    debs = sorted(Path("/var/cache/apt/archives").glob("python3.11-doc_*.deb"))
    if debs:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["dpkg-deb", "-x", str(debs[0]), tmp], check=True)
            src = next(Path(tmp).rglob("_sources"))
            prose = [(src / f).read_text(encoding="utf-8") for f in val["docs"] if (src / f).is_file()]
    prose = [t for t in prose if len(t) > 2000][:n]
    tools = []
    head = "<|im_start|>assistant\n"
    for conv in conversations.generate(4 * n, VAL_SEED):      # cut before the first assistant turn that calls a tool
        at = [i for i in range(len(conv)) if conv.startswith(head, i)]
        calls = [i for i in at if "<tool_call>" in conv[i:conv.find("<|im_end|>", i)]]
        if calls:
            tools.append(conv[:calls[0] + len(head)])
    out = {"code": [engine.encode(t)[:PROMPT_TOKENS] for t in code],
           "prose": [engine.encode(t)[:PROMPT_TOKENS] for t in prose],
           "tools": [engine.encode(t)[-PROMPT_TOKENS * 4:] for t in tools[:n]]}
    return {k: v for k, v in out.items() if v}


def verify_costs(engine, reps: int = 7) -> dict:
    """Median ms of one recorded M-row step pass (M = 1..8, then rolled back) and of one draft step with the full
    and the pruned head, after a 128-token prefill."""
    ex = engine.executor
    ex.reset(0)
    ids = list(range(1000, 1128))
    ex.prefill(ids)
    st, m = ex._state, ex.model
    out = {"verify_ms": {}, "step_ms": None, "draft_step_ms": {}}
    for M in range(1, 9):                                          # warm-up
        m.decode(st, ids[:M], record=True)
        m.keep_rows(st, 1)
        st.pos -= 1
    for M in range(1, 9):
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            m.decode(st, ids[:M], record=True)
            ts.append((time.perf_counter() - t) * 1e3)
            m.keep_rows(st, 1)
            st.pos -= 1
        out["verify_ms"][M] = round(float(np.median(ts)), 3)
    ts = []
    for _ in range(reps):
        snap = ex.state_snapshot()
        t = time.perf_counter()
        ex.step(5)
        ts.append((time.perf_counter() - t) * 1e3)
        ex.state_restore(snap)
    out["step_ms"] = round(float(np.median(ts)), 3)
    for name, core in (("full head (248,077 ids)", None), ("pruned head (core 32,768 + session ids)", 32768),
                       ("pruned head (core 8,192 + session ids)", 8192)):
        sp = Speculator(ex, core_size=core)
        sp.begin()
        g = Sampler(SamplingParams())
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            sp.draft(7, 4, g)
            ts.append((time.perf_counter() - t) * 1e3 / 4)
        out["draft_step_ms"][name] = round(float(np.median(ts)), 3)
    return out


def run(engine, prompts: dict, new: int, reps: int) -> tuple[dict, list]:
    """Per split and mode: acceptance per position, tokens per round, median ms per emitted token."""
    res, fails = {}, []
    for split, plist in prompts.items():
        agg = {str(m): {"acc": np.zeros(7), "tried": np.zeros(7), "rounds": 0, "tokens": 0, "ms": []} for m in MODES}
        for pi, p in enumerate(plist):
            per = {str(m): [] for m in MODES}
            base = None
            for rep in range(reps):
                for mode in MODES:
                    r = engine.generate(p, max_new_tokens=new, speculate=mode).result()
                    if base is None:
                        base = r.ids
                    elif r.ids != base:
                        fails.append(f"{split} prompt {pi} mode {mode}: ids differ from plain decode")
                    per[str(mode)].append(r.timings.ms_per_token)
                    a = agg[str(mode)]
                    if rep == 0:
                        for i, (acc, tried) in enumerate(r.timings.acceptance_counts):
                            a["acc"][i] += acc
                            a["tried"][i] += tried
                        a["rounds"] += r.timings.rounds
                        a["tokens"] += r.timings.generated_tokens - 1 - (r.timings.steps - r.timings.rounds)
            for mode in MODES:
                agg[str(mode)]["ms"].append(float(np.median(per[str(mode)])))
            print(f"bench_speculate: {split} prompt {pi}: " + ", ".join(f"{m} {np.median(per[str(m)]):.1f}"
                                                                   for m in MODES) + " ms/token", file=sys.stderr)
        rows = {}
        plain = float(np.mean(agg["off"]["ms"]))
        for mode in MODES:
            a = agg[str(mode)]
            ms = float(np.mean(a["ms"]))
            tried = a["tried"] > 0
            rows[str(mode)] = {
                "acceptance_per_position": [round(float(x), 3) for x in (a["acc"][tried] / a["tried"][tried])],
                "proposed_per_position": [int(x) for x in a["tried"][tried]],
                "tokens_per_round": round(a["tokens"] / a["rounds"], 3) if a["rounds"] else None,
                "rounds": a["rounds"], "ms_per_token": round(ms, 2), "speedup_vs_plain": round(plain / ms, 3)}
        res[split] = {"prompts": len(plist), "prompt_tokens": [len(p) for p in plist], "modes": rows}
    return res, fails


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.bench_speculate", description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=3, help="prompts per split")
    ap.add_argument("--new", type=int, default=64, help="tokens generated per run")
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions of every (prompt, mode)")
    ap.add_argument("--out", default=None, help="directory to write speculate.json into")
    a = ap.parse_args(argv)
    load0 = os.getloadavg()
    engine = Engine.load(executor="cpu", capacity=1024, slots=1, quiet=True)
    prompts = held_out_prompts(engine, a.prompts)
    costs = verify_costs(engine)
    res, fails = run(engine, prompts, a.new, a.reps)
    out = {"benchmark": "speculate", "model": engine.cfg.name, "executor": engine.executor.detail,
           "machine": f"shared 2-core machine without a GPU (nproc {os.cpu_count()}, other jobs running)",
           "loadavg_before": [round(x, 2) for x in load0], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
           "blas_threads_env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")},
           "commit": commit(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "greedy": True, "new_tokens": a.new, "reps": a.reps, "check": {"ok": not fails, "failures": fails},
           "costs": costs, "splits": res}
    text = json.dumps(out, indent=1)
    print(text)
    if fails:
        print("bench_speculate: check failed: " + "; ".join(fails[:5]), file=sys.stderr)
        return 1
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "speculate.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
