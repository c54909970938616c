"""How a session cuts a prompt into prefill calls (``host.session.Session._prefill``): at most the executor's
``max_prefill_piece`` ids per call (the CPU paths: 256, after a first piece up to a multiple of 64), or, where the
executor sets no bound (the GPU executors: ``None``), one call up to each snapshot position; the cut never changes
the result (the cpu executor anchors its chunks at multiples of 64)."""
import numpy as np
import pytest

from host.engine import Engine
from host.executors import CpuExecutor, GraphExecutor, MegakernelExecutor


@pytest.fixture(scope="module")
def eng():
    return Engine.load("tiny", executor="cpu", capacity=1024, quiet=True)


def _run(eng, ids, cap, monkeypatch):
    ex = eng.executor
    monkeypatch.setattr(ex, "max_prefill_piece", cap, raising=False)
    pieces = []
    real = ex.prefill

    def spy(piece):
        pieces.append(len(piece))
        return real(piece)
    monkeypatch.setattr(ex, "prefill", spy)
    s = eng.new_session()
    r = s.generate(ids, max_new_tokens=4, stop_ids=[]).result()
    s.close()
    monkeypatch.setattr(ex, "prefill", real)
    return pieces, r.ids


def test_bounds_per_executor_kind():
    assert CpuExecutor.max_prefill_piece == 256
    assert GraphExecutor.max_prefill_piece is None and MegakernelExecutor.max_prefill_piece is None


def test_unbounded_executor_prefills_once_per_snapshot_and_gives_the_same_ids(eng, monkeypatch):
    ids = [int(x) for x in np.random.default_rng(7).integers(0, 240000, size=700)]
    bounded, ids_b = _run(eng, ids, 256, monkeypatch)
    unbounded, ids_u = _run(eng, ids, None, monkeypatch)
    # 700 ids, last multiple of 64 at 640 (snapshot): 256 + 256 + 128, then the tail of 60; unbounded: 640 + 60
    assert bounded == [256, 256, 128, 60]
    assert unbounded == [640, 60]
    assert ids_u == ids_b
    small, ids_s = _run(eng, ids, 64, monkeypatch)  # a 64 bound: a call per multiple of 64
    assert small == [64] * 10 + [60] and ids_s == ids_b
