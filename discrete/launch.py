"""Kernel launches with Programmatic Dependent Launch (PDL, issue 5): a CuPy ``RawKernel`` launched through the
driver's ``cuLaunchKernelEx`` with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1`` on the current
CuPy stream, so that it may start while the previous kernel on the stream drains. Under stream capture the
launch becomes a programmatic edge of the captured CUDA graph.

Contract with the kernels (``discrete/kernels/*.cu`` wrappers): a kernel launched with PDL executes
``griddepcontrol.wait`` before it touches any buffer a predecessor writes or reads (only immutable data —
weights, scales, slice tables — may be touched before it), and may execute ``griddepcontrol.launch_dependents``
to let its successor be scheduled early. Correctness comes from the wait (transitively: a kernel's wait
returns only after its predecessor completed, and the predecessor completed only after its own wait), so the
results are the same bits with or without PDL; only start times move.

Arguments are packed as CuPy packs a ``RawKernel``'s: a device array → its data pointer (8 bytes), ``None`` →
a null pointer, a NumPy scalar → its bytes (np.int32 4, np.uint64 8, ...). Python ``int``/``float`` are
refused (their width would be a guess). When the driver can report the kernel's parameter layout
(``cuFuncGetParamInfo``, CUDA ≥ 12.4) the count and size of every argument are checked against it.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

PTR_BYTES = 8
_NULL = bytes(PTR_BYTES)


class LaunchError(ValueError):
    """An argument that cannot be packed, or does not match the kernel's parameter list."""


def _describe(a) -> str:
    return f"{type(a).__module__}.{type(a).__name__}"


def pack_arg(a, i: int, name: str) -> bytes:
    """Bytes of kernel argument ``i`` (see the module docstring). Raises LaunchError naming the kernel/index."""
    if a is None:
        return _NULL
    if isinstance(a, np.generic):
        if a.dtype.kind not in "biuf":
            raise LaunchError(f"{name}: argument {i} has NumPy dtype {a.dtype}; expected an integer or float scalar")
        return a.tobytes()
    ptr = getattr(getattr(a, "data", None), "ptr", None)  # cupy.ndarray: its data pointer
    if ptr is not None:
        return ptr.to_bytes(PTR_BYTES, "little")
    if isinstance(a, np.ndarray):
        raise LaunchError(f"{name}: argument {i} is a host NumPy array {a.shape}; "
                          f"pass a device array or a NumPy scalar")
    if isinstance(a, (bool, int, float)):
        raise LaunchError(f"{name}: argument {i} is a Python {type(a).__name__} ({a!r}); pass a NumPy scalar "
                          f"(np.int32, np.uint64, np.float32, ...) so that its width is explicit")
    ptr = getattr(a, "ptr", None) if type(a).__name__ == "MemoryPointer" else None
    if ptr is None:
        cai = getattr(a, "__cuda_array_interface__", None)
        ptr = cai["data"][0] if cai is not None else None
    if ptr is None:
        raise LaunchError(f"{name}: argument {i} of type {_describe(a)} is not a device array, None or NumPy scalar")
    return int(ptr).to_bytes(PTR_BYTES, "little")


def pack_args(args, name: str = "kernel") -> list[bytes]:
    """Bytes of every argument, in order."""
    if not isinstance(args, (tuple, list)):
        raise LaunchError(f"{name}: arguments must be a tuple or list, got {_describe(args)}")
    return [pack_arg(a, i, name) for i, a in enumerate(args)]


def check_sizes(blobs: list[bytes], param_sizes, name: str = "kernel") -> None:
    """Raise LaunchError unless the packed arguments match the kernel's parameter sizes (None: unknown, no check)."""
    if param_sizes is None:
        return
    if len(blobs) != len(param_sizes):
        raise LaunchError(f"{name}: {len(blobs)} arguments given, the kernel takes {len(param_sizes)}")
    for i, (b, n) in enumerate(zip(blobs, param_sizes)):
        if len(b) != n:
            raise LaunchError(f"{name}: argument {i} packs to {len(b)} bytes, the kernel's parameter {i} has {n}")


