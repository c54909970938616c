"""Executors: what runs the model for the host loop (STYLE.md habit 13: one host loop, swappable executors).

An executor holds the state of session slots (KV cache, conv and recurrent state) and runs tokens through
the model for the selected slot. The host loop (``host.session``) only ever calls this interface:

    reset(slot)            empty state in ``slot`` and select it (slots are pre-allocated: no allocation)
    prefill(ids)           run ids [T] at the current position -> StepOutput of the last row
    step(token)            run one token -> StepOutput
    state_snapshot()       opaque copy of the selected slot's state (recurrent + conv + position)
    state_restore(snap)    put a snapshot back (KV rows below its position are never overwritten after it)
    position, capacity, slots, name, detail

``StepOutput.logits`` is the last row's logits [V] bf16 (``None`` when the executor chose the token on the
device); ``StepOutput.token`` is the device's greedy choice with the padding rows excluded (``None`` when the
executor returns logits only). The CPU executors (``cpu``: fast float32 NumPy; ``cpu-vm``: the reference and
the CPU VM, bit-exact) return logits; the GPU executors fuse argmax/top-k into the
lm_head and return a token (plus logits or top-k when sampling asks for them).
"""
from __future__ import annotations

import copy
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from host.errors import ExecutorUnavailable, InvalidArgument
from loader.config import FIRST_PADDING_ID, ModelConfig

KINDS = ("megakernel", "graph", "cpu", "cpu-vm")
CPU_KINDS = ("cpu", "cpu-vm")  # cpu: the fast float32 NumPy model; cpu-vm: the reference + CPU VM, bit-exact
# The CPU paths are NumPy: fine for the tiny preset, hopeless for 27 GB of weights per token.
CPU_MAX_WEIGHT_BYTES = 2 << 30


# Prompts (or appended turns) of at most this many ids run as eager 8-row decode passes instead of the chunked
# Prefill, whose fixed cost is ≈ 64 ms on the 27B (measured on the H200, bench/results/e2e/prefill.json: eager passes
# 28 ms at 2-8 ids, 57 ms at 16, 227 ms at 64; Prefill 64, 66, 78 ms). Both give the same bits.
EAGER_PREFILL_MAX = 16


@dataclass
class StepOutput:
    """Result of one prefill or step: ``logits`` [V] bf16 of the last row and/or a device-chosen ``token``."""

    logits: np.ndarray | None = None
    token: int | None = None


class Executor(ABC):
    """Interface the host loop drives; see the module docstring."""

    name: str = "?"
    detail: str = ""
    capacity: int = 0
    slots: int = 1

    @abstractmethod
    def reset(self, slot: int = 0) -> None: ...

    @abstractmethod
    def select(self, slot: int) -> None: ...

    @abstractmethod
    def prefill(self, ids: Sequence[int]) -> StepOutput: ...

    @abstractmethod
    def step(self, token: int) -> StepOutput: ...

    @abstractmethod
    def state_snapshot(self) -> Any: ...

    @abstractmethod
    def state_restore(self, snap: Any) -> None: ...

    @property
    @abstractmethod
    def position(self) -> int: ...

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"{self.name} executor: slot {slot} out of range [0, {self.slots})")


def gpu_available() -> tuple[bool, str]:
    """(True, device name) when CuPy sees a CUDA device, else (False, the reason: "no NVIDIA GPU was found", then
    CuPy's or the driver's detail in parentheses; CUDA reports a missing driver as "driver version is
    insufficient")."""
    try:
        import cupy  # noqa: F401  (host may import CuPy; loader/assembler never do)
    except Exception as e:  # noqa: BLE001 - a broken CuPy install also means "no GPU usable here"
        return False, f"no NVIDIA GPU was found (CuPy cannot be imported: {type(e).__name__}: {str(e).strip()[:120]})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, no device: both mean "no GPU here"
        return False, f"no NVIDIA GPU was found (CUDA: {str(e).strip()[:120] or type(e).__name__})"
    if n < 1:
        return False, "no NVIDIA GPU was found (CUDA reports 0 devices)"
    try:
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        name = "CUDA device 0"
    return True, name


def default_kind() -> str:
    """``graph`` when a GPU is present, else ``cpu``. The graph path and the megakernel give the same bits; the
    default is the faster one on the H200 (27B synthetic, ctx 1024, ``python3 -m bench.bench_megakernel``; the
    current figures are in docs/megakernel.md, "Measured"). Flip when the megakernel wins."""
    return "graph" if gpu_available()[0] else "cpu"


