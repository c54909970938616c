"""Launch code for the GEMV family (``kernels/gemv.cu``): fp8 block-scaled or bf16 projections, split-K
partials, and the fixed-order reduce with the store / residual / swiglu epilogues (docs/INTERFACES.md §2).
``Gemv.__call__`` runs both, in one launch where that measured faster (M = 1, S ≤ 8: the last warp of each output
tile reduces it, fixed split order), else as ``partial`` + ``reduce``; the bits are the same either way.

Device arrays are CuPy arrays holding bit patterns: bf16 as ``uint16``, fp8 e4m3 as ``uint8``. Launches go to
the current CuPy stream and allocate nothing (the caller preallocates partials and outputs once), so they can be
captured into a CUDA graph.

``Gemv(..., norm_weight=w)`` fuses the (1+w) RMSNorm of x into the launch (``*_norm_partial`` kernels): every
block normalises x into shared memory with the standalone norm kernel's device function (same bits), block 0
stores the normed rows where the caller asks (``normed=``), and the GEMV runs on them.

M = 1 launches of fp8 shapes use builds with M fixed at compile time (docs/kernels-gemv.md), same bits
as the general kernels: warp tasks of ≥ ``TMA_MIN_UNITS`` K-blocks in slices of ≤ ``TMA_WARPS`` tasks
(gate|up, down, GDN q|k|v) the ``*_m1t1`` / ``*_m1t2`` kernels, whose weights reach shared memory by TMA (a 2D
tensor map of the weight, built here with the driver's ``cuTensorMapEncodeTiled``); the others (z, out, o,
attention q|k|v) the register-ring tile ``*_m1r``. ``*_m1`` (the cp.async ring) remains for ``QMK_GEMV_M1=1``.
"""
from __future__ import annotations

import numpy as np

from assembler.numerics import K_BLOCK, MAX_ROWS, ROW_TILE, split_k
from discrete.build import load_module
from discrete.launch import Kernel
from discrete.partition import BF16_WARPS, FP8_WARPS, gemv_slices
from loader.config import ModelConfig

SOURCES = ("gemv.cu",)
EPILOGUES = {"store": 0, "residual": 1, "swiglu": 2}
NULL = np.uint64(0)  # a null pointer argument
RING_MAX = 0         # default QMK_GEMV_RING_MAX of kernels/gemv.cuh: 0 = register-ring tile (measured faster)
RING_LIMIT = 8       # deepest shared-memory weight ring the kernel supports (units per warp)
UNIT_BYTES = 2048    # QMK_GEMV_UNIT_BYTES: one ring slot per warp (16 rows x 128 B of weights)
NORM_STATIC_SMEM = 8 * 32  # static shared bytes of the *_norm_partial kernels (double red[warps ≤ 32])
M1_RING = 2          # ring depth of the fp8 M = 1 kernels (*_m1, always the shared-memory ring): 2 measured
                     # fastest (docs/kernels-gemv.md, "Where the GEMV time goes")
M1_MIN_UNITS = 16    # the *_m1 rule (tasks of >= this many K-blocks: gate|up 40, down 17); the TMA kernels
                     # (TMA_MIN_UNITS) take those shapes by default, kept for QMK_GEMV_M1=1
TMA_MIN_UNITS = 10   # M = 1 fp8 tasks spanning >= this many K-blocks take the TMA kernels (measured: +3-5 points
                     # on gate|up 40, down 17; GDN q|k|v 10 +1; z/out/o at 5-6 no better than the register tile)
TMA_RING = 2         # stages per warp (measured: 2 fastest at every warp count and box width)
TMA_WARPS = 20       # ... and slices of at most this many tasks, one per warp of a 640-thread block (gemv.cu
                     # QMK_GEMV_TMA_WARPS; attn q|k|v has 28: spread over 16 warps its partials were faster but
                     # the fused tail, run per task, made the launch 3.6 us slower than the register tile;
                     # docs/kernels-gemv.md, "Kernels and the launch rule")
PY_KNOBS = ("QMK_GEMV_M1", "QMK_GEMV_TMA_KPB")  # launch choices (benchmarks, tests), not NVRTC defines
FUSE_MAX_SPLIT = 8   # __call__ fuses the reduce for M = 1 and S ≤ this (measured: faster there, slower at M = 8
                     # and at S = 40; docs/kernels-gemv.md, "Kernels and the launch rule")


