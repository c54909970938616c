"""Run the reference model under teacher forcing on a recorded prompt and score it against the oracle
(``assembler.ref.envelope``). Used by tests/cpu/test_ref_vs_oracle.py; GPU gates can pass their own runner.

``python3 -m assembler.ref.oracle_check --path prefill|decode [--engine] [--theta X] [--only NAME ...]`` prints,
per oracle path, pass/fail, the pooled d32 statistics and the top-1 table per margin bucket (docs/tolerance.md).
Default candidate: the reference with the oracle's bf16-dequantised weights; ``--engine`` uses the engine's exact
fp8 × scale GEMV; ``--theta`` overrides the RoPE base (the negative control uses 1e4)."""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from assembler.ref import ops
from assembler.ref.envelope import Envelope, PromptScore, load_goldens, score
from assembler.ref.model import ReferenceModel
from assembler.ref.numerics import f32
from loader.checkpoint import Checkpoint
from loader.synthetic import ensure_checkpoint

LM_BATCH = 128      # rows per batched lm_head GEMM (exact per row, so batching changes no bit)


def _gather(model, hidden: np.ndarray, golden: dict, rows: np.ndarray) -> dict:
    """Logits at the oracle's top-32 ids of both paths + full-vocabulary argmax."""
    out = {"pre": [], "dec": [], "argmax": []}
    for a in range(0, len(rows), LM_BATCH):
        r = rows[a:a + LM_BATCH]
        lg = model.logits(hidden[a:a + LM_BATCH])
        lf = f32(lg)
        for path in ("pre", "dec"):
            out[path].append(np.take_along_axis(lf, golden[f"{path}_top_ids"][r].astype(np.int64), -1))
        out["argmax"].append(ops.argmax(lg))
    return {k: np.concatenate(v) for k, v in out.items()}


def run_reference(model, golden: dict, path: str, upto: int | None = None) -> dict:
    """Teacher-forced run of ``path`` ('prefill' or 'decode') over the first ``upto`` prompt tokens.
    Returns {'pre': [T, 32], 'dec': [T, 32], 'argmax': [T], 'state': ModelState}."""
    ids = golden["ids"].astype(np.int64)[:upto]
    st = model.new_state(len(ids) + 8)
    if path == "prefill":
        model.prefill(st, ids, logit_rows="none")
        hidden = st.hidden
    else:
        rows = []
        for t in ids:
            model.decode(st, [t], logits=False)
            rows.append(st.hidden[0])
        hidden = np.stack(rows)
    res = _gather(model, hidden, golden, np.arange(len(ids)))
    res["state"] = st
    return res


def score_run(name: str, res: dict, golden: dict, oracle_path: str, upto: int | None = None) -> PromptScore:
    """Score a run against oracle path 'pre' or 'dec' (golden truncated to ``upto`` positions)."""
    g = {k: (v[:upto] if k in (f"{oracle_path}_top_vals", f"{oracle_path}_argmax") else v) for k, v in golden.items()}
    return score(name, res[oracle_path], res["argmax"], g, oracle_path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="reference vs transformers oracle goldens (docs/tolerance.md)")
    ap.add_argument("--path", choices=("prefill", "decode"), required=True)
    ap.add_argument("--engine", action="store_true", help="exact fp8 x scale weights instead of the oracle's bf16")
    ap.add_argument("--theta", type=float, default=None, help="RoPE base override (negative control)")
    ap.add_argument("--only", nargs="*", help="prompt names (default: all recorded)")
    ap.add_argument("--goldens", default=str(Path(__file__).resolve().parents[2] / "tests" / "golden"))
    a = ap.parse_args(argv)
    goldens = load_goldens(a.goldens)
    env = Envelope.calibrate(goldens)
    model = ReferenceModel(Checkpoint.open(ensure_checkpoint("tiny")), rope_theta=a.theta, oracle_weights=not a.engine)
    scores = {"pre": [], "dec": []}
    for n, g in goldens.items():
        if a.only and n not in a.only:
            continue
        res = run_reference(model, g, a.path)
        for op in scores:
            scores[op].append(score_run(n, res, g, op))
    for op, sc in scores.items():
        d = np.concatenate([p.d32 for p in sc])
        ok, fails = env.check(sc)
        print(f"{a.path} vs oracle {op}: {'pass' if ok else 'FAIL'}; {d.size} positions; d32 max {d.max():.4g} "
              f"p99 {np.percentile(d, 99):.4g} p50 {np.percentile(d, 50):.4g} mean {d.mean():.4g}")
        print(f"  {'bucket':12s} {'n':>5s} {'cand':>7s} {'self':>7s} {'b':>4s} {'c':>4s} {'p':>8s} {'allowance':>9s}")
        for r in env.top1_table(sc):
            rule = "(a) 100 %" if r["bucket"] == "clear" else f"{r['allowance']:9.4f}"
            print(f"  {r['bucket']:12s} {r['n']:5d} {r['cand']:7.4f} {r['self']:7.4f} {r['b']:4d} {r['c']:4d} "
                  f"{r['p']:8.2g} {rule:>9s}")
        for f in fails:
            print("  fail:", f)


if __name__ == "__main__":
    main()