def cpu_too_large(cfg: ModelConfig) -> str | None:
    """Why the cpu executors refuse a model whose weights streamed per token exceed CPU_MAX_WEIGHT_BYTES (a phrase
    with the model as subject: "streams ... GiB ..."), or None when it can run it. Checked for a preset before
    anything is loaded (``Engine.load``) and by both CPU executors for any checkpoint."""
    if cfg.weight_bytes_per_token <= CPU_MAX_WEIGHT_BYTES:
        return None
    return (f"streams {cfg.weight_bytes_per_token / 2**30:.1f} GiB of weights per token, over the cpu executor's "
            f"limit of {CPU_MAX_WEIGHT_BYTES >> 30} GiB (its NumPy path is meant for the tiny preset)")


def _check_cpu_size(cfg: ModelConfig, kind: str) -> None:
    if (why := cpu_too_large(cfg)) is not None:
        raise ExecutorUnavailable(f"{kind} executor: model {cfg.name!r} {why}. Use --executor graph or megakernel "
                                  "on a GPU.")


class CpuExecutor(Executor):
    """The default CPU path: the float32 NumPy model of ``host.cpu_fast.FastModel`` (weights widened once at load,
    fp8 × block scale dequantised to float32, BLAS matmuls; about 0.31 GB for tiny, lm_head 254 MB of it).

    Prefill: chunked GDN, chunks of 64 anchored at the sequence start (``FastModel.prefill``: an append re-runs
    the ids since the slot's last 64-aligned anchor checkpoint, decoded tokens included, so any sequence of calls
    gives a prefill the bits of one prefill of the whole history), lm_head on the last row only. Decode:
    the recurrent GDN step and one softmax over the cache per token, row-invariant, so the M = k + 1 verify pass of
    speculative decoding (``host.speculate``, the only executor that speculates) gives plain decode's bits. Not
    bit-identical to the reference: every sum is float32 instead of the reference's float64, at the same bf16 rounding points; it agrees with
    ``ReferenceModel`` within the tolerance of ``tests/cpu/test_cpu_fast.py``. For bit identity with the
    reference use the ``cpu-vm`` executor (CpuVmExecutor). Logits come back as bf16 [V] (padding rows included;
    the host masks them). Slots: a ``FastState`` each, allocated at a slot's first reset and cleared in place
    after. Raises ExecutorUnavailable for a model whose weights are too large for NumPy
    (> CPU_MAX_WEIGHT_BYTES streamed per token).
    """

    name = "cpu"

    def __init__(self, weights, capacity: int, slots: int = 4):
        from host.cpu_fast import FastModel

        cfg: ModelConfig = weights.config
        _check_cpu_size(cfg, self.name)
        self.cfg, self.capacity, self.slots = cfg, int(capacity), int(slots)
        t0 = time.perf_counter()
        self.model = FastModel(weights)
        self.load_s = time.perf_counter() - t0
        self._states: list[Any] = [None] * self.slots
        self._cur = 0
        self.detail = (f"cpu: float32 NumPy model (chunked GDN prefill, chunk 64; recurrent decode step), weights "
                       f"widened in {self.load_s:.1f} s")

    def reset(self, slot: int = 0) -> None:
        self._check_slot(slot)
        if self._states[slot] is None:
            self._states[slot] = self.model.new_state(self.capacity)
        else:
            self._states[slot].clear()
        self._cur = slot

    def select(self, slot: int) -> None:
        self._check_slot(slot)
        self._cur = slot

    @property
    def _state(self):
        st = self._states[self._cur]
        if st is None:
            raise RuntimeError(f"{self.name} executor: slot {self._cur} used before reset()")
        return st

    @property
    def position(self) -> int:
        return int(self._state.pos)

    def prefill(self, ids: Sequence[int]) -> StepOutput:
        ids = np.asarray(ids, dtype=np.int64)
        return StepOutput(logits=self.model.prefill(self._state, ids, logit_rows=[len(ids) - 1])[-1])

    def step(self, token: int) -> StepOutput:
        return StepOutput(logits=self.model.decode(self._state, [int(token)])[-1])

    def state_snapshot(self) -> Any:
        """Copies of the position, the GDN conv + recurrent state, the chunk anchor with its GDN state, and the
        rows since the anchor (ids, hidden, K/V: the next prefill's re-run rewrites them); rows below the
        anchor are never rewritten later, so they are not copied (``FastModel.snapshot``)."""
        return self.model.snapshot(self._state)

    def state_restore(self, snap: Any) -> None:
        """Put a snapshot of this slot's history back in place (``FastModel.restore``)."""
        self.model.restore(self._state, snap)


