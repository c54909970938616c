"""CPU VM vs the NumPy reference model, bit for bit (uint16 patterns for bf16, exact fp32 state), on the tiny
synthetic checkpoint: decode steps and an M = 3 verify step for several SM counts, round-robin and seeded
random interleavings; MTP draft step; negative controls: a removed wait is caught by poisoned buffers, the
wait assertion fires when the VM is forced to run an instruction early, and a deadlock is reported."""
import dataclasses

import numpy as np
import pytest

from assembler.graph import mtp_graph, verify_graph
from assembler.isa import Opcode
from assembler.isa import local_reduce as local_reduce_flag
from assembler.pyvm import VM, VMError
from assembler.ref.model import ReferenceModel
from assembler.scheduler import schedule

PREFILL = 12
CACHE: dict = {}


@pytest.fixture(scope="module")
def ref(tiny_ckpt):
    from loader.checkpoint import Checkpoint
    w = Checkpoint.open(tiny_ckpt)
    return w, ReferenceModel(w)


@pytest.fixture(scope="module")
def expected(ref):
    """Reference results: prefill, two decode steps, one M=3 verify step, one MTP draft (fresh random ids; the seed
    is in every failure message of run_sequence, and QMK_VM_TEST_SEED replays it)."""
    import os
    w, model = ref
    data_seed = int(os.environ.get("QMK_VM_TEST_SEED") or np.random.default_rng().integers(0, 1 << 31))
    rng = np.random.default_rng(data_seed)
    st = model.new_state(PREFILL + 8)
    model.prefill(st, rng.integers(0, 248000, PREFILL), logit_rows=[PREFILL - 1])
    start = st.copy()
    steps = [[int(rng.integers(0, 248000))], [int(rng.integers(0, 248000))], rng.integers(0, 248000, 3).tolist()]
    out = []
    for ids in steps:
        out.append((ids, model.decode(st, ids), st.copy()))
    hid = st.hidden[-1:].copy()
    mtp_ids = [int(rng.integers(0, 248000))]
    mtp_logits, hn = model.mtp_draft(st, mtp_ids, hid)
    return {"start": start, "steps": out, "mtp": (mtp_ids, hid, mtp_logits, hn, st.copy()), "seed": data_seed}


def same_state(a, b, cfg):
    for i in cfg.linear_layers:
        assert np.array_equal(a.rec[i].view(np.uint32), b.rec[i].view(np.uint32)), f"recurrent state layer {i}"
        assert np.array_equal(a.conv[i].view(np.uint16), b.conv[i].view(np.uint16)), f"conv state layer {i}"
    for i in cfg.full_layers:
        n = a.pos
        assert np.array_equal(a.k[i][:n].view(np.uint16), b.k[i][:n].view(np.uint16)), f"K cache layer {i}"
        assert np.array_equal(a.v[i][:n].view(np.uint16), b.v[i][:n].view(np.uint16)), f"V cache layer {i}"
    assert a.pos == b.pos


def run_sequence(w, exp, sms, orders, fuse_reduce=True, defer_reduce=False, local_reduce=True, mlp_groups=False,
                 gdn_split=1):
    """The three reference steps through VMs of the given program form; ``gdn_split`` > 1: GDN steps split over
    value heads as the megakernel runner runs them (megakernel.runner.split_gdn)."""
    from megakernel.runner import split_gdn
    cfg = w.config

    def prog(m):
        p = schedule(verify_graph(cfg, m, defer_reduce=defer_reduce, mlp_groups=mlp_groups), sms,
                     fuse_reduce=fuse_reduce, local_reduce=local_reduce)
        return split_gdn(p, gdn_split) if gdn_split > 1 else p

    st = exp["start"].copy()
    vms = {m: VM(prog(m), w, CACHE) for m in (1, 3)}
    if local_reduce and sms > 1:  # the in-projections reduce on their own instructions (isa.py LOCAL_REDUCE)
        assert any(local_reduce_flag(i) for v in vms.values() for l in v.p.sm_lists for i in l)
    for k, ((ids, logits, st_ref), (order, seed)) in enumerate(zip(exp["steps"], orders)):
        where = f"step {k}, sms={sms}, order {order} seed {seed}, QMK_VM_TEST_SEED={exp['seed']}"
        try:
            got, nxt = vms[len(ids)].run_step(st, ids, order=order, seed=seed)
            assert np.array_equal(got.view(np.uint16), logits.view(np.uint16)), "logits differ"
            assert nxt.tolist() == np.argmax(logits.astype(np.float32), -1).tolist(), "next ids differ"
            same_state(st, st_ref, cfg)
            assert np.array_equal(st.hidden.view(np.uint16), st_ref.hidden.view(np.uint16)), "final-normed hidden"
        except (AssertionError, VMError) as e:
            raise AssertionError(f"{e} ({where})") from e