class ParamArray:
    """The ``void**`` array cuLaunchKernelEx takes: the arguments in one host buffer (8-byte aligned slots) and an
    array of their addresses. Keep the object alive until the launch call returns (the driver copies the values
    at launch)."""

    def __init__(self, blobs: list[bytes]):
        slots = [b if len(b) == 8 else b.ljust(-(-len(b) // 8) * 8, b"\0") for b in blobs]
        joined = b"".join(slots) or bytes(8)
        self.buffer = ctypes.create_string_buffer(joined, len(joined))
        addr, base = [], ctypes.addressof(self.buffer)
        for sl in slots:
            addr.append(base)
            base += len(sl)
        self.array = (ctypes.c_void_p * max(1, len(addr)))(*addr)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)


def _dim3(v, what: str, name: str) -> tuple[int, int, int]:
    t = (v,) if isinstance(v, (int, np.integer)) else tuple(v)
    if not 1 <= len(t) <= 3 or any(int(x) < 1 for x in t):
        raise LaunchError(f"{name}: {what} must be 1 to 3 positive integers, got {v!r}")
    t = tuple(int(x) for x in t)
    return t + (1,) * (3 - len(t))


def launch_config(grid, block, shared_mem: int, stream_ptr: int, pdl: bool = True, name: str = "kernel"):
    """A ``cuda.bindings.driver.CUlaunchConfig`` (grid, block, dynamic shared bytes, stream handle), with the
    programmatic-stream-serialization attribute when ``pdl``."""
    from cuda.bindings import driver as drv
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = _dim3(grid, "grid", name)
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = _dim3(block, "block", name)
    cfg.sharedMemBytes = int(shared_mem)
    cfg.hStream = drv.CUstream(int(stream_ptr))
    if pdl:
        at = drv.CUlaunchAttribute()
        at.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        at.value.programmaticStreamSerializationAllowed = 1
        cfg.attrs = [at]
        cfg.numAttrs = 1
    else:
        cfg.numAttrs = 0
    return cfg


def _check(res, what: str):
    """cuda-bindings calls return (CUresult, values...): raise RuntimeError on an error, else the values."""
    from cuda.bindings import driver as drv
    err, *vals = res if isinstance(res, tuple) else (res,)
    if err != drv.CUresult.CUDA_SUCCESS:
        _, msg = drv.cuGetErrorString(err)
        raise RuntimeError(f"{what}: {err.name}: {msg.decode() if isinstance(msg, bytes) else msg}")
    return vals[0] if len(vals) == 1 else vals


@functools.lru_cache(maxsize=None)
def param_sizes(func_handle: int) -> tuple[int, ...] | None:
    """Byte sizes of a CUfunction's parameters from ``cuFuncGetParamInfo`` (cached per handle); None when the
    driver cannot say."""
    from cuda.bindings import driver as drv
    if not hasattr(drv, "cuFuncGetParamInfo"):
        return None
    f, sizes = drv.CUfunction(int(func_handle)), []
    for i in range(4096):
        err, _off, size = drv.cuFuncGetParamInfo(f, i)
        if err == drv.CUresult.CUDA_ERROR_INVALID_VALUE:
            return tuple(sizes)
        if err != drv.CUresult.CUDA_SUCCESS:
            return None  # e.g. CUDA_ERROR_NOT_SUPPORTED on an old driver
        sizes.append(int(size))
    return None


class Kernel:
    """One kernel of a ``cupy.RawModule`` (``mod.get_function(name)``), launched with CuPy's own call when
    ``pdl`` is False (exactly the previous behaviour) and through ``cuLaunchKernelEx`` with programmatic stream
    serialization when True. ``raw`` keeps the RawKernel (attributes such as max_dynamic_shared_size_bytes
    belong to the CUfunction and apply to both paths). Everything the PDL path needs from the driver (function
    handle, parameter sizes) is resolved here, outside any stream capture."""

    def __init__(self, raw, pdl: bool = False, name: str | None = None):
        self.raw, self.pdl = raw, bool(pdl)
        self.name = name or getattr(raw, "name", "kernel")
        self._handle, self._sizes, self._configs = None, None, {}
        if self.pdl:
            try:
                import cuda.bindings.driver  # noqa: F401
            except ImportError as e:
                raise RuntimeError(f"{self.name}: pdl=True needs cuda-bindings (pip package cuda-python): "
                                   f"{e}") from None
            self._handle = int(raw.kernel.ptr)
            self._sizes = param_sizes(self._handle)

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        import cupy as cp
        # PDL pays off inside a captured graph (the step replays it); an eager launch through cuLaunchKernelEx
        # costs ~30 µs of Python against CuPy's ~8 µs, so uncaptured launches (prefill passes) take CuPy's path.
        # The kernels compute the same bits either way (griddepcontrol.wait is a no-op without the attribute).
        if not self.pdl or not cp.cuda.get_current_stream().is_capturing():
            self.raw(grid, block, args, shared_mem=shared_mem)
            return
        from cuda.bindings import driver as drv
        blobs = pack_args(args, self.name)
        check_sizes(blobs, self._sizes, self.name)
        params = ParamArray(blobs)
        key = (grid if isinstance(grid, int) else tuple(grid), block if isinstance(block, int) else tuple(block),
               int(shared_mem), cp.cuda.get_current_stream().ptr)
        cfg = self._configs.get(key)
        if cfg is None:  # a handful per kernel (one per grid/stream in use): built once, reused
            cfg = self._configs[key] = launch_config(*key, True, self.name)
        _check(drv.cuLaunchKernelEx(cfg, drv.CUfunction(self._handle), params.address, 0),
               f"{self.name}: cuLaunchKernelEx")


def kernels(module, names, pdl: bool = False) -> tuple[Kernel, ...]:
    """``Kernel`` wrappers of several functions of one module."""
    return tuple(Kernel(module.get_function(n), pdl, n) for n in names)