class CpuVmExecutor(Executor):
    """The ``cpu-vm`` executor: the model on the CPU with the NumPy reference (``assembler.ref.model.ReferenceModel``),
    bit-identical to it (verification and tests; about 0.4-1.5 s per token for tiny; the default CPU path is
    CpuExecutor).

    Prefill: the reference's chunked prefill (GDN chunks of 64 anchored at the call's first token).
    Decode (``decode="vm"``, the default): the decode program the GPU runs (``assembler.options.PROGRAM``, GDN
    steps split as the megakernel runner splits them) run by the CPU VM (``assembler.pyvm.VM.run_step``,
    scheduled for ``vm_sms`` SMs; the SM count changes the slicing, never the bits), which equals the reference decode bit for bit; ``decode="reference"`` calls
    ``ReferenceModel.decode`` instead. ``detail`` names the path taken. The VM widens every weight to float64
    once (about 0.5 GB for tiny, derived: lm_head 248,320 × 256 × 8 B), in a throwaway step at construction,
    so it never lands in a generation's timings. Slots are independent ``ModelState`` objects of ``capacity`` tokens.
    Raises ExecutorUnavailable for a model whose weights are too large for NumPy
    (> CPU_MAX_WEIGHT_BYTES streamed per token).
    """

    name = "cpu-vm"

    def __init__(self, weights, capacity: int, slots: int = 4, decode: str = "vm", vm_sms: int = 1):
        from assembler.ref.model import ReferenceModel

        cfg: ModelConfig = weights.config
        _check_cpu_size(cfg, self.name)
        self.cfg = cfg
        self.capacity = int(capacity)
        self.slots = int(slots)
        self.model = ReferenceModel(weights)
        self._states: list[Any] = [None] * self.slots
        self._cur = 0
        if decode not in ("vm", "reference"):
            raise ValueError(f"cpu-vm executor: decode must be 'vm' or 'reference', got {decode!r}")
        self.vm = None
        self.program_options = None  # the decode program's options (assembler/options.py), with decode="vm"
        if decode == "vm":
            from assembler.options import PROGRAM
            from assembler.pyvm import VM
            from assembler.scheduler import assemble
            from megakernel.runner import split_gdn

            opts = PROGRAM.for_rows(1)
            prog = assemble(cfg, 1, vm_sms, opts)
            parts = opts.gdn_parts(cfg)
            self.vm = VM(split_gdn(prog, parts) if parts > 1 else prog, weights)
            self.program_options = opts.as_dict(cfg)
            # One throwaway step now: the VM widens weights on first use, which would land in the first decode.
            self.vm.run_step(self.model.new_state(1), [0])
            step = f"CPU VM decode program ({vm_sms} SM; the GPU's program form)"
        else:
            step = "reference decode step"
        self.detail = f"cpu-vm: NumPy reference prefill (chunked GDN, chunk 64) + {step}"

    def reset(self, slot: int = 0) -> None:
        self._check_slot(slot)
        self._states[slot] = self.model.new_state(self.capacity)
        self._cur = slot

    def select(self, slot: int) -> None:
        self._check_slot(slot)
        self._cur = slot

    @property
    def _state(self):
        st = self._states[self._cur]
        if st is None:
            raise RuntimeError(f"cpu-vm executor: slot {self._cur} used before reset()")
        return st

    @property
    def position(self) -> int:
        return int(self._state.pos)

    def prefill(self, ids: Sequence[int]) -> StepOutput:
        ids = np.asarray(ids, dtype=np.int64)
        logits = self.model.prefill(self._state, ids, logit_rows=[len(ids) - 1])  # lm_head on the last row only
        return StepOutput(logits=np.asarray(logits)[-1])

    def step(self, token: int) -> StepOutput:
        if self.vm is not None:  # the host samples or picks from the logits (padding masked there)
            logits, _ = self.vm.run_step(self._state, [int(token)])
        else:
            logits = self.model.decode(self._state, np.asarray([int(token)], dtype=np.int64))
        logits = np.asarray(logits)
        return StepOutput(logits=logits.reshape(-1, logits.shape[-1])[-1])

    def state_snapshot(self) -> Any:
        """GDN conv + recurrent state and the position; KV rows below the position are never rewritten later,
        so they are not copied."""
        st = self._state
        return {"pos": st.pos, "conv": copy.deepcopy(st.conv), "rec": copy.deepcopy(st.rec)}

    def state_restore(self, snap: Any) -> None:
        st = self._state
        st.pos, st.conv, st.rec = snap["pos"], copy.deepcopy(snap["conv"]), copy.deepcopy(snap["rec"])
        st.hidden = None


