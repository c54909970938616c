"""Executors: what runs the model for the host loop (STYLE.md habit 13: one host loop, swappable executors).

An executor holds the state of session slots (KV cache, conv and recurrent state) and runs tokens through
the model for the selected slot. The host loop (``host.session``) only ever calls this interface:

    reset(slot)            empty state in ``slot`` and select it (slots are pre-allocated: no allocation)
    prefill(ids)           run ids [T] at the current position -> StepOutput of the last row
    step(token)            run one token -> StepOutput
    state_snapshot()       opaque copy of the selected slot's state (recurrent + conv + position)
    state_restore(snap)    put a snapshot back (KV rows below its position are never overwritten after it)
    park(snapshots)        the selected slot's whole state (and the session's snapshots) as a ParkedState in host
                           memory; the slot may then be reset and reused
    unpark(parked, slot)   a ParkedState put back into ``slot`` (any free one) and selected; returns its snapshots
    position, capacity, slots, name, detail, transfer_rate

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

from assembler.options import PROGRAM
from host.errors import ExecutorUnavailable, InvalidArgument
from loader.config import FIRST_PADDING_ID, ModelConfig
from loader.synthetic import SyntheticWeights

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


@dataclass
class ParkedState:
    """A session's executor state moved out of its slot into host memory (``Executor.park``).

    ``kind``: the executor's name (a ParkedState goes back only into an executor of that kind); ``position``:
    tokens whose effect it holds; ``data``: the executor's own host copies (the cpu executors: NumPy arrays; the
    GPU executors: pinned NumPy arrays); ``snapshots``: the session's state snapshots in host form, in the order
    given to ``park``; ``nbytes``: host bytes held (data and snapshots), what the server's ``--park-memory``
    budget counts; ``park_s``: seconds the copy out took (with the device synchronised)."""

    kind: str
    position: int
    data: dict
    snapshots: list
    nbytes: int
    park_s: float = 0.0


def _nbytes(obj) -> int:
    """Bytes of the NumPy arrays in a nest of dicts / lists / tuples (other leaves count 0)."""
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


class Executor(ABC):
    """Interface the host loop drives; see the module docstring."""

    name: str = "?"
    detail: str = ""
    capacity: int = 0
    slots: int = 1
    # host <-> slot copy rate in bytes/s that park / unpark are estimated at until one is measured (the server's
    # park-or-drop choice, host.server.pool); ``unpark`` replaces it with the rate it measures
    transfer_rate: float = 2e9
    # longest prefill call a session makes (host.session.Session._prefill): the CPU paths build [T, V] logits per
    # call; None: no bound (the GPU executors prefill any length in one call, the same bits for any split)
    max_prefill_piece: int | None = 256

    def park(self, snapshots: Sequence = ()) -> ParkedState:
        """The selected slot's whole state and ``snapshots`` (this slot's ``state_snapshot()`` results) copied
        into host memory as a ParkedState; the slot is left as it was (reset it to reuse it). Raises
        NotImplementedError for an executor that cannot park."""
        raise NotImplementedError(f"{self.name} executor cannot park a session")

    def park_nbytes(self, snapshots: Sequence = ()) -> int:
        """Host bytes ``park(snapshots)`` would hold for the selected slot, computed without copying (the
        server's park-or-drop choice). Raises NotImplementedError for an executor that cannot park."""
        raise NotImplementedError(f"{self.name} executor cannot park a session")

    def unpark(self, parked: ParkedState, slot: int) -> list:
        """Reset ``slot``, put ``parked`` into it and select it: the slot then continues bit-identically to the
        one parked. Returns the snapshots in the form ``state_restore`` takes, in ``park``'s order. Raises
        ValueError for a ParkedState of another executor kind or a slot out of range."""
        raise NotImplementedError(f"{self.name} executor cannot unpark a session")

    def _check_parked(self, parked: ParkedState) -> None:
        if not isinstance(parked, ParkedState) or parked.kind != self.name:
            raise ValueError(f"{self.name} executor: cannot unpark "
                             f"{getattr(parked, 'kind', type(parked).__name__)!r} state")

    def _measured(self, nbytes: int, seconds: float) -> None:
        """Update ``transfer_rate`` from one copy of ``nbytes`` taking ``seconds`` (copies under 1 MiB are
        dominated by call overheads and ignored)."""
        if nbytes >= 1 << 20 and seconds > 0:
            self.transfer_rate = nbytes / seconds

    @abstractmethod
    def reset(self, slot: int = 0) -> None: ...

    @abstractmethod
    def select(self, slot: int) -> None: ...

    @abstractmethod
    def prefill(self, ids: Sequence[int]) -> StepOutput: ...

    @abstractmethod
    def step(self, token: int) -> StepOutput: ...

    def step_rows(self, tokens: Sequence[int]) -> StepOutput:
        """Run 1..8 known ids at the position as decode rows and return the last row's output, with the bits
        one-row steps give it. This default runs one step per id; executors with a multi-row decode pass run
        them in one."""
        out = None
        for t in tokens:
            out = self.step(int(t))
        if out is None:
            raise ValueError(f"{self.name} executor: step_rows needs 1..8 ids, got none")
        return out

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
        from host.cpu_fast import FastModel  # lazy: start-up (~20 ms; this module is loaded by every CLI command)

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

    def step_rows(self, tokens: Sequence[int]) -> StepOutput:
        """The ids as one pass of the decode path (``FastModel.decode``: each row the bits of a one-row step)."""
        return StepOutput(logits=self.model.decode(self._state, [int(t) for t in tokens])[-1])

    def state_snapshot(self) -> Any:
        """Copies of the position, the GDN conv + recurrent state, the chunk anchor with its GDN state, and the
        rows since the anchor (ids, hidden, K/V: the next prefill's re-run rewrites them); rows below the
        anchor are never rewritten later, so they are not copied (``FastModel.snapshot``)."""
        return self.model.snapshot(self._state)

    def state_restore(self, snap: Any) -> None:
        """Put a snapshot of this slot's history back in place (``FastModel.restore``)."""
        self.model.restore(self._state, snap)

    def park(self, snapshots: Sequence = ()) -> ParkedState:
        """The selected slot's state copied out (``FastModel.park``: K/V, ids, hidden rows and MTP cache below the
        position, GDN state, the chunk anchor); ``snapshots`` are host copies already and are kept as they are."""
        t0 = time.perf_counter()
        data = self.model.park(self._state)
        snaps = list(snapshots)
        return ParkedState(self.name, data["pos"], data, snaps, _nbytes(data) + _nbytes(snaps),
                           time.perf_counter() - t0)

    def park_nbytes(self, snapshots: Sequence = ()) -> int:
        """Bytes ``park(snapshots)`` would hold: the sizes of ``FastModel.park``'s views plus the snapshots."""
        return _nbytes(self.model.park(self._state, copy=False)) + _nbytes(list(snapshots))

    def unpark(self, parked: ParkedState, slot: int) -> list:
        """Reset ``slot`` and copy ``parked`` into it (``FastModel.unpark``); selects it; returns the snapshots."""
        self._check_parked(parked)
        self.reset(slot)
        t0 = time.perf_counter()
        self.model.unpark(self._state, parked.data)
        self._measured(_nbytes(parked.data), time.perf_counter() - t0)
        return list(parked.snapshots)


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
        from assembler.ref.model import ReferenceModel  # lazy: start-up (and test_program_options replaces it)

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
            from assembler.pyvm import VM  # lazy: start-up (~60 ms with the scheduler); test_program_options replaces VM
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

    def park(self, snapshots: Sequence = ()) -> ParkedState:
        """Copies of the selected slot's ``ModelState`` for its ``pos`` tokens: K/V and MTP K/V rows below the
        position and ``mtp_pos``, GDN conv + recurrent state, the prefill's chunk checkpoint and ``hidden``;
        ``snapshots`` (host copies already) are kept as they are."""
        t0 = time.perf_counter()
        data = self._park_data(copy.deepcopy)
        snaps = list(snapshots)
        return ParkedState(self.name, data["pos"], data, snaps, _nbytes(data) + _nbytes(snaps),
                           time.perf_counter() - t0)

    def park_nbytes(self, snapshots: Sequence = ()) -> int:
        """Bytes ``park(snapshots)`` would hold: the sizes of the pieces it copies plus the snapshots."""
        return _nbytes(self._park_data(lambda x: x)) + _nbytes(list(snapshots))

    def _park_data(self, c) -> dict:
        """What ``park`` keeps, each piece passed through ``c`` (a deep copy, or the identity for sizes)."""
        st = self._state
        p, m = st.pos, st.mtp_pos
        return {"pos": p, "mtp_pos": m, "k": {i: c(a[:p]) for i, a in st.k.items()},
                "v": {i: c(a[:p]) for i, a in st.v.items()},
                "mtp_k": None if st.mtp_k is None else c(st.mtp_k[:m]),
                "mtp_v": None if st.mtp_v is None else c(st.mtp_v[:m]),
                "conv": c(st.conv), "rec": c(st.rec), "ckpt": c(st.ckpt),
                "hidden": None if st.hidden is None else c(st.hidden)}

    def unpark(self, parked: ParkedState, slot: int) -> list:
        """A fresh ``ModelState`` in ``slot`` (``reset``) filled from ``parked``; selects it; returns the
        snapshots."""
        self._check_parked(parked)
        self.reset(slot)
        t0 = time.perf_counter()
        st, d = self._state, parked.data
        p, m = d["pos"], d["mtp_pos"]
        for i in st.k:
            st.k[i][:p], st.v[i][:p] = d["k"][i], d["v"][i]
        if d["mtp_k"] is not None:
            st.mtp_k[:m], st.mtp_v[:m] = d["mtp_k"], d["mtp_v"]
        st.pos, st.mtp_pos = p, m
        st.conv, st.rec, st.ckpt = copy.deepcopy(d["conv"]), copy.deepcopy(d["rec"]), copy.deepcopy(d["ckpt"])
        st.hidden = None if d["hidden"] is None else np.array(d["hidden"], copy=True)
        self._measured(_nbytes(d), time.perf_counter() - t0)
        return list(parked.snapshots)


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


def _pinned(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised page-locked NumPy array (CuPy's pinned pool): the target of async device copies. An empty
    shape gives a plain empty array (nothing is copied into it)."""
    shape = tuple(int(n) for n in shape)
    if int(np.prod(shape)) == 0:
        return np.empty(shape, dtype)
    import cupyx
    return cupyx.empty_pinned(shape, dtype)


def _to_host(a, stream_ptr: int) -> np.ndarray:
    """A pinned host copy of the C-contiguous CuPy array ``a``, enqueued on the stream (valid after a sync)."""
    import cupy as cp
    if not a.flags.c_contiguous:
        raise ValueError("park: expected a C-contiguous device array")
    h = _pinned(a.shape, a.dtype)
    cp.cuda.runtime.memcpyAsync(h.ctypes.data, a.data.ptr, a.nbytes, cp.cuda.runtime.memcpyDeviceToHost, stream_ptr)
    return h


def _to_device(h: np.ndarray, a, stream_ptr: int) -> None:
    """Copy the host array ``h`` into the C-contiguous CuPy array ``a`` of the same shape and dtype, on the
    stream. Raises ValueError on a mismatch."""
    import cupy as cp
    if h.shape != a.shape or h.dtype != a.dtype or not a.flags.c_contiguous:
        raise ValueError(f"unpark: host {h.dtype}{h.shape} does not fit device {a.dtype}{a.shape}")
    cp.cuda.runtime.memcpyAsync(a.data.ptr, h.ctypes.data, h.nbytes, cp.cuda.runtime.memcpyHostToDevice, stream_ptr)


class GraphExecutor(Executor):
    """Discrete kernels replayed as one CUDA graph per step (``discrete.step.DecodeStep``).

    Weights: a ``SyntheticWeights`` source is materialised directly in GPU memory (seconds for the 27B);
    any other WeightSource is uploaded through a ring of pinned buffers that a reader thread fills while the
    previous ones are copied (``WeightsGPU.from_source``, ``loader.staging``; ``progress`` labels its bar). One
    session slot (its state stays resident; other conversations restore from snapshots). Prefill: every id but the
    last through ``discrete.prefill.Prefill`` (projection GEMMs over chunks of up to 2,048 rows, the GDN and
    attention decode kernels over row tiles), then the last id as a decode step, which gives its logits and device
    argmax; bit-identical per row to eager decode passes, so any split of a prompt into calls gives the same bits.
    Decode replays the captured M = 1 graph, whose finish kernel advances the device-side control block. Raises
    ExecutorUnavailable without a GPU."""

    name = "graph"
    max_prefill_piece = None  # Prefill's fixed cost (≈ 64 ms per call at the 27B) is paid once per prompt
    transfer_rate = 2e10  # pinned host <-> H200 copies until one is measured (an estimate: PCIe Gen5 x16 peaks
    #                       at 64 GB/s each way)

    def __init__(self, weights, capacity: int, slots: int = 1, progress: str | None = None):
        check_kind(self.name)
        from discrete.prefill import Prefill  # lazy: the GPU side (CuPy inside; ~30 ms of every CLI start)
        from discrete.step import DecodeStep
        from discrete.weights_gpu import WeightsGPU

        cfg: ModelConfig = weights.config
        t0 = time.perf_counter()
        synthetic = isinstance(weights, SyntheticWeights)
        wg = WeightsGPU.from_synthetic(weights) if synthetic else WeightsGPU.from_source(weights, progress=progress)
        self.upload_stats = wg.load_stats  # the staged upload's statistics (loader.staging), None when drawn
        self.cfg, self.capacity, self.slots = cfg, int(capacity), 1
        self.dstep = DecodeStep(cfg, wg, self.capacity, m_rows=1, debug_logits=True)
        self.prefiller = Prefill(self.dstep)  # scratch for its chunk, allocated here (start-up)
        self.load_s = time.perf_counter() - t0
        self.detail = (f"graph: discrete kernels, one CUDA graph per step; weights "
                       f"{'materialised on the GPU' if synthetic else 'uploaded (staged)'} in {self.load_s:.1f} s; "
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
        st = self.dstep.state
        with st.stream:
            return self._sampler(st.buf["logits"][st.last_m - 1], temperature, top_k, top_p, u)

    def select(self, slot: int) -> None:
        self._check_slot(slot)

    @property
    def position(self) -> int:
        return int(self.dstep.state.pos)

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

    def step_rows(self, tokens: Sequence[int]) -> StepOutput:
        """The ids as one eager decode pass of M = len(tokens) rows (``DecodeStep.run_eager``; each row the bits
        of a one-row step, ``tests/gpu/test_step.py``). The megakernel executor inherits it: the same bits."""
        self.dstep.run_eager([int(t) for t in tokens])
        return self._out()

    def step(self, token: int) -> StepOutput:
        if not self._captured:  # capture once, after the eager prefill has loaded every module
            self.dstep.capture()
            self._captured = True
        self.dstep.replay([int(token)])
        return self._out()

    def state_snapshot(self) -> Any:
        """Device copies of the GDN recurrent state and conv rings plus the position (KV rows below the
        position are never rewritten later). Snapshots are taken on the executor's stream (the session's
        ``discrete.device_state.DeviceState``)."""
        st = self.dstep.state
        with st.stream:
            return {"pos": st.pos, "rec": {i: a.copy() for i, a in st.rec.items()},
                    "ring": {i: a.copy() for i, a in st.ring.items()}}

    def state_restore(self, snap: Any) -> None:
        st = self.dstep.state
        c = st.control()
        c["pos"] = snap["pos"]
        st.write_control(c)
        with st.stream:
            for i, a in snap["rec"].items():
                st.rec[i][...] = a
            for i, a in snap["ring"].items():
                st.ring[i][...] = a

    def _kv_rows(self, pos: int) -> tuple[list[int], int, int, int, int]:
        """Where the KV rows of positions [0, pos) lie in the page pool (``discrete.kv_cache``): (the session's
        pages in order, full pages, rows in the last partial page, bytes per page, bytes of one (layer, K|V,
        head) run of PAGE rows)."""
        kv = self.dstep.state.kv
        page, hd = kv.shape[4], kv.shape[5]
        return self.dstep.state.sess.pages, pos // page, pos % page, kv.page_stride * 2, page * hd * 2

    def park(self, snapshots: Sequence = ()) -> ParkedState:
        """The slot's state copied into pinned host memory with CuPy async copies on the executor's stream:
        the GDN recurrent state and conv rings (whole), the KV rows in use (the full pages below the position
        whole, then only the rows of the last, partial page: one 2-D copy of L × 2 × n_kv runs of ``rows`` ×
        head_dim), the position; ``snapshots`` (device copies) likewise. Synchronises before it returns."""
        import cupy as cp

        d, rt = self.dstep.state, cp.cuda.runtime
        t0 = time.perf_counter()
        pos = d.pos
        pages, full, rows, pbytes, run = self._kv_rows(pos)
        shape = d.kv.shape
        base = d.kv.pool.data.ptr
        kv_full = _pinned((full,) + shape[1:], np.uint16)
        kv_tail = _pinned(shape[1:4] + (rows, shape[5]), np.uint16)
        sp = d.stream.ptr  # stream order: the copies read the state after the last step's writes
        for j in range(full):
            rt.memcpyAsync(kv_full.ctypes.data + j * pbytes, base + pages[j] * pbytes, pbytes,
                           rt.memcpyDeviceToHost, sp)
        if rows:
            w = rows * shape[5] * 2
            rt.memcpy2DAsync(kv_tail.ctypes.data, w, base + pages[full] * pbytes, run, w,
                             int(np.prod(shape[1:4])), rt.memcpyDeviceToHost, sp)
        data = {"pos": pos, "kv_full": kv_full, "kv_tail": kv_tail,
                "rec": {i: _to_host(a, sp) for i, a in d.rec.items()},
                "ring": {i: _to_host(a, sp) for i, a in d.ring.items()}}
        snaps = [{"pos": q["pos"], "rec": {i: _to_host(a, sp) for i, a in q["rec"].items()},
                  "ring": {i: _to_host(a, sp) for i, a in q["ring"].items()}} for q in snapshots]
        d.stream.synchronize()
        dt = time.perf_counter() - t0
        nbytes = _nbytes(data) + _nbytes(snaps)
        self._measured(nbytes, dt)
        return ParkedState(self.name, pos, data, snaps, nbytes, dt)

    def park_nbytes(self, snapshots: Sequence = ()) -> int:
        """Bytes ``park(snapshots)`` would pin: the KV rows in use, GDN state and conv rings, the snapshots."""
        d = self.dstep.state
        _, full, rows, pbytes, _ = self._kv_rows(d.pos)
        per_row = int(np.prod(d.kv.shape[1:4])) * d.kv.shape[5] * 2
        state = sum(a.nbytes for a in (*d.rec.values(), *d.ring.values()))
        snaps = sum(a.nbytes for q in snapshots for key in ("rec", "ring") for a in q[key].values())
        return full * pbytes + rows * per_row + state + snaps

    def unpark(self, parked: ParkedState, slot: int) -> list:
        """Reset ``slot``, copy ``parked`` back (the KV rows into this slot's own pages, the GDN state, the
        position into the control block) and return its snapshots as device copies; synchronises."""
        import cupy as cp

        self._check_parked(parked)
        self.reset(slot)
        d, rt, data = self.dstep.state, cp.cuda.runtime, parked.data
        t0 = time.perf_counter()
        pos = data["pos"]
        if pos > self.capacity:
            raise ValueError(f"{self.name} executor: {pos} positions parked, the slot holds {self.capacity}")
        pages, full, rows, pbytes, run = self._kv_rows(pos)
        shape, base, sp = d.kv.shape, d.kv.pool.data.ptr, d.stream.ptr
        kv_full, kv_tail = data["kv_full"], data["kv_tail"]
        for j in range(full):
            rt.memcpyAsync(base + pages[j] * pbytes, kv_full.ctypes.data + j * pbytes, pbytes,
                           rt.memcpyHostToDevice, sp)
        if rows:
            w = rows * shape[5] * 2
            rt.memcpy2DAsync(base + pages[full] * pbytes, run, kv_tail.ctypes.data, w, w,
                             int(np.prod(shape[1:4])), rt.memcpyHostToDevice, sp)
        for i, h in data["rec"].items():
            _to_device(h, d.rec[i], sp)
        for i, h in data["ring"].items():
            _to_device(h, d.ring[i], sp)
        c = d.control()
        c["pos"] = pos
        d.write_control(c)
        with d.stream:
            snaps = [{"pos": q["pos"], "rec": {i: cp.empty(h.shape, h.dtype) for i, h in q["rec"].items()},
                      "ring": {i: cp.empty(h.shape, h.dtype) for i, h in q["ring"].items()}}
                     for q in parked.snapshots]
        for q, h in zip(snaps, parked.snapshots):
            for key in ("rec", "ring"):
                for i, a in q[key].items():
                    _to_device(h[key][i], a, sp)
        d.stream.synchronize()
        self._measured(parked.nbytes, time.perf_counter() - t0)
        return snaps


class MegakernelExecutor(GraphExecutor):
    """The persistent cooperative kernel running the assembled program (``megakernel.runner.Megakernel``),
    bound to a ``DecodeStep``: its weights, and its ``DeviceState`` (arena, state, KV pages, control block).

    Decode: one cooperative launch per step (embedding through lm_head + argmax + control-block update on
    the GPU). Prefill: the graph executor's (``discrete.prefill.Prefill`` on the shared DecodeStep, bit-identical
    per row to the decode passes, which are bit-identical to the megakernel's: ``tests/gpu/test_megakernel.py``),
    the last id as a megakernel step. Raises ExecutorUnavailable without a GPU."""

    name = "megakernel"

    def __init__(self, weights, capacity: int, slots: int = 1, progress: str | None = None):
        super().__init__(weights, capacity, slots, progress)
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


def make_executor(kind: str, weights, capacity: int, slots: int = 4, progress: str | None = None) -> Executor:
    """Build the executor ``kind`` (one of KINDS) for ``weights`` (a WeightSource). ``progress``: a label for the
    bar of a GPU executor's weight upload on stderr (shown on a terminal; ``loader.progress``), None for none.
    Raises InvalidArgument for an unknown kind, ExecutorUnavailable for one that cannot run here."""
    table = {"cpu": CpuExecutor, "cpu-vm": CpuVmExecutor, "graph": GraphExecutor, "megakernel": MegakernelExecutor}
    check_kind(kind)
    if kind in CPU_KINDS:
        return table[kind](weights, capacity, slots)
    return table[kind](weights, capacity, slots, progress)
