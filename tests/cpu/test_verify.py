"""Verifier: assembled programs pass; every planted fault fails with a message naming it; removing any single
wait (a seeded sample, fresh per run) is caught."""
import dataclasses

import numpy as np
import pytest

from assembler.graph import mtp_graph, verify_graph
from assembler.isa import Opcode, fused_reduce
from assembler.scheduler import schedule
from assembler.verify import VerifyError, verify
from loader.config import preset


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "reduce_instr"])
@pytest.mark.parametrize("sms,m", [(1, 1), (7, 1), (7, 8), (132, 1), (3, 5)])
def test_assembled_programs_verify(sms, m, fuse):
    p = schedule(verify_graph(preset("tiny"), m), sms, fuse_reduce=fuse)
    assert verify(p)["instructions"] == sum(len(l) for l in p.sm_lists)


def test_mtp_program_verifies():
    verify(schedule(mtp_graph(preset("tiny"), 2), 6))


def _drop_wait(p, s, j, w):
    ins = p.sm_lists[s][j]
    p.sm_lists[s][j] = dataclasses.replace(ins, waits=ins.waits[:w] + ins.waits[w + 1:], nwaits=ins.nwaits - 1)
    return ins


@pytest.mark.parametrize("sms,m,sample,fuse", [(7, 2, 40, True), (132, 1, 12, True), (7, 2, 20, False)])
def test_every_removed_wait_is_caught(sms, m, sample, fuse):
    p = schedule(verify_graph(preset("tiny"), m), sms, fuse_reduce=fuse)
    allw = [(s, j, w) for s, l in enumerate(p.sm_lists) for j, i in enumerate(l) for w in range(i.nwaits)]
    rng = np.random.default_rng()
    pick = [allw[i] for i in rng.choice(len(allw), size=min(sample, len(allw)), replace=False)]
    pick += [x for x in allw if p.sm_lists[x[0]][x[1]].opcode == Opcode.EMBED]  # the step edge, always
    for s, j, w in pick:
        orig = _drop_wait(p, s, j, w)
        with pytest.raises(VerifyError):
            verify(p)
        p.sm_lists[s][j] = orig
    verify(p)  # restored program passes again


@pytest.fixture(params=[True, False], ids=["fused", "reduce_instr"])
def small(request):
    return schedule(verify_graph(preset("tiny"), 1, layer_limit=2), 4, fuse_reduce=request.param)


def _first(p, opcode):
    return next((s, j) for s, l in enumerate(p.sm_lists) for j, i in enumerate(l) if i.opcode == opcode and i.nwaits)


def test_overlapping_writes_caught(small):
    s, j = next((s, j) for s, l in enumerate(small.sm_lists) for j, i in enumerate(l)  # output writers
                if (i.opcode == Opcode.GEMV_REDUCE or fused_reduce(i)) and i.row_start > 0)
    ins = small.sm_lists[s][j]
    small.sm_lists[s][j] = dataclasses.replace(ins, row_start=ins.row_start - 16)
    with pytest.raises(VerifyError, match="both write"):
        verify(small)


def _fused_program():
    return schedule(verify_graph(preset("tiny"), 1, layer_limit=2, defer_reduce=False), 7, fuse_reduce=True)


def test_fused_reduce_joint_write_rules():
    """The S split instructions of a fused segment jointly write its outputs: one more writer of the same rows
    and split, or a split that leaves rows uncovered, is caught."""
    p = _fused_program()
    s, j = next((s, j) for s, l in enumerate(p.sm_lists) for j, i in enumerate(l) if fused_reduce(i))
    ins = p.sm_lists[s][j]
    p.sm_lists[s][j] = dataclasses.replace(ins, split=(ins.split + 1) % ins.nsplit)  # two writers of one split
    with pytest.raises(VerifyError, match="both write"):
        verify(p)
    p.sm_lists[s][j] = ins
    verify(p)
    p.sm_lists[s][j] = dataclasses.replace(ins, row_end=ins.row_end - 16) if ins.row_end - ins.row_start > 16 else \
        dataclasses.replace(ins, row_start=ins.row_start + 16, row_end=ins.row_end + 16)
    with pytest.raises(VerifyError):
        verify(p)


