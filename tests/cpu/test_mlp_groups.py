"""gate|up grouped per down split (graph ``mlp_groups``): the groups, the split-K read regions, the
down's narrowed waits, the scheduler's ready-time cut, and the verifier on the programs. Bit identity through
the CPU VM is in test_pyvm.py (test_vm_mlp_groups)."""
import dataclasses

import numpy as np
import pytest

from assembler.asm_regions import regions
from assembler.graph import decode_graph, mlp_group_rows, mtp_graph, verify_graph
from assembler.isa import Opcode, sub_parts
from assembler.numerics import split_k
from assembler.scheduler import _apportion, schedule
from assembler.verify import VerifyError, verify
from loader.config import preset


def _ins(p, name):
    """(sm, index, instruction) of the op's GEMV instructions (not its GEMV_REDUCE stage)."""
    oi = p.graph.ops.index(p.graph.op(name))
    return [(s, j, i) for s, l in enumerate(p.sm_lists) for j, i in enumerate(l)
            if i.op == oi and i.opcode == Opcode.GEMV]


@pytest.mark.parametrize("name", ["tiny", "qwen3.5-27b"])
def test_groups_follow_the_down_split(name):
    cfg = preset(name)
    S = split_k(cfg.hidden_size, cfg.intermediate_size)
    rows = mlp_group_rows(cfg)
    assert len(rows) == S and rows[0][0] == 0 and rows[-1][1] == cfg.intermediate_size
    assert all(a[1] == b[0] and (a[1] - a[0]) % 16 == 0 for a, b in zip(rows, rows[1:]))
    g = decode_graph(cfg, layer_limit=1, mlp_groups=True)
    assert g.op("L0.gateup").groups == tuple(((0, a, b),) for a, b in rows)
    assert g.op("L0.down").segments[0].split == S
    # control: the default graph keeps one group
    assert len(decode_graph(cfg, layer_limit=1).op("L0.gateup").groups) == 1


