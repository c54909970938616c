"""assembler.options.PROGRAM is the one program form: the scheduler, the CPU VM executor, the megakernel runner
and ``qwen-mk inspect`` build the same program from it."""
import dataclasses
import types

import numpy as np
import pytest

from assembler.options import PROGRAM, ProgramOptions
from assembler.scheduler import assemble, schedule
from assembler.graph import decode_graph
from loader.config import preset
from megakernel import runner


def test_runner_defaults_are_the_program_options():
    assert (runner.DEFAULT_FUSE, runner.DEFAULT_DEFER, runner.DEFAULT_LOCAL) == \
        (PROGRAM.fuse_reduce, PROGRAM.defer_reduce, PROGRAM.local_reduce)


def test_for_rows_defers_only_one_row_programs():
    assert PROGRAM.for_rows(1).defer_reduce is PROGRAM.defer_reduce
    assert all(PROGRAM.for_rows(m).defer_reduce is False for m in range(2, 9))
    assert PROGRAM.gdn_parts(preset("tiny")) == preset("tiny").gdn_head_group
    assert ProgramOptions(gdn_split=2).gdn_parts(preset("tiny")) == 2
    with pytest.raises(ValueError, match="gdn_split"):
        ProgramOptions(gdn_split=0)


@pytest.mark.parametrize("m", [1, 3])
def test_scheduler_and_runner_build_the_same_program(m):
    cfg = preset("tiny")
    a = assemble(cfg, m, 7)
    b = runner.build_program(cfg, m, 7)
    assert np.array_equal(a.words(), b.words())
    if m == 1:  # the bare scheduler on the bare decode graph: the same defaults
        assert np.array_equal(schedule(decode_graph(cfg), 7).words(), a.words())
    other = assemble(cfg, m, 7, dataclasses.replace(PROGRAM.for_rows(m), fuse_reduce=not PROGRAM.fuse_reduce))
    assert a.words().shape != other.words().shape or not np.array_equal(a.words(), other.words())  # negative control


def test_cpu_vm_executor_runs_the_gpu_program(monkeypatch):
    """The cpu-vm executor's decode program is the megakernel's default 1-row program (GDN split included)."""
    import assembler.pyvm as pyvm
    import assembler.ref.model as refmodel
    from host.executors import CpuVmExecutor

    got = {}

    class _VM:
        def __init__(self, prog, weights):
            got["prog"] = prog

        def run_step(self, *a, **k):
            pass

    class _Ref:
        def __init__(self, w):
            pass

        def new_state(self, n):
            return None

    monkeypatch.setattr(pyvm, "VM", _VM)
    monkeypatch.setattr(refmodel, "ReferenceModel", _Ref)
    cfg = preset("tiny")
    ex = CpuVmExecutor(types.SimpleNamespace(config=cfg), 64, vm_sms=4)
    gpu = runner.split_gdn(runner.build_program(cfg, 1, 4), cfg.gdn_head_group)
    assert np.array_equal(runner.program_words(got["prog"]), runner.program_words(gpu))
    assert ex.program_options == PROGRAM.for_rows(1).as_dict(cfg)