def check_kind(kind: str) -> None:
    """Cheap check before any weights are read: the kind exists (else InvalidArgument) and, for GPU kinds, a
    device is present (else ExecutorUnavailable)."""
    if kind not in KINDS:
        raise InvalidArgument(f"executor: expected one of {', '.join(KINDS)}, got {kind!r}")
    if kind not in CPU_KINDS:
        ok, why = gpu_available()
        if not ok:
            raise ExecutorUnavailable(
                f"{kind} executor needs an NVIDIA GPU: {why}. Use --executor cpu (tiny preset) instead.")


class _DeviceStepOutput(StepOutput):
    """A GPU step's output: the device's greedy ``token`` now; ``logits`` [V] bf16 copied from the device only
    when the host asks for them (sampling), so greedy decoding moves one integer per step."""

    def __init__(self, token: int | None, fetch, sample=None):
        self.token, self._fetch, self._logits = token, fetch, None
        self.sample_on_device = sample  # (temperature, top_k, top_p, u) -> id, drawn from the logits on the device

    @property
    def logits(self) -> np.ndarray:  # type: ignore[override]
        if self._logits is None:
            self._logits = self._fetch()
        return self._logits


class GraphExecutor(Executor):
    """Discrete kernels replayed as one CUDA graph per step (``discrete.step.DecodeStep``).

    Weights: a ``SyntheticWeights`` source is materialised directly in GPU memory (seconds for the 27B);
    any other WeightSource is uploaded tensor by tensor. One session slot (its state stays resident; other
    conversations restore from snapshots). Prefill: every id but the last through ``discrete.prefill.Prefill``
    (projection GEMMs over chunks of up to 2,048 rows, the GDN and attention decode kernels over row tiles),
    then the last id as a decode step, which gives its logits and device argmax; bit-identical per row to
    eager decode passes, so any split of a prompt into calls gives the same bits. Decode replays the captured
    M = 1 graph, whose finish kernel advances the device-side control block. Raises ExecutorUnavailable
    without a GPU."""

    name = "graph"

    def __init__(self, weights, capacity: int, slots: int = 1):
        check_kind(self.name)
        from discrete.prefill import Prefill
        from discrete.step import DecodeStep
        from discrete.weights_gpu import WeightsGPU
        from loader.synthetic import SyntheticWeights

        cfg: ModelConfig = weights.config
        t0 = time.perf_counter()
        synthetic = isinstance(weights, SyntheticWeights)
        wg = WeightsGPU.from_synthetic(weights) if synthetic else WeightsGPU.from_source(weights)
        self.cfg, self.capacity, self.slots = cfg, int(capacity), 1
        self.dstep = DecodeStep(cfg, wg, self.capacity, m_rows=1, debug_logits=True)
        self.prefiller = Prefill(self.dstep)  # scratch for its chunk, allocated here (start-up)
        self.load_s = time.perf_counter() - t0
        self.detail = (f"graph: discrete kernels, one CUDA graph per step; weights "
                       f"{'materialised on the GPU' if synthetic else 'uploaded'} in {self.load_s:.1f} s; "
                       f"prefill = GEMM chunks of {self.prefiller.chunk} rows")
        self._captured = False
        self.device_sampling = True  # draw sampled tokens on the GPU (discrete.sampling); False: on the host
        self._sampler = None         # the DeviceSampler, built at the first sampled token

    def reset(self, slot: int = 0) -> None:
        self._check_slot(slot)
        self.dstep.reset(pos=0)

    def _sample(self, temperature: float, top_k: int | None, top_p: float | None, u: float) -> int:
        """A token drawn on the device from the last step's logits row (the host sampler's rules and draw u)."""
        if self._sampler is None:
            from discrete.sampling import DeviceSampler
            self._sampler = DeviceSampler(self.cfg)
        d = self.dstep
        with d.stream:
            return self._sampler(d.buf["logits"][d.last_m - 1], temperature, top_k, top_p, u)

    def select(self, slot: int) -> None:
        self._check_slot(slot)

    @property
    def position(self) -> int:
        return int(self.dstep.pos)

    def _out(self) -> StepOutput:
        tok = self.dstep.read_token()
        fetch = lambda: np.asarray(self.dstep.buffer("logits"))[-1]  # noqa: E731
        if not 0 <= tok < FIRST_PADDING_ID:  # defensive: the device argmax must never pick a padding id
            tok = None
        return _DeviceStepOutput(tok, fetch, self._sample if self.device_sampling else None)

    def prefill(self, ids: Sequence[int]) -> StepOutput:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size < 1:
            raise ValueError("prefill: no ids")
        if self.position + ids.size > self.capacity:
            raise ValueError(f"prefill: positions {self.position}..{self.position + ids.size - 1} exceed the "
                             f"capacity {self.capacity}")
        if ids.size <= EAGER_PREFILL_MAX:  # short appends: eager passes are cheaper; the same bits either way
            for s in range(0, ids.size - 1, 8):
                self.dstep.run_eager(ids[s:min(s + 8, ids.size - 1)])
        else:
            self.prefiller.run(ids[:-1])
        self._last_row(int(ids[-1]))
        return self._out()

    def _last_row(self, token: int) -> None:
        """The prompt's last id as a decode step: the captured graph once it exists, else an eager pass (which
        also loads every module of the step before the first capture)."""
        if self._captured:
            self.dstep.replay([token])
        else:
            self.dstep.run_eager([token])

    def step(self, token: int) -> StepOutput:
        if not self._captured:  # capture once, after the eager prefill has loaded every module
            self.dstep.capture()
            self._captured = True
        self.dstep.replay([int(token)])
        return self._out()

    def state_snapshot(self) -> Any:
        """Device copies of the GDN recurrent state and conv rings plus the position (KV rows below the
        position are never rewritten later). Snapshots are taken on the executor's stream."""
        d = self.dstep
        with d.stream:
            return {"pos": d.pos, "rec": {i: a.copy() for i, a in d.rec.items()},
                    "ring": {i: a.copy() for i, a in d.ring.items()}}

    def state_restore(self, snap: Any) -> None:
        d = self.dstep
        c = d.control()
        c["pos"] = snap["pos"]
        d.write_control(c)
        with d.stream:
            for i, a in snap["rec"].items():
                d.rec[i][...] = a
            for i, a in snap["ring"].items():
                d.ring[i][...] = a