def test_fused_reduce_consumer_wait_removed_is_caught():
    """Every wait on a fused op's GEMV counter is needed: dropping any one of them leaves a read of the tile
    outputs (written by whichever split arrives last) unordered."""
    p = _fused_program()
    ctr = {i.bump for l in p.sm_lists for i in l if fused_reduce(i)}
    hits = [(s, j, w) for s, l in enumerate(p.sm_lists) for j, i in enumerate(l) for w, (c, _, _) in enumerate(i.waits)
            if c in ctr]
    assert hits
    for s, j, w in hits:
        orig = _drop_wait(p, s, j, w)
        with pytest.raises(VerifyError, match="before its producer"):
            verify(p)
        p.sm_lists[s][j] = orig


def test_wrong_expected_and_unreachable_caught(small):
    s, j = _first(small, Opcode.GEMV)
    ins = small.sm_lists[s][j]
    c, e, o = ins.waits[0]
    small.sm_lists[s][j] = dataclasses.replace(ins, waits=((c, e + 1, o),) + ins.waits[1:])
    with pytest.raises(VerifyError, match="bumped"):
        verify(small)
    small.sm_lists[s][j] = dataclasses.replace(ins, waits=((len(small.counters) + 3, 1, 0),) + ins.waits[1:])
    with pytest.raises(VerifyError, match="unreachable"):
        verify(small)


def test_deadlock_caught(small):
    am = next(i for i, c in enumerate(small.counters) if small.graph.ops[c.op].kind == "argmax")
    s, j = _first(small, Opcode.GEMV)  # a GEMV that waits for this step's argmax can never run
    ins = small.sm_lists[s][j]
    small.sm_lists[s][j] = dataclasses.replace(ins, waits=ins.waits + ((am, small.counters[am].expected, 0),),
                                               nwaits=ins.nwaits + 1)
    with pytest.raises(VerifyError, match="deadlock"):
        verify(small)


@pytest.mark.parametrize("name,sms,m,limit", [("tiny", 7, 1, None), ("tiny", 132, 3, None), ("qwen3.5-27b", 132, 1, 8)])
def test_attention_scratch_reuse_is_ordered(name, sms, m, limit):
    """The device keeps ONE copy of the attention scratch (roped q, scores, stats, partials) for all layers,
    while the graph names it per layer: every attention instruction must be known to start after every
    attention instruction of the previous attention layer (and, across the step edge, of the last one)."""
    from assembler.isa import ATTN_OPCODES
    from assembler.verify import _clocks
    p = schedule(verify_graph(preset(name), m, limit), sms)
    clk = _clocks(p, 2)
    vc, L = clk["vc"], clk["L"]
    by_layer: dict = {}
    for s, lst in enumerate(p.sm_lists):
        for j, ins in enumerate(lst):
            if ins.opcode in ATTN_OPCODES:
                by_layer.setdefault(ins.layer, []).append((s, j))
    layers = sorted(by_layer)
    assert len(layers) >= 2
    pairs = [(0, a, 0, b) for a, b in zip(layers, layers[1:])] + [(0, layers[-1], 1, layers[0])]
    for ka, a, kb, b in pairs:
        for s, j in by_layer[b]:
            for ps, pj in by_layer[a]:
                assert vc[(kb, s, j)][ps] > ka * L[ps] + pj, (a, b, (s, j), (ps, pj))


