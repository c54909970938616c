"""The megakernel against the discrete path on the tiny synthetic model: bit identity (uint16 / int32 / fp32
bit patterns) of every buffer the program writes — activations per layer, logits, argmax ids, GDN recurrent
state and conv rings, KV pages — after every step, for M = 1 and M = 2..8 rows over 64 consecutive steps (fused
split-K reduce, the default; for M = 1 also the GEMV_REDUCE program); the one-launch multi-step loop, the
persistent loop, the NOP program, the knobs, and a removed dependency.

Two DecodeSteps over one WeightsGPU: A runs the captured CUDA graph, B's allocations are driven by the
megakernel. Everything either path writes is NaN-poisoned before the first step.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from assembler.isa import Opcode, sub_parts  # noqa: E402
from loader.config import preset  # noqa: E402

STEPS = int(os.environ.get("QMK_MK_TEST_STEPS", "64"))  # scripts/sanitize.sh runs fewer (the tools are ~100× slower)
CAP = 8 * STEPS + 16


@pytest.fixture(scope="module")
def weights():
    from discrete.weights_gpu import WeightsGPU
    from loader.synthetic import SyntheticWeights
    return WeightsGPU.from_synthetic(SyntheticWeights(preset("tiny"), 0))


def _pair(weights, m, cap=CAP, **mk_kw):
    from discrete.step import DecodeStep
    from megakernel.runner import Megakernel
    cfg = weights.cfg
    a = DecodeStep(cfg, weights, cap, m, debug_logits=True)
    b = DecodeStep(cfg, weights, cap, m, debug_logits=True)
    mk = Megakernel(b, **mk_kw)
    for s in (a, b):
        s.poison()
        with s.stream:
            s.kv.pool.fill(0x7FC1)  # never-written KV slots are NaN in both
    mk.poison()
    return a, b, mk


def first_mismatch(a, b, mk, m) -> str | None:
    """First differing buffer (runner.compare_steps), formatted, or None."""
    from megakernel.runner import compare_steps
    r = compare_steps(a, b, mk.program, m)
    return None if r is None else "{} (layer {}) flat index {}: {} vs {} ({} differ)".format(*r)


def _done(mk):
    """mk.check(); a grid that never finishes (a deadlock) holds every SM, so nothing after it could run: print the
    stuck counters and end the process rather than let every later test time out behind it."""
    try:
        mk.check()
    except RuntimeError as e:
        if "did not finish" in str(e):
            print(f"FATAL: {e}", flush=True)
            os._exit(3)
        raise


def _tokens(rng, m):
    return rng.integers(0, 248000, size=m).astype(np.int32)


@pytest.mark.parametrize("defer_reduce,local_reduce", [(True, True), (False, True), (True, False)],
                         ids=["defer", "no_defer", "no_local"])
@pytest.mark.parametrize("fuse_reduce", [True, False], ids=["fused_reduce", "reduce_instr"])
@pytest.mark.parametrize("gdn_split", [1, 3], ids=["program", "gdn_split3"])
def test_m1_greedy_64_steps_bit_identical(gpu, weights, gdn_split, fuse_reduce, defer_reduce, local_reduce):
    """Greedy decode: A replays the graph, B runs one megakernel launch per step; both feed back their own
    argmax (the finish stage), so any difference anywhere propagates. gdn_split3: each GDN_STEP's value heads
    spread over 3 SMs (runner.split_gdn). fused_reduce: the split-K reduce done by each tile's last arriving GEMV
    warp; reduce_instr (the runner's default): GEMV_REDUCE instructions. defer (the runner's default): the out / o
    / down reduces rebuilt in the next GEMV's prologue (isa.py reduce_rmsnorm), no instruction of their own;
    local (the default; no_local: off): the in-projections reduced on their own instructions (isa.py
    LOCAL_REDUCE). The fused reduce's tile arrival counters must be back at 0 after every step (the last arrival
    resets them). The ARGMAX takes the head's per-SM best keys (isa.py ARGMAX_KEYS) in every case."""
    from assembler.isa import ARGMAX_KEYS, local_reduce as is_local
    a, b, mk = _pair(weights, 1, gdn_split=gdn_split, fuse_reduce=fuse_reduce, defer_reduce=defer_reduce,
                     local_reduce=local_reduce)
    ins = [i for l in mk.program.sm_lists for i in l]
    assert any(i.opcode == Opcode.GEMV_REDUCE for i in ins) != fuse_reduce
    assert any(i.opcode == Opcode.GEMV and sub_parts(i.sub)[0] == "reduce_rmsnorm" for i in ins) == defer_reduce
    assert any(is_local(i) for i in ins) == local_reduce
    assert any(i.opcode == Opcode.ARGMAX and i.sub & ARGMAX_KEYS for i in ins)
    for s in (a, b):
        s.reset(0, [1234])
    a.capture()
    for k in range(STEPS):
        a.replay()
        mk.step()
        _done(mk)
        bad = first_mismatch(a, b, mk, 1)
        assert bad is None, f"step {k}: {bad}"
    assert a.control().tobytes() == b.control().tobytes()
    cv = mk.counter_values()
    assert np.array_equal(cv, STEPS * np.array([c.expected for c in mk.program.counters])), "counter totals"
    assert mk.arrivals_pending() == 0, "a fused-reduce tile arrival counter was left nonzero"