class MegakernelExecutor(GraphExecutor):
    """The persistent cooperative kernel running the assembled program (``megakernel.runner.Megakernel``),
    bound to a ``DecodeStep`` whose weights, arena, state, KV pages and control block it shares.

    Decode: one cooperative launch per step (embedding through lm_head + argmax + control-block update on
    the GPU). Prefill: the graph executor's (``discrete.prefill.Prefill`` on the shared DecodeStep, bit-identical
    per row to the decode passes, which are bit-identical to the megakernel's: ``tests/gpu/test_megakernel.py``),
    the last id as a megakernel step. Raises ExecutorUnavailable without a GPU."""

    name = "megakernel"

    def __init__(self, weights, capacity: int, slots: int = 1):
        super().__init__(weights, capacity, slots)
        from megakernel.runner import Megakernel

        t0 = time.perf_counter()
        self.mk = Megakernel(self.dstep, m_rows=1)
        self.detail = (f"megakernel: {self.mk.num_sms} SMs × {self.mk.threads} threads, "
                       f"{int(self.mk.lens.max())} instructions on the longest SM, built in "
                       f"{time.perf_counter() - t0:.1f} s; prefill = GEMM chunks of {self.prefiller.chunk} rows; "
                       f"weights loaded in {self.load_s:.1f} s")

    def _last_row(self, token: int) -> None:
        self.mk.step([token])
        self.mk.check(timeout_s=60.0)

    def step(self, token: int) -> StepOutput:
        self.mk.step([int(token)])
        self.mk.check(timeout_s=60.0)  # raises on a deadlock or a kernel-reported error
        return self._out()


def make_executor(kind: str, weights, capacity: int, slots: int = 4) -> Executor:
    """Build the executor ``kind`` (one of KINDS) for ``weights`` (a WeightSource). Raises InvalidArgument for an
    unknown kind, ExecutorUnavailable for one that cannot run here."""
    table = {"cpu": CpuExecutor, "cpu-vm": CpuVmExecutor, "graph": GraphExecutor, "megakernel": MegakernelExecutor}
    check_kind(kind)
    return table[kind](weights, capacity, slots)
