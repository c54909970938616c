"""``qwen-mk serve`` from the client's side: time to first token and inter-token latency through the ``openai``
client (streaming chat), for a few prompt lengths.

``python3 -m bench.bench_serve [--model DIR | --preset NAME] [--executor EX] [--lengths 16,256,1024]
[--max-tokens 32] [--reps 3] [--out DIR]``

Starts ``python3 -m host.cli serve --port 0`` as a subprocess (loopback, a free port; its own process, so the
client's work here does not share the engine's interpreter lock), checks before it times that a
streamed greedy answer equals the non-streamed one, then for each prompt length sends ``--reps`` streamed
requests of a prompt of exactly that many tokens (a ``/v1/completions`` prompt of token ids: no template, and a
new first token each rep so no resident session is reused) with ``max_tokens`` fixed and ``ignore``-free greedy
decoding. TTFT: request sent -> first chunk with text; ITL: gaps between later text chunks (median, p90). Also one
request per length that appends 16 tokens to the last prompt (its prefix resident, from the state checkpoint at
the last multiple of 64 it reached): the TTFT with ``cached_tokens``.
Writes ``serve.json`` to ``--out`` (default ``bench/results/e2e``) with the machine's load averages: the CPU
figures come from a shared 2-core machine.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.harness import commit
from loader.tokenizer import Tokenizer


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def stream_once(client, model: str, prompt, max_tokens: int) -> dict:
    """One streamed completion: TTFT and inter-token gaps in ms, measured at the client."""
    t0 = time.perf_counter()
    stamps, text, usage = [], "", None
    for ch in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                        stream=True, stream_options={"include_usage": True}):
        if ch.usage is not None:
            usage = ch.usage
        if ch.choices and ch.choices[0].text:
            stamps.append(time.perf_counter())
            text += ch.choices[0].text
    gaps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    return {"ttft_ms": (stamps[0] - t0) * 1e3 if stamps else None, "gaps_ms": gaps, "text": text,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None}


def main() -> None:
    """Run the benchmark (module docstring) and write serve.json."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default=None)
    ap.add_argument("--executor", default=None)
    ap.add_argument("--lengths", default="16,256,1024")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "e2e"))
    a = ap.parse_args()

    import openai

    lengths = [int(x) for x in a.lengths.split(",")]
    load0 = os.getloadavg()
    name = "bench"
    cmd = [sys.executable, "-m", "host.cli", "serve", "--port", "0", "--served-model-name", name,
           "--max-model-len", str(max(lengths) + a.max_tokens + 64)]
    for flag, v in (("--model", a.model), ("--preset", a.preset), ("--executor", a.executor)):
        if v:
            cmd += [flag, v]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    url = None
    for line in proc.stderr:
        if m := re.search(r"ready at (http://\S+/v1)", line):
            url = m.group(1)
            break
    if url is None:
        raise SystemExit(f"bench_serve: the server did not start (exit {proc.wait()})")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its stderr pipe drained
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    model_dir = client.models.list().data[0].model_extra.get("root")
    tok = Tokenizer.from_checkpoint(model_dir)

    # check before timing: streamed == whole, greedy
    msgs = [{"role": "user", "content": "def fibonacci(n):"}]
    whole = client.chat.completions.create(model=name, messages=msgs, max_tokens=16, temperature=0)
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=name, messages=msgs, max_tokens=16, temperature=0, stream=True) if c.choices]
    if "".join(parts) != whole.choices[0].message.content:
        raise SystemExit("bench_serve: the streamed answer differs from the whole one")

    base = tok.encode(open(Path(__file__).resolve().parents[1] / "host" / "session.py").read())
    results = []
    for n in lengths:
        runs = []
        for rep in range(a.reps + 1):  # the first is a warm-up, not reported
            ids = tok.encode(str(rep))[:1] + base[:n - 1]  # a new first token (a digit): nothing to reuse
            r = stream_once(client, name, ids, a.max_tokens)
            if rep:
                runs.append(r)
        again = stream_once(client, name, ids + base[n - 1:n + 15], a.max_tokens)  # 16 more tokens after the last
        gaps = [g for r in runs for g in r["gaps_ms"]]
        results.append({"prompt_tokens": n, "max_tokens": a.max_tokens, "reps": a.reps,
                        "ttft_ms": [round(r["ttft_ms"], 1) for r in runs],
                        "ttft_ms_median": round(statistics.median(r["ttft_ms"] for r in runs), 1),
                        "itl_ms_median": round(statistics.median(gaps), 2), "itl_ms_p90": round(_pct(gaps, 0.9), 2),
                        "resident_prefix": {"ttft_ms": round(again["ttft_ms"], 1),
                                            "cached_tokens": again["cached_tokens"]}})
        print(json.dumps(results[-1]), flush=True)
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    doc = {"benchmark": "serve", "what": "qwen-mk serve (its own process), openai client, streamed /v1/completions,"
                                         " greedy", "command": " ".join(cmd[1:]), "model": model_dir,
           "machine": {"platform": platform.platform(), "nproc": os.cpu_count(), "loadavg_before": load0,
                       "loadavg_after": os.getloadavg(), "note": "shared machine: other jobs ran beside it"},
           "commit": commit(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "results": results}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out / 'serve.json'}")


if __name__ == "__main__":
    main()
