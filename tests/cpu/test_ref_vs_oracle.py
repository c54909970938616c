"""Reference model vs the transformers oracle under teacher forcing (DESIGN.md "What correct means" 1).

Goldens: tests/golden/oracle_*.npz (python3 -m tests.golden.record); envelope: assembler/ref/envelope.py,
calibrated on the oracle's own prefill-vs-generation disagreement (docs/tolerance.md). CI runs the sanity prompt
(both paths, exact top-1), the prose prompt's prefill path and the first positions of its generation path, and
the wrong-RoPE-base negative control; ``-m slow`` runs every recorded prompt through both paths."""
from pathlib import Path

import numpy as np
import pytest

from assembler.ref.envelope import Envelope, load_goldens
from assembler.ref.oracle_check import run_reference, score_run

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
GOLDENS = load_goldens(GOLDEN)
pytestmark = pytest.mark.skipif(not GOLDENS, reason="no oracle goldens recorded (python3 -m tests.golden.record)")


@pytest.fixture(scope="module")
def weights(tiny_ckpt):
    import json

    from loader.checkpoint import Checkpoint
    from tests.golden.record import weights_fingerprint
    ck = Checkpoint.open(tiny_ckpt)
    want = json.loads((GOLDEN / "manifest.json").read_text())["weights_fingerprint"]
    assert weights_fingerprint(ck) == want, "synthetic weights changed since the goldens were recorded: re-record"
    return ck


@pytest.fixture(scope="module")
def envelope():
    return Envelope.calibrate(GOLDENS)


@pytest.fixture(scope="module")
def model(weights):
    from assembler.ref.model import ReferenceModel
    return ReferenceModel(weights, oracle_weights=True)


def _check(env, model, names, path, upto=None):
    scores = {"pre": [], "dec": []}
    for n in names:
        g = GOLDENS[n]
        res = run_reference(model, g, path, upto)
        for op in scores:
            scores[op].append(score_run(n, res, g, op, upto))
    return {op: env.check(s) for op, s in scores.items()}, scores


@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_sanity_prompt_both_paths(envelope, model, path):
    res, _ = _check(envelope, model, ["sanity"], path)
    for op, (ok, fails) in res.items():
        assert ok, f"{path} vs oracle {op}: {fails}"


@pytest.mark.skipif("prose" not in GOLDENS, reason="prose golden not recorded")
def test_prose_prefill_and_decode_prefix(envelope, model):
    res, _ = _check(envelope, model, ["prose"], "prefill")
    assert all(ok for ok, _ in res.values()), res
    res, _ = _check(envelope, model, ["prose"], "decode", upto=96)
    assert all(ok for ok, _ in res.values()), res


@pytest.mark.skipif("prose" not in GOLDENS or "pre_rec0" not in GOLDENS.get("prose", {}), reason="no state golden")
def test_prose_prefill_state_within_oracle_self_difference(model):
    """GDN recurrent (fp32) and conv (bf16) state and KV rows after the prompt: the reference's prefill state
    differs from the oracle's prefill state by no more than the oracle's two paths differ from each other."""
    g = GOLDENS["prose"]
    res = run_reference(model, g, "prefill")
    st = res["state"]
    for li in (0, 6):
        self_d = np.abs(g[f"pre_rec{li}"] - g[f"dec_rec{li}"]).max()
        ref_d = np.abs(st.rec[li] - g[f"pre_rec{li}"]).max()
        assert ref_d <= max(self_d, 1e-6), (li, ref_d, self_d)
        conv_self = np.abs(g[f"pre_conv{li}"].astype(np.float32) - g[f"dec_conv{li}"].astype(np.float32)).max()
        conv_ref = np.abs(st.conv[li].astype(np.float32) - g[f"pre_conv{li}"].astype(np.float32)).max()
        assert conv_ref <= max(conv_self, 2 ** -7 * np.abs(g[f"pre_conv{li}"].astype(np.float32)).max()), (li, conv_ref)
    rows = g["pre_kv_rows"]
    for a, b in ((st.k[3][rows], g["pre_k"]), (st.v[3][rows], g["pre_v"])):
        d = np.abs(a.astype(np.float32) - b.astype(np.float32))
        assert d.max() <= 2 ** -6 * np.abs(b.astype(np.float32)).max() + 1e-6


@pytest.mark.skipif("prose" not in GOLDENS, reason="prose golden not recorded")
def test_wrong_rope_base_is_rejected(envelope, weights):
    from assembler.ref.model import ReferenceModel
    bad = ReferenceModel(weights, rope_theta=1e4, oracle_weights=True)
    res, _ = _check(envelope, bad, ["prose"], "prefill")
    assert not any(ok for ok, _ in res.values())


@pytest.mark.slow
@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_all_prompts(envelope, model, path):
    res, scores = _check(envelope, model, sorted(GOLDENS), path)
    for op, (ok, fails) in res.items():
        assert ok, f"{path} vs oracle {op}: {fails}"