@pytest.mark.parametrize("sms", [1, 7, 132])
def test_vm_equals_reference(ref, expected, sms):
    seeds = np.random.default_rng().integers(0, 1 << 30, 2).tolist()
    run_sequence(ref[0], expected, sms, [("rr", 0), ("random", seeds[0]), ("random", seeds[1])])


def test_vm_verify_step_round_robin(ref, expected):
    run_sequence(ref[0], expected, 5, [("rr", 0)] * 3)


def test_vm_reduce_instr_program(ref, expected):
    """fuse_reduce=False (GEMV_REDUCE instructions) stays bit-identical too; the default program fuses the reduce
    into the GEMV instructions (the VM reduces each tile inside its last-arriving split, whichever that is)."""
    seed = int(np.random.default_rng().integers(0, 1 << 30))
    run_sequence(ref[0], expected, 7, [("rr", 0), ("random", seed), ("random", seed + 1)], fuse_reduce=False)


@pytest.mark.parametrize("sms", [1, 7, 132])
@pytest.mark.parametrize("fuse_reduce", [False, True])
def test_vm_deferred_reduce(ref, expected, sms, fuse_reduce):
    """Residual split-K reduces deferred to the consumers' prologues (graph.defer_reduces, isa.py reduce_rmsnorm)
    stay bit-identical to the reference, M = 1 and 3, in order and in random interleavings."""
    seed = int(np.random.default_rng().integers(0, 1 << 30))
    run_sequence(ref[0], expected, sms, [("rr", 0), ("random", seed), ("random", seed + 1)], fuse_reduce=fuse_reduce,
                 defer_reduce=True)


@pytest.mark.parametrize("sms", [7, 132])
@pytest.mark.parametrize("defer_reduce", [False, True])
def test_vm_local_reduce_off(ref, expected, sms, defer_reduce):
    """The split-K in-projections as GEMV partials + GEMV_REDUCE stages (local_reduce=False) and, in every other
    test here, reduced on their own instructions (the default): both bit-identical to the reference."""
    seed = int(np.random.default_rng().integers(0, 1 << 30))
    run_sequence(ref[0], expected, sms, [("rr", 0), ("random", seed), ("random", seed + 1)], fuse_reduce=False,
                 defer_reduce=defer_reduce, local_reduce=False)


@pytest.mark.parametrize("sms", [7, 132])
@pytest.mark.parametrize("defer_reduce", [False, True])
def test_vm_mlp_groups(ref, expected, sms, defer_reduce):
    """gate|up grouped per down split (graph mlp_groups: down split j waits only on its group, asm_regions' split
    read region) stays bit-identical to the reference, M = 1 and 3, in order and in random interleavings."""
    seed = int(np.random.default_rng().integers(0, 1 << 30))
    run_sequence(ref[0], expected, sms, [("rr", 0), ("random", seed), ("random", seed + 1)], fuse_reduce=False,
                 defer_reduce=defer_reduce, mlp_groups=True)


@pytest.mark.parametrize("sms,mlp_groups,fuse", [(1, False, True), (7, False, True), (132, False, False),
                                                 (7, True, False), (13, True, True)])
def test_vm_split_gdn(ref, expected, sms, mlp_groups, fuse):
    """The runner's GDN steps per value head (split_gdn: parts on other SMs, each writing its value heads' state
    and its key heads' conv channels, reading the others' conv history) stay bit-identical to the reference, in
    order and in random interleavings; with mlp_groups they exercise the scheduler's GDN waits."""
    seed = int(np.random.default_rng().integers(0, 1 << 30))
    run_sequence(ref[0], expected, sms, [("rr", 0), ("random", seed), ("random", seed + 1)], fuse_reduce=fuse,
                 defer_reduce=True, mlp_groups=mlp_groups, gdn_split=ref[0].config.gdn_head_group)