@pytest.mark.parametrize("m,defer,local", [(2, None, True), (3, None, True), (4, None, True), (5, None, True),
                                           (6, None, True), (7, None, True), (8, None, True), (3, True, True),
                                           (3, None, False)],
                         ids=["2", "3", "4", "5", "6", "7", "8", "3-defer", "3-no_local"])
def test_m_rows_teacher_forced_bit_identical(gpu, weights, m, defer, local):
    """M rows per step (verify / short prefill form) with host-written tokens, 64 consecutive steps. The runner
    defers the residual reduces only for 1-row steps; 3-defer runs the deferred program at M = 3 too; the
    in-projections reduce on their own instructions (LOCAL_REDUCE) except in 3-no_local. An M-row ARGMAX scans
    the logits (the per-SM keys are a 1-row shortcut)."""
    rng = np.random.default_rng(100 + m)
    a, b, mk = _pair(weights, m, defer_reduce=defer, local_reduce=local)
    a.capture()
    for k in range(STEPS):
        t = _tokens(rng, m)
        a.replay(t)
        mk.step(t)
        _done(mk)
        bad = first_mismatch(a, b, mk, m)
        assert bad is None, f"m={m} step {k}: {bad}"


@pytest.mark.parametrize("sms", [7, 13])
@pytest.mark.parametrize("m", [1, 3])
def test_few_sms_local_rounds_bit_identical(gpu, weights, sms, m):
    """The default program on 7 / 13 SMs: the local-reduce in-projections (isa.py LOCAL_REDUCE) then hold several
    tiles per instruction and run several rounds of 16 / S tiles (on 132 SMs the tiny preset gives each one tile),
    so the round offsets, the shared-memory partial stride and the first-task weight prefetch are exercised; greedy
    (M = 1) or teacher-forced (M = 3) steps stay bit-identical to the graph path."""
    from assembler.isa import local_reduce as is_local
    rng = np.random.default_rng(7 * sms + m)
    a, b, mk = _pair(weights, m, num_sms=sms)
    loc = [i for l in mk.program.sm_lists for i in l if is_local(i)]
    assert loc and max((i.row_end - i.row_start) // 16 for i in loc) > 16 // max(i.nsplit for i in loc), \
        "no local-reduce instruction with more than one round"
    for s in (a, b):
        s.reset(0, [4321] * m)
    a.capture()
    for k in range(min(STEPS, 16)):
        t = _tokens(rng, m) if m > 1 else None
        a.replay(t)
        mk.step(t)
        _done(mk)
        bad = first_mismatch(a, b, mk, m)
        assert bad is None, f"sms={sms} m={m} step {k}: {bad}"


def test_argmax_key_slots(gpu, weights):
    """isa.py ARGMAX_KEYS: a slot left by an earlier step is ignored (a huge key planted with the previous step's
    number changes nothing), and a head instruction merges its key into a slot already written in the same step (a
    huge key planted with the coming step's number wins the ARGMAX) — the two paths the 132-SM program, where every SM
    runs one head instruction, never takes on its own."""
    a, b, mk = _pair(weights, 1)
    for s in (a, b):
        s.reset(0, [1234])
    a.capture()
    planted = 12345
    key = (0xFF00 << 32) | (0xFFFFFFFF - planted)  # bf16 0x7F00 (≈ 1.7e38): above any logit of the model

    def plant(step):
        mk.d_keys[5] = cp.asarray(np.array([key, step], np.uint64))
        cp.cuda.Device().synchronize()

    a.replay()
    mk.step()
    _done(mk)
    assert first_mismatch(a, b, mk, 1) is None
    plant(mk.steps_done)  # the step just run: stale for the next one
    a.replay()
    mk.step()
    _done(mk)
    assert first_mismatch(a, b, mk, 1) is None, "a stale key slot changed the ARGMAX"
    plant(mk.steps_done + 1)  # the coming step: merged with SM 5's own key, and the biggest of all
    mk.step()
    _done(mk)
    assert int(b.head_bufs["ids"][:1].get()[0]) == planted, "a key already in the slot this step was dropped"


def test_one_launch_many_steps(gpu, weights):
    """run_steps(n): n greedy steps inside one launch equal n graph replays (state, KV, last step's buffers)."""
    a, b, mk = _pair(weights, 1)
    for s in (a, b):
        s.reset(0, [77])
    a.capture()
    mk.step()          # a first launch, so the second one starts from a nonzero step base
    a.replay()
    mk.run_steps(31)
    for _ in range(31):
        a.replay()
    _done(mk)
    assert first_mismatch(a, b, mk, 1) is None
    assert a.read_token() == b.read_token()


def test_persistent_loop(gpu, weights):
    """The resident grid runs one step per host release and publishes each token through mapped memory."""
    a, b, mk = _pair(weights, 1)
    for s in (a, b):
        s.reset(0, [4321])
    a.capture()
    want = []
    for _ in range(16):  # first: the resident grid holds every SM's registers, so nothing else runs meanwhile
        a.replay()
        want.append(a.read_token())
    mk.start_persistent()
    got = []
    try:
        for k in range(16):
            mk.release(1)
            got.append(mk.wait_token(timeout_s=20))
    except TimeoutError as e:  # the resident grid is stuck and holds every SM: nothing else can run
        print(f"FATAL: {e}; {mk.diagnose()}", flush=True)
        os._exit(3)
    mk.stop_persistent()
    assert got == want
    assert first_mismatch(a, b, mk, 1) is None


def test_nop_program_runs_and_bumps_every_counter(gpu, weights):
    """Every opcode replaced by NOP (waits and bumps kept): the dependency machinery alone completes, and every
    counter reaches steps × expected (so no instruction was skipped)."""
    from discrete.step import DecodeStep
    from megakernel.runner import Megakernel
    b = DecodeStep(weights.cfg, weights, 64, 1)
    mk = Megakernel(b, nop=True)
    mk.run_steps(5)
    _done(mk)
    cv = mk.counter_values()
    assert np.array_equal(cv, 5 * np.array([c.expected for c in mk.program.counters]))


def test_layer_limit_and_stop_after(gpu, weights):
    """layer_limit=2: layers 0-1 bit-identical to the discrete step; stop_after=embed stage: only x.0 written."""
    a, b, mk = _pair(weights, 1, layer_limit=2)
    for s in (a, b):
        s.reset(0, [555])
    a.run_eager()
    mk.step()
    _done(mk)
    for name in ("x.0", "x.0.mid", "x.1", "x.1.mid", "x.2", "o.0", "act.1"):
        assert np.array_equal(a.buf[name][:1].get(), b.buf[name][:1].get()), name
    a, b, mk = _pair(weights, 1, stop_after=1)
    for s in (a, b):
        s.reset(0, [555])
    a.run_eager()
    mk.step()
    _done(mk)
    assert np.array_equal(a.buf["x.0"][:1].get(), b.buf["x.0"][:1].get())
    assert np.all(b.buf["x.0.mid"][:1].get() == 0x7FC1), "instructions past the stop ran"


def _victim(prog):
    """(sm, index, wait k, producer op) of the first L1.in GEMV instruction with a wait on another op, on an SM
    that runs none of the producer's instructions itself (so program order cannot stand in for the wait)."""
    oi = prog.graph.ops.index(prog.graph.op("L1.in"))
    for s, lst in enumerate(prog.sm_lists):
        for j, ins in enumerate(lst):
            if ins.op == oi and ins.opcode == Opcode.GEMV:
                for k, (c, e, o) in enumerate(ins.waits):
                    p = prog.counters[c].op
                    if p != oi and all(x.op != p for x in lst):
                        return s, j, k, p
    raise AssertionError("no L1.in instruction with a wait found")


def test_removed_dependency_is_detected(gpu, weights):
    """Delay the producer op (2 ms per instruction) and drop one wait of a consumer: the consumer reads
    NaN-poisoned input, so the step differs from the discrete path. Control: same delay, wait kept → identical."""
    from megakernel.runner import build_program
    prog = build_program(weights.cfg, 1, cp.cuda.Device().attributes["MultiProcessorCount"])
    s, j, k, producer = _victim(prog)
    for drop, expect_equal in ((None, True), ((s, j, k), False)):
        a, b, mk = _pair(weights, 1, drop_wait=drop, delay_op=producer, delay_ns=2_000_000)
        for st in (a, b):
            st.reset(0, [999])
        a.run_eager()
        mk.step()
        _done(mk)
        bad = first_mismatch(a, b, mk, 1)
        assert (bad is None) == expect_equal, f"drop={drop}: {bad}"
