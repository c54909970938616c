"""Run the reference model under teacher forcing on a recorded prompt and score it against the oracle
(``assembler.ref.envelope``). Used by tests/cpu/test_ref_vs_oracle.py; GPU gates can pass their own runner."""
from __future__ import annotations

import numpy as np

from assembler.ref import ops
from assembler.ref.envelope import PromptScore, score
from assembler.ref.numerics import f32

LM_BATCH = 128      # rows per batched lm_head GEMM (exact per row, so batching changes no bit)


def _gather(model, hidden: np.ndarray, golden: dict, rows: np.ndarray) -> dict:
    """Logits at the oracle's top-32 ids of both paths + full argmax + full rows at golden['full_pos']."""
    out = {"pre": [], "dec": [], "argmax": [], "full": {}}
    full_pos = set(int(p) for p in golden["full_pos"])
    for a in range(0, len(rows), LM_BATCH):
        r = rows[a:a + LM_BATCH]
        lg = model.logits(hidden[a:a + LM_BATCH])
        lf = f32(lg)
        for path in ("pre", "dec"):
            out[path].append(np.take_along_axis(lf, golden[f"{path}_top_ids"][r].astype(np.int64), -1))
        out["argmax"].append(ops.argmax(lg))
        for i, t in enumerate(r):
            if int(t) in full_pos:
                out["full"][int(t)] = lf[i]
    return {"pre": np.concatenate(out["pre"]), "dec": np.concatenate(out["dec"]),
            "argmax": np.concatenate(out["argmax"]), "full": out["full"]}


def run_reference(model, golden: dict, path: str, upto: int | None = None) -> dict:
    """Teacher-forced run of ``path`` ('prefill' or 'decode') over the first ``upto`` prompt tokens.
    Returns {'pre': [T, 32], 'dec': [T, 32], 'argmax': [T], 'full': {pos: [V]}, 'state': ModelState}."""
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