def ring_depth(tasks_per_slice: int, warps: int, smem_optin: int, ring_max: int = RING_LIMIT) -> tuple[int, int]:
    """(ring depth R, dynamic shared bytes) for a slice of ``tasks_per_slice`` warp tasks on ``warps`` warps:
    the deepest ring (≤ ring_max) whose min(warps, tasks) · R · 2 KB fit in ``smem_optin`` bytes.
    ring_max = 0 selects the register-ring build: (0, 0). Raises ValueError when not even R = 2 fits."""
    if ring_max == 0:
        return 0, 0
    _need(2 <= ring_max <= RING_LIMIT, f"gemv: QMK_GEMV_RING_MAX={ring_max} must be 0 or in [2, {RING_LIMIT}]")
    used = max(1, min(warps, tasks_per_slice))
    R = min(ring_max, smem_optin // (used * UNIT_BYTES))
    _need(R >= 2, f"gemv: {used} warps need {2 * used * UNIT_BYTES} B of shared memory for a 2-deep ring, "
                  f"the device allows {smem_optin}")
    return R, used * R * UNIT_BYTES


def tma_plan(tasks_per_slice: int, units_per_task: int, kpb: int | None = None) -> tuple[int, int]:
    """(K-blocks per TMA box, warps that take tasks) of an M = 1 TMA launch: boxes of 2 K-blocks (256-byte row
    pieces) when the task's K-block count is even, else 1 (no bytes past the task); one warp per task, at most
    TMA_WARPS (the kernels' block; more tasks go round-robin) (measured, docs/kernels-gemv.md "Kernels and the
    launch rule"). ``kpb``
    forces the box width (1 or 2; 2 on an odd count reads one K-block past each task, unused)."""
    if kpb is None:
        kpb = 2 if units_per_task % 2 == 0 else 1
    _need(kpb in (1, 2), f"gemv: TMA boxes of {kpb} K-blocks; expected 1 or 2")
    return kpb, max(1, min(tasks_per_slice, TMA_WARPS))


def tma_smem(kpb: int, na: int, ring: int = TMA_RING) -> int:
    """Dynamic shared bytes of the TMA ring: na warps × ring stages of 16 rows × 128·kpb bytes, one 8-byte
    mbarrier per stage, 128 bytes of alignment slack (gemv.cu gemv_fp8_partial_m1t*)."""
    return na * ring * (2048 * kpb + 8) + 128


def tensor_map(w, kpb: int):
    """:func:`tensor_map_host` of w uploaded: a CuPy uint64 [16] array (128 bytes in device memory, read by the
    kernels' cp.async.bulk.tensor)."""
    import cupy as cp
    return cp.asarray(tensor_map_host(w, kpb))


def tensor_map_host(w, kpb: int) -> np.ndarray:
    """CUtensorMap of a row-major fp8 weight w (CuPy uint8 [N, K], 16-byte aligned) for TMA boxes of 16 rows ×
    128·kpb bytes, as NumPy uint64 [16] (the driver's opaque 128 bytes). A box past column K is zero-filled by
    the hardware (never read by the kernels); L2 promotion 256 B. Raises RuntimeError with the driver's error."""
    from cuda.bindings import driver as drv
    N, K = (int(v) for v in w.shape)
    u64, u32 = drv.cuuint64_t, drv.cuuint32_t
    err, tm = drv.cuTensorMapEncodeTiled(
        drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, int(w.data.ptr), [u64(K), u64(N)], [u64(K)],
        [u32(128 * kpb), u32(ROW_TILE)], [u32(1), u32(1)], drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled for a [{N}, {K}] fp8 weight (box 16 x {128 * kpb}): {err}")
    return np.array([int(v) for v in tm.opaque], dtype=np.uint64)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_array(a, name: str, dtype, shape=None, align: int = 16):
    """Assert a CuPy array's dtype, C-contiguity, 16-byte alignment and (optional) shape; ValueError names it."""
    import cupy as cp
    _need(isinstance(a, cp.ndarray), f"{name}: expected a cupy.ndarray, got {type(a).__name__}")
    _need(a.dtype == np.dtype(dtype), f"{name}: expected dtype {np.dtype(dtype)}, got {a.dtype}")
    _need(a.flags.c_contiguous, f"{name}: must be C-contiguous")
    _need(a.data.ptr % align == 0, f"{name}: must be {align}-byte aligned (address {a.data.ptr:#x})")
    if shape is not None:
        _need(tuple(a.shape) == tuple(shape), f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")


def module(cfg: ModelConfig, defines: dict | None = None):
    """The compiled gemv.cu module for this config and extra ``QMK_*`` defines (cached per process)."""
    return load_module(cfg, SOURCES, defines)


class Gemv:
    """One projection ready to launch: y = W·x for M ≤ 8 activation rows, then an epilogue.

    ``w``: fp8 bits uint8 [N, K] with ``scale`` bf16 bits uint16 [ceil(N/128), K/128], or bf16 bits uint16
    [N, K] with ``scale=None`` (scale 1). N a multiple of 16, K of 128. ``epilogue``: "store" or "residual"
    (out [M, N]) or "swiglu" (fused [gate; up] weight of 2F rows, out [M, F]). ``split`` defaults to
    ``split_k(N, K)``. ``defines``: extra compile-time ``QMK_*`` knobs (e.g. QMK_GEMV_RING_MAX,
    QMK_GEMV_STAGES: docs/knobs.md; results do not depend on them). ``pdl``: launch through
    ``discrete.launch`` with programmatic stream serialization (may start while the previous kernel drains;
    same bits). ``norm_weight``: uint16 [K] (bf16 bits of a (1+w) RMSNorm weight): every call then takes the
    un-normed x and runs on RMSNorm(x) computed in the launch's prologue (bit-identical to ``qmk_rmsnorm_rows``
    followed by the plain GEMV); ``normed=`` [M, K] receives the normed rows. Raises ValueError naming the
    argument on any contract violation.
    """

    def __init__(self, cfg: ModelConfig, w, scale=None, *, epilogue: str = "store", split: int | None = None,
                 name: str = "gemv", defines: dict | None = None, pdl: bool = False, norm_weight=None):
        import cupy as cp
        _need(epilogue in EPILOGUES, f"{name}: epilogue {epilogue!r} not one of {sorted(EPILOGUES)}")
        _need(getattr(w, "ndim", 0) == 2, f"{name}.weight: expected a 2-D array [N, K]")
        N, K = (int(v) for v in w.shape)
        _need(N % ROW_TILE == 0 and N > 0, f"{name}.weight: N={N} must be a positive multiple of {ROW_TILE}")
        _need(K % K_BLOCK == 0 and K > 0, f"{name}.weight: K={K} must be a positive multiple of {K_BLOCK}")
        if w.dtype == np.uint8:
            check_array(w, f"{name}.weight (fp8 bits)", np.uint8)
            check_array(scale, f"{name}.weight_scale_inv (bf16 bits)", np.uint16, (-(-N // 128), K // 128), align=2)
            self.fp8 = True
        else:
            check_array(w, f"{name}.weight (bf16 bits)", np.uint16)
            _need(scale is None, f"{name}: a bf16 weight takes no scale")
            self.fp8 = False
        _need(epilogue != "swiglu" or N % (2 * ROW_TILE) == 0, f"{name}: swiglu needs 2F rows, F a multiple of 16")
        self.name, self.w, self.scale, self.N, self.K = name, w, scale, N, K
        self.epilogue, self.epi = epilogue, np.int32(EPILOGUES[epilogue])
        self.split = split_k(N, K) if split is None else int(split)
        dev = cp.cuda.Device()
        slices = gemv_slices(N, K, self.split, n_blocks=dev.attributes["MultiProcessorCount"])
        self.slices = cp.asarray(slices)
        warps = FP8_WARPS if self.fp8 else BF16_WARPS
        self.threads = 32 * warps
        self.n_out = N // 2 if epilogue == "swiglu" else N
        ring_max = int((defines or {}).get("QMK_GEMV_RING_MAX", RING_MAX))
        optin = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, dev.id)
        optin_all = int(optin)
        self.norm_weight = norm_weight
        xs_max = 0  # norm prologue: shared bytes of the normed rows, after the ring
        if norm_weight is not None:
            check_array(norm_weight, f"{name}.norm_weight (bf16 bits)", np.uint16, (K,), align=2)
            xs_max = MAX_ROWS * K * 2
            optin -= xs_max + NORM_STATIC_SMEM
        tasks = int((slices[:, 1] - slices[:, 0]).max())
        self.ring, self.smem = ring_depth(tasks, warps, int(optin), ring_max)
        self.counters = cp.zeros(self.n_out // ROW_TILE, cp.uint32)  # fused reduce: arrivals per output tile
        mod = module(cfg, {k: v for k, v in (defines or {}).items() if k not in PY_KNOBS})
        kind = "fp8" if self.fp8 else "bf16"
        kname = f"gemv_{kind}_norm_partial" if norm_weight is not None else f"gemv_{kind}_partial"
        raw = mod.get_function(kname)
        _allow_smem(raw, self.smem + xs_max)
        self.pdl = bool(pdl)
        self._partial = Kernel(raw, self.pdl, f"{name}.partial")
        # M = 1 (decode): the fp8 kernels' builds with M fixed at compile time. Kind "tma" (*_m1t1 / *_m1t2, the
        # TMA ring) for warp tasks of >= TMA_MIN_UNITS K-blocks and <= TMA_WARPS tasks per slice, "reg" (*_m1r,
        # the register-ring tile) otherwise; QMK_GEMV_M1 (benchmarks, tests): 0 = the general kernel, 1 = the
        # cp.async ring (*_m1, M1_RING slots), 2 = reg, 3 = tma, -1 (default) = the rule
        self._partial_m1 = None
        m1_knob = int((defines or {}).get("QMK_GEMV_M1", -1))
        units = (K // 128) // self.split
        self.m1_kind = None if not self.fp8 or m1_knob == 0 else \
            {1: "ring", 2: "reg", 3: "tma"}.get(
                m1_knob, "tma" if units >= TMA_MIN_UNITS and tasks <= TMA_WARPS else "reg")
        self.use_m1 = self.m1_kind is not None
        self.tmap, self.tma_warps = None, 0
        if self.m1_kind == "tma":
            kpb_knob = (defines or {}).get("QMK_GEMV_TMA_KPB")
            kpb, self.tma_warps = tma_plan(tasks, units, None if kpb_knob is None else int(kpb_knob))
            self.tmap = tensor_map(w, kpb)
            self.ring_m1, self.smem_m1 = TMA_RING, tma_smem(kpb, self.tma_warps)
            xs1 = K * 2 if norm_weight is not None else 0  # M = 1: one normed row (static: double red[20])
            _need(self.smem_m1 + xs1 + NORM_STATIC_SMEM <= optin_all,
                  f"{name}: the TMA ring needs {self.smem_m1 + xs1} B of shared memory, the device allows {optin_all}")
            raw1 = mod.get_function(f"{kname}_m1t{kpb}")
            _allow_smem(raw1, self.smem_m1 + xs1)
            self._partial_m1 = Kernel(raw1, self.pdl, f"{name}.partial_m1")
        elif self.use_m1:
            self.ring_m1, self.smem_m1 = ring_depth(tasks, warps, int(optin), M1_RING) if self.m1_kind == "ring" \
                else (0, 0)
            raw1 = mod.get_function(kname + ("_m1" if self.m1_kind == "ring" else "_m1r"))
            _allow_smem(raw1, self.smem_m1 + xs_max)
            self._partial_m1 = Kernel(raw1, self.pdl, f"{name}.partial_m1")
        self._reduce = Kernel(mod.get_function("gemv_reduce"), self.pdl, f"{name}.reduce")

    @property
    def weight_bytes(self) -> int:
        """Bytes streamed per call: the weight plus its scales."""
        return int(self.w.nbytes + (self.scale.nbytes if self.fp8 else 0))

    def partials_size(self, M: int = MAX_ROWS) -> int:
        """fp32 elements of the partials buffer for M rows: S · M · N."""
        return self.split * M * self.N

    def partial(self, x, partials, normed=None):
        """Launch the split-K GEMV: x uint16 [M, K] → view of ``partials`` (flat fp32, ≥ S·M·N) as [S, M, N].
        ``normed``: uint16 [M, K] for the normed rows (only with ``norm_weight``; None: not stored)."""
        M = self._check_x(x, normed)
        P = self._partials_view(partials, M)
        self._launch(x, P, -1, NULL, NULL, NULL, normed)
        return P

    def reduce(self, P, out, residual=None):
        """Launch the fixed-order reduce + epilogue: P fp32 [S, M, N] → out uint16 [M, n_out] (bf16 bits).
        ``residual`` uint16 [M, N] for the residual epilogue (may be ``out`` itself)."""
        check_array(P, f"{self.name}: partials", np.float32)
        _need(P.ndim == 3 and P.shape[0] == self.split and P.shape[2] == self.N,
              f"{self.name}: partials must be [{self.split}, M, {self.N}], got {tuple(P.shape)}")
        M = int(P.shape[1])
        self._check_out(out, residual, M)
        total = M * self.n_out
        n = np.int32
        self._reduce(((total + 255) // 256,), (256,),
                     (P, n(self.split), n(M), n(self.N), self.epi, residual if residual is not None else NULL, out))
        return out

    def __call__(self, x, out, partials, residual=None, fused: bool | None = None, normed=None):
        """partial + reduce: x uint16 [M, K], out uint16 [M, n_out], ``partials`` as for :meth:`partial`
        (scratch), ``residual`` as for :meth:`reduce`, ``normed`` as for :meth:`partial`. ``fused`` (default:
        M = 1 and S ≤ FUSE_MAX_SPLIT, where it measured faster) runs both in one launch (the last warp of each
        output tile reduces it); the bits are the same either way. Returns ``out``."""
        M = self._check_x(x, normed)
        if fused is None:
            fused = M == 1 and self.split <= FUSE_MAX_SPLIT
        if not fused:
            return self.reduce(self.partial(x, partials, normed), out, residual)
        P = self._partials_view(partials, M)
        self._check_out(out, residual, M)
        self._launch(x, P, int(self.epi), residual if residual is not None else NULL, out, self.counters, normed)
        return out

    def _launch(self, x, P, epi: int, residual, out, counters, normed=None):
        n = np.int32
        M = int(x.shape[0])
        head = (self.w, self.scale) if self.fp8 else (self.w,)
        m1 = M == 1 and self._partial_m1 is not None
        kernel, ring, smem = (self._partial_m1, self.ring_m1, self.smem_m1) if m1 else \
            (self._partial, self.ring, self.smem)
        if self.norm_weight is not None:  # x, RMSNorm weight, normed-rows store, byte offset of xs after the ring
            head += (x, self.norm_weight, normed if normed is not None else NULL, n(smem))
            smem += M * self.K * 2
        else:
            head += (x,)
        args = head + (n(M), n(self.N), n(self.K), n(self.split), self.slices, P, n(ring), n(epi),
                       residual, out, counters)
        threads = self.threads
        if m1 and self.tmap is not None:  # the TMA kernels: the weight's tensor map and the warps taking tasks
            args += (self.tmap, n(self.tma_warps))
            threads = 32 * TMA_WARPS
        kernel((len(self.slices),), (threads,), args, shared_mem=smem)

    def _check_x(self, x, normed=None) -> int:
        check_array(x, f"{self.name}: x (bf16 bits)", np.uint16)
        _need(x.ndim == 2 and x.shape[1] == self.K and 1 <= x.shape[0] <= MAX_ROWS,
              f"{self.name}: x must be [M, {self.K}] with 1 ≤ M ≤ {MAX_ROWS}, got {tuple(x.shape)}")
        if normed is not None:
            _need(self.norm_weight is not None, f"{self.name}: normed= given but the Gemv has no norm_weight")
            check_array(normed, f"{self.name}: normed (bf16 bits)", np.uint16, tuple(x.shape))
        return int(x.shape[0])

    def _check_out(self, out, residual, M: int) -> None:
        check_array(out, f"{self.name}: out (bf16 bits)", np.uint16, (M, self.n_out), align=4)
        if self.epilogue == "residual":
            check_array(residual, f"{self.name}: residual (bf16 bits)", np.uint16, (M, self.N), align=4)
        else:
            _need(residual is None, f"{self.name}: residual given for epilogue {self.epilogue!r}")

    def _partials_view(self, partials, M: int):
        check_array(partials, f"{self.name}: partials buffer", np.float32)
        need = self.partials_size(M)
        _need(partials.size >= need, f"{self.name}: partials buffer has {partials.size} floats, needs {need}")
        return partials.reshape(-1)[:need].reshape(self.split, M, self.N)


def _allow_smem(kernel, nbytes: int) -> None:
    """Raise a ``cupy.RawKernel``'s dynamic shared-memory limit to ``nbytes`` when above the 48 KB default."""
    if nbytes > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < nbytes:
        kernel.max_dynamic_shared_size_bytes = nbytes