@pytest.mark.parametrize("sms,m,fuse", [(7, 1, False), (132, 1, False), (5, 3, True)])
def test_split_gdn_programs_verify(sms, m, fuse):
    """The runner's default programs split each GDN step over its value heads (megakernel.runner.split_gdn);
    the verifier models the parts (asm_regions._gdn_part / history_reads) and accepts them. The parts of
    a key head own disjoint value heads and exactly one of them the key head's q / k conv channels; removing a
    part's wait on the in-projection is caught (the extra parts' wait on the producer of x is implied by it:
    megakernel.program._cover_waits adds it, redundant but harmless), as is removing any wait of the parts the scheduler
    placed (split 0)."""
    from assembler.asm_regions import history_reads, regions
    from megakernel.runner import split_gdn
    cfg = preset("tiny")
    whole = schedule(verify_graph(cfg, m), sms, fuse_reduce=fuse)
    for parts in range(2, cfg.gdn_head_group + 1):
        p = split_gdn(whole, parts)
        verify(p)
        gdn = [(s, j, i) for s, l in enumerate(p.sm_lists) for j, i in enumerate(l) if i.opcode == Opcode.GDN_STEP]
        by_head: dict = {}
        for s, j, i in gdn:
            by_head.setdefault((i.layer, i.row_start, i.row_end), []).append(i)
        for key, ins in by_head.items():
            assert len(ins) == parts and sorted(i.split for i in ins) == list(range(parts))
            state = sorted(r for i in ins for r in regions(p, i)[2])
            assert len(state) == len(set(state)), f"{key}: two parts own the same state"
            ref = next(i for l in whole.sm_lists for i in l if i.opcode == Opcode.GDN_STEP
                       and (i.layer, i.row_start, i.row_end) == key)
            bufs = {b for b, _, _ in state}
            for b in bufs:  # the parts' state covers the whole key head's, exactly
                got = sum(hi - lo for bb, lo, hi in state if bb == b)
                assert got == sum(hi - lo for bb, lo, hi in regions(whole, ref)[2] if bb == b), (key, b)
            assert sum(len(history_reads(p, i)) for i in ins) == 2 * (parts - 1) * (key[2] - key[1])
        for s, j, i in gdn[:8]:
            for w in range(i.nwaits):
                if i.split > 0 and not p.counters[i.waits[w][0]].name.endswith(".in.out0"):
                    continue
                orig = _drop_wait(p, s, j, w)
                with pytest.raises(VerifyError):
                    verify(p)
                p.sm_lists[s][j] = orig


def test_history_read_without_writer_caught(monkeypatch):
    """Negative control of check 7: a history read of conv channels nothing writes fails, naming them."""
    import assembler.verify as V
    from megakernel.runner import split_gdn
    p = split_gdn(schedule(verify_graph(preset("tiny"), 1), 7, fuse_reduce=False), 3)
    orig = V.history_reads

    def fake(prog, ins):
        h = orig(prog, ins)
        return [(b, lo + 10 ** 6, hi + 10 ** 6) for b, lo, hi in h]  # channels past the ring

    monkeypatch.setattr(V, "history_reads", fake)
    with pytest.raises(VerifyError, match="no instruction writes"):
        verify(p)


@pytest.mark.parametrize("sms,m,fuse", [(7, 1, False), (132, 1, False), (5, 3, True), (7, 8, False)])
def test_deferred_reduce_programs_verify(sms, m, fuse):
    """graph.defer_reduces: the out / o / down reduces rebuilt in the consumers' prologues. The decode
    / verify programs (also split over value heads, as the runner runs them) and the MTP program verify; the
    consumers' slices cover the hidden row between them; a slice left out is caught (its readers read columns
    nothing writes), and so is a dropped wait of a consumer on the deferred producer's partials."""
    from assembler.isa import sub_parts
    from megakernel.runner import split_gdn
    cfg = preset("tiny")
    p = schedule(verify_graph(cfg, m, defer_reduce=True), sms, fuse_reduce=fuse)
    verify(p)
    verify(split_gdn(p, cfg.gdn_head_group))
    verify(schedule(mtp_graph(cfg, 2, defer_reduce=True), 6))
    cons = [(s, j) for s, l in enumerate(p.sm_lists) for j, i in enumerate(l)
            if i.opcode == Opcode.GEMV and sub_parts(i.sub)[0] == "reduce_rmsnorm"]
    assert cons and not any(i.opcode == Opcode.GEMV_REDUCE and p.graph.ops[i.op].name.endswith((".out", ".down"))
                            for l in p.sm_lists for i in l)
    by_op: dict = {}
    for s, j in cons:
        i = p.sm_lists[s][j]
        by_op.setdefault(i.op, []).append((i.aux0, i.aux1))
    for op, sl in by_op.items():
        sl.sort()
        assert sl[0][0] == 0 and sl[-1][1] == cfg.hidden_size and all(a[1] == b[0] for a, b in zip(sl, sl[1:])), op
    s, j = next(x for x in cons if p.sm_lists[x[0]][x[1]].aux1 > p.sm_lists[x[0]][x[1]].aux0)
    ins = p.sm_lists[s][j]
    p.sm_lists[s][j] = dataclasses.replace(ins, aux1=ins.aux0)
    with pytest.raises(VerifyError, match="no instruction of the step writes"):
        verify(p)
    p.sm_lists[s][j] = ins
    s, j = next(x for x in cons if p.sm_lists[x[0]][x[1]].nwaits)
    _drop_wait(p, s, j, 0)
    with pytest.raises(VerifyError):
        verify(p)