def test_vm_split_gdn_missing_wait_shows(ref, expected):
    """Negative control: the split program with one out projection's GDN wait removed gives wrong results in some
    interleaving (a part of the GDN step it reads has not run yet: NaN poison or stale rows)."""
    from megakernel.runner import split_gdn
    w = ref[0]
    cfg = w.config
    p = split_gdn(schedule(verify_graph(cfg, 1, defer_reduce=True, mlp_groups=True), 7, fuse_reduce=False),
                  cfg.gdn_head_group)
    name = {i: c.name for i, c in enumerate(p.counters)}
    L = cfg.linear_layers[0]
    oi = p.graph.ops.index(p.graph.op(f"L{L}.out"))
    s, j = next((s, j) for s, l in enumerate(p.sm_lists) for j, i in enumerate(l)
                if i.op == oi and i.opcode == Opcode.GEMV)
    ins = p.sm_lists[s][j]
    k = next(k for k, (c, _, _) in enumerate(ins.waits) if name[c] == f"L{L}.gdn.out0")
    p.sm_lists[s][j] = dataclasses.replace(ins, waits=ins.waits[:k] + ins.waits[k + 1:], nwaits=ins.nwaits - 1)
    ids, logits, _ = expected["steps"][0]
    bad = 0
    for seed in range(40):  # an interleaving where the reader runs before a part it needs
        st = expected["start"].copy()
        try:
            got, _ = VM(p, w, CACHE).run_step(st, ids, order="random", seed=seed)
        except (VMError, ValueError):  # ValueError: NaN poison reached the argmax
            bad += 1
            continue
        bad += not np.array_equal(got.view(np.uint16), logits.view(np.uint16))
    assert bad > 0


@pytest.mark.slow
@pytest.mark.parametrize("sms", [1, 7, 132])
def test_vm_many_random_interleavings(ref, expected, sms):
    for seed in np.random.default_rng().integers(0, 1 << 30, 50).tolist():
        run_sequence(ref[0], expected, sms, [("random", seed)] * 3)


def test_vm_mtp_step(ref, expected):
    w = ref[0]
    ids, hid, logits, hn, st_ref = expected["mtp"]
    st = expected["steps"][-1][2].copy()
    vm = VM(schedule(mtp_graph(w.config, 1), 7), w, CACHE)
    got, _ = vm.run_step(st, ids, hidden=hid, order="random", seed=3)
    assert np.array_equal(got.view(np.uint16), logits.view(np.uint16))
    assert np.array_equal(vm.hidden.view(np.uint16), hn.view(np.uint16))  # MTP-normed hidden for the next draft
    n = st.mtp_pos
    assert n == st_ref.mtp_pos and np.array_equal(st.mtp_k[:n].view(np.uint16), st_ref.mtp_k[:n].view(np.uint16))


def _prog_without_a_wait(cfg):
    p = schedule(verify_graph(cfg, 1), 7)
    s, j = next((s, j) for s, l in enumerate(p.sm_lists) for j, i in enumerate(l)
                if i.opcode == Opcode.GEMV and p.graph.ops[i.op].name == "L1.in" and i.nwaits)
    ins = p.sm_lists[s][j]
    p.sm_lists[s][j] = dataclasses.replace(ins, waits=ins.waits[1:], nwaits=ins.nwaits - 1)
    return p


def test_removed_wait_is_caught_by_poison(ref, expected):
    w = ref[0]
    ids, logits, _ = expected["steps"][0]
    caught = 0
    for seed in range(6):
        st = expected["start"].copy()
        try:
            got, _ = VM(_prog_without_a_wait(w.config), w, CACHE).run_step(st, ids, order="random", seed=seed)
            caught += not np.array_equal(got.view(np.uint16), logits.view(np.uint16))
        except ValueError:  # NaN logits reach the argmax
            caught += 1
    print(f"removed wait caught in {caught} of 6 interleavings")
    assert caught >= 3
    vm = VM(schedule(verify_graph(w.config, 1), 7), w, CACHE)
    got, _ = vm.run_step(expected["start"].copy(), ids, order="random", seed=0)
    assert np.array_equal(got.view(np.uint16), logits.view(np.uint16))  # the intact program, same seeds, passes


def test_wait_assertion_and_deadlock(ref, expected, monkeypatch):
    w = ref[0]
    ids = expected["steps"][0][0]
    vm = VM(schedule(verify_graph(w.config, 1, layer_limit=1), 3), w, CACHE)
    monkeypatch.setattr(vm, "_ready", lambda ins: True)
    with pytest.raises(VMError, match="started before"):
        vm.run_step(expected["start"].copy(), ids)
    p = schedule(verify_graph(w.config, 1, layer_limit=1), 3)
    am = next(i for i, c in enumerate(p.counters) if p.graph.ops[c.op].kind == "argmax")
    s, j = next((s, j) for s, l in enumerate(p.sm_lists) for j, i in enumerate(l) if i.opcode == Opcode.GEMV)
    ins = p.sm_lists[s][j]
    p.sm_lists[s][j] = dataclasses.replace(ins, waits=ins.waits + ((am, 1, 0),), nwaits=ins.nwaits + 1)
    with pytest.raises(VMError, match="deadlock"):
        VM(p, w, CACHE).run_step(expected["start"].copy(), ids)