def test_split_k_gemv_reads_only_its_columns():
    """A split-K GEMV without a prologue reads its split's K columns (megakernel.cu mk_gemv: K-blocks
    [s·per, (s+1)·per) of weight and input); one with a norm prologue reads the whole row (the norm needs it)."""
    cfg = preset("tiny")
    p = schedule(decode_graph(cfg, layer_limit=1, defer_reduce=False, mlp_groups=True), 7, fuse_reduce=False)
    assert p.graph.split_reads
    K = cfg.intermediate_size
    S = split_k(cfg.hidden_size, K)
    act = p.buffer_id["act.0"]
    seen = set()
    for _, _, ins in _ins(p, "L0.down"):
        reads = [r for r in regions(p, ins)[0] if r[0] == act]
        assert reads == [(act, ins.split * K // S, (ins.split + 1) * K // S)], ins
        seen.add(ins.split)
    assert seen == set(range(S))
    for _, _, ins in _ins(p, "L0.gateup"):  # rmsnorm / reduce_rmsnorm prologue: the whole input row
        assert sub_parts(ins.sub)[0] != "none"
        x = p.buffer_id["x.0.mid"]
        assert (x, 0, cfg.hidden_size) in regions(p, ins)[0]
    # without split_reads (the default graph) the whole row: a superset, the programs the H200 ran
    q = schedule(decode_graph(cfg, layer_limit=1, defer_reduce=False), 7, fuse_reduce=False)
    assert not q.graph.split_reads
    assert all((act, 0, K) in regions(q, i)[0] for _, _, i in _ins(q, "L0.down"))


@pytest.mark.parametrize("sms", [7, 132])
def test_down_split_waits_only_on_its_group(sms):
    cfg = preset("tiny")
    p = schedule(decode_graph(cfg, layer_limit=2, mlp_groups=True), sms, fuse_reduce=False)
    name = {i: c.name for i, c in enumerate(p.counters)}
    for L in (0, 1):
        for _, _, ins in _ins(p, f"L{L}.down"):
            gu = [name[c] for c, _, _ in ins.waits if name[c].startswith(f"L{L}.gateup.")]
            assert set(gu) <= {f"L{L}.gateup.out{ins.split}"}, (ins, gu)
    # control: with one group every down instruction on another SM than its writers waits on out0
    q = schedule(decode_graph(cfg, layer_limit=2), sms, fuse_reduce=False)
    name = {i: c.name for i, c in enumerate(q.counters)}
    assert all(name[c] == "L0.gateup.out0" for _, _, i in _ins(q, "L0.down") for c, _, _ in i.waits
               if name[c].startswith("L0.gateup."))


def test_ready_time_apportion():
    """Runs whose input is complete later get more SMs; with equal ready times the plain minimax."""
    assert _apportion([10.0, 10.0], [8, 8], 4, [0.0, 10.0]) == [1, 3]
    assert _apportion([10.0, 10.0], [8, 8], 4) == _apportion([10.0, 10.0], [8, 8], 4, [3.0, 3.0]) == [2, 2]


def test_ready_cut_on_the_27b():
    """132 SMs: 1,088 gate|up tile pairs in 8 groups — 4 of 17 SMs × 8 pairs, 4 of 16 SMs with 9-pair chunks;
    the down splits of those 4 groups get more SMs than the others, and the cut still covers every row."""
    cfg = preset("qwen3.5-27b")
    p = schedule(decode_graph(cfg, layer_limit=1, mlp_groups=True), 132, fuse_reduce=False)
    span = {}
    for _, _, ins in _ins(p, "L0.gateup"):
        g = next(k for k, (a, b) in enumerate(mlp_group_rows(cfg)) if a <= ins.row_start < b)
        span[g] = max(span.get(g, 0), (ins.row_end - ins.row_start) // 16)
    late = {g for g, t in span.items() if t == max(span.values())}
    assert 0 < len(late) < len(span)
    n = {}
    for _, _, ins in _ins(p, "L0.down"):
        n[ins.split] = n.get(ins.split, 0) + 1
    assert sum(n.values()) == 132
    assert min(n[s] for s in late) > max(n[s] for s in n if s not in late), (n, late)
    q = schedule(decode_graph(cfg, layer_limit=1), 132, fuse_reduce=False)
    assert p.stats()["est_step_ms"] < q.stats()["est_step_ms"]


@pytest.mark.parametrize("sms,m,fuse", [(7, 1, False), (132, 1, True), (5, 3, False)])
def test_mlp_group_programs_verify(sms, m, fuse):
    from megakernel.runner import split_gdn
    cfg = preset("tiny")
    for defer in (False, True):
        p = schedule(verify_graph(cfg, m, defer_reduce=defer, mlp_groups=True), sms, fuse_reduce=fuse)
        verify(p)
        verify(split_gdn(p, cfg.gdn_head_group))
    verify(schedule(mtp_graph(cfg, 1, defer_reduce=True, mlp_groups=True), 6))


@pytest.mark.parametrize("sms", [7, 13, 132])
def test_gdn_output_reads_wait_for_split_parts(sms):
    """With split_reads an out projection's split may read only columns of o that a GDN step on its own SM wrote;
    program order would cover that, but the runner's split_gdn moves that step's other value-head parts to other
    SMs, so the scheduler still waits on the GDN counter: the split program verifies, and it would not without
    that wait (dropping it is caught)."""
    from megakernel.runner import split_gdn
    cfg = preset("tiny")
    p = schedule(decode_graph(cfg, mlp_groups=True), sms, fuse_reduce=False)
    q = split_gdn(p, cfg.gdn_head_group)
    verify(q)
    name = {i: c.name for i, c in enumerate(q.counters)}
    for L in cfg.linear_layers:
        for s, j, ins in _ins(q, f"L{L}.out"):
            w = [k for k, (c, _, _) in enumerate(ins.waits) if name[c] == f"L{L}.gdn.out0"]
            assert len(w) == 1, (ins, [name[c] for c, _, _ in ins.waits])
    s, j, ins = _ins(q, f"L{cfg.linear_layers[0]}.out")[0]
    k = next(k for k, (c, _, _) in enumerate(ins.waits) if name[c].endswith(".gdn.out0"))
    q.sm_lists[s][j] = dataclasses.replace(ins, waits=ins.waits[:k] + ins.waits[k + 1:], nwaits=ins.nwaits - 1)
    with pytest.raises(VerifyError):
        verify(q)


def test_dropped_group_wait_is_caught():
    """Every down instruction's wait on its gate|up group is needed: dropping it fails the verifier."""
    cfg = preset("tiny")
    p = schedule(decode_graph(cfg, layer_limit=2, mlp_groups=True), 7, fuse_reduce=False)
    name = {i: c.name for i, c in enumerate(p.counters)}
    hits = 0
    for s, j, ins in _ins(p, "L1.down"):
        for w, (c, _, _) in enumerate(ins.waits):
            if not name[c].startswith("L1.gateup."):
                continue
            p.sm_lists[s][j] = dataclasses.replace(ins, waits=ins.waits[:w] + ins.waits[w + 1:],
                                                   nwaits=ins.nwaits - 1)
            with pytest.raises(VerifyError):
                verify(p)
            p.sm_lists[s][j] = ins
            hits += 1
    assert hits
    verify(p)


def test_group_rows_none_without_split():
    cfg = dataclasses.replace(preset("tiny"), intermediate_size=128)  # one K-block: the down is not split-K
    assert split_k(cfg.hidden_size, 128) == 1 and mlp_group_rows(cfg) is None
    g = decode_graph(cfg, layer_limit=1, mlp_groups=True)
    assert len(g.op("L0.gateup").groups) == 1
    assert not np.isnan(schedule(g, 7).stats()["est_step_ms"])


def test_inspect_mlp_groups():
    """``qwen-mk inspect --mlp-groups``: the grouped program (more counters: one per gate|up group), verified with
    --verify and --gdn-split; --timings refuses it (it runs the megakernel's default program)."""
    import json
    from click.testing import CliRunner
    from host.cli import main
    out = {}
    for flag in ("--no-mlp-groups", "--mlp-groups"):
        r = CliRunner().invoke(main, ["inspect", "--preset", "tiny", "--sms", "7", "--format", "json", "--verify",
                                      "--gdn-split", "3", flag])
        assert r.exit_code == 0, r.output
        out[flag] = json.loads(r.output)
    S = split_k(preset("tiny").hidden_size, preset("tiny").intermediate_size)
    groups = {f: {c["group"] for c in d["counters"] if c["name"].startswith("L0.gateup.")} for f, d in out.items()}
    assert groups == {"--no-mlp-groups": {0}, "--mlp-groups": set(range(S))}
    st = out["--mlp-groups"]["stats"]
    assert st["verified"]["instructions"] == st["instructions"]
    r = CliRunner().invoke(main, ["inspect", "--timings", "--mlp-groups"])
    assert r.exit_code == 2 and "--mlp-groups" in r.output, r.output
