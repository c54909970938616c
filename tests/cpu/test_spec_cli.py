"""``--speculate`` on the CLI: parsed as off | auto | K (0..7), passed to the API, reported in the timing line and
``--json``; on an executor without an MTP draft the run decodes plainly and the timing line says why. A real run on
the trained model's cpu executor: tokens per round above 1 and the text of ``--speculate off``."""
from __future__ import annotations

import json

import pytest

from tests.helpers import run


@pytest.mark.parametrize("bad", ["9", "-1", "fast", "2.5"])
def test_bad_speculate_is_a_usage_error(fake_engine, bad):
    r = run(["generate", "hi", "--speculate", bad])
    assert r.exit_code == 2 and "--speculate" in r.output


def test_fallback_is_stated(fake_engine):
    r = run(["generate", "hi", "--max-new-tokens", "3", "--speculate", "4"])
    assert r.exit_code == 0, r.output
    assert "speculate off (the hash executor has no MTP draft" in r.stderr and "plain decode)" in r.stderr
    d = json.loads(run(["generate", "hi", "--max-new-tokens", "3", "--speculate", "auto", "--json"]).stdout)
    assert d["timings"]["rounds"] == 0 and d["timings"]["speculate"].startswith("off (")


def test_trained_model_speculates_with_plain_output():
    args = ["generate", "def fibonacci(n):", "--executor", "cpu", "--max-new-tokens", "24", "--json"]
    off = json.loads(run(args + ["--speculate", "off"]).stdout)
    on = json.loads(run(args + ["--speculate", "3"]).stdout)
    assert on["ids"] == off["ids"] and on["text"] == off["text"]
    t = on["timings"]
    assert t["speculate"] == "3" and t["rounds"] > 0 and t["tokens_per_round"] > 1 and t["tokens_per_step"] > 1
    assert len(t["acceptance"]) == len(t["acceptance_counts"]) >= 1 and t["ms_per_token"] > 0
    assert off["timings"]["rounds"] == 0 and off["timings"]["speculate"] == "off"
