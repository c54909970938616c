"""The PDL launch helper (``discrete/launch.py``) without a GPU: argument packing as CuPy packs a RawKernel's
(pointers 8 bytes, NumPy scalars their own width), clear errors, the void** parameter array, the launch
config's attribute; and a source check that every discrete kernel wrapper waits for its predecessor (PDL)."""
import ctypes
import re
from pathlib import Path

import numpy as np
import pytest

from discrete import launch
from discrete.step import CATEGORIES, GEMV_CATEGORIES, pdl_categories

KERNELS = Path(launch.__file__).resolve().parent / "kernels"


class FakeDeviceArray:
    """Stands in for a cupy.ndarray: the helper reads .data.ptr."""

    class _Mem:
        def __init__(self, ptr):
            self.ptr = ptr

    def __init__(self, ptr):
        self.data = self._Mem(ptr)


class FakeCAI:
    """Any object exposing __cuda_array_interface__."""

    def __init__(self, ptr):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (4,), "typestr": "<f4", "version": 3}


def test_pack_pointer_scalars_and_null():
    blobs = launch.pack_args((FakeDeviceArray(0x7F0012345600), FakeCAI(0xABCDEF00), None, np.int32(-3),
                              np.uint64(2**63 + 5), np.int64(-1), np.float32(1.5), np.uint32(7), np.int16(-2)))
    assert blobs[0] == (0x7F0012345600).to_bytes(8, "little")
    assert blobs[1] == (0xABCDEF00).to_bytes(8, "little")
    assert blobs[2] == bytes(8)
    assert blobs[3] == np.int32(-3).tobytes() and len(blobs[3]) == 4
    assert blobs[4] == (2**63 + 5).to_bytes(8, "little")
    assert blobs[5] == b"\xff" * 8
    assert blobs[6] == np.float32(1.5).tobytes()
    assert [len(b) for b in blobs[7:]] == [4, 2]


@pytest.mark.parametrize("bad, why", [(3, "Python int"), (2.0, "Python float"), (True, "Python bool"),
                                      (np.zeros(3, np.int32), "host NumPy array"), ("x", "not a device array"),
                                      (np.complex64(1), "complex64")],
                         ids=["int", "float", "bool", "host-array", "str", "complex"])
def test_pack_refuses_ambiguous_arguments(bad, why):
    with pytest.raises(launch.LaunchError, match=f"k: argument 1 .*{why}"):
        launch.pack_args((np.int32(0), bad), "k")


def test_pack_refuses_non_sequence():
    with pytest.raises(launch.LaunchError, match="tuple or list"):
        launch.pack_args(np.int32(1), "k")


def test_check_sizes_against_kernel_parameters():
    blobs = launch.pack_args((FakeDeviceArray(16), np.int32(1), np.uint64(0)))
    launch.check_sizes(blobs, (8, 4, 8))
    launch.check_sizes(blobs, None)  # driver could not say: no check
    with pytest.raises(launch.LaunchError, match="3 arguments given, the kernel takes 4"):
        launch.check_sizes(blobs, (8, 4, 8, 8))
    with pytest.raises(launch.LaunchError, match="argument 1 packs to 4 bytes, the kernel's parameter 1 has 8"):
        launch.check_sizes(blobs, (8, 8, 8))


def test_param_array_points_at_each_argument():
    blobs = launch.pack_args((FakeDeviceArray(0x1000), np.int32(42), np.uint64(9)))
    pa = launch.ParamArray(blobs)
    ptrs = (ctypes.c_void_p * 3).from_address(pa.address)
    for p, b in zip(ptrs, blobs):
        assert ctypes.string_at(p, len(b)) == b
    assert launch.ParamArray([]).address != 0  # a kernel without parameters still gets a valid array


def test_launch_config_sets_programmatic_serialization():
    pytest.importorskip("cuda.bindings.driver")
    from cuda.bindings import driver as drv
    c = launch.launch_config((132,), (896,), 4096, 0xABC0, pdl=True)
    assert (c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY, c.blockDimZ) == (132, 1, 1, 896, 1, 1)
    assert c.sharedMemBytes == 4096 and int(c.hStream) == 0xABC0 and c.numAttrs == 1
    assert c.attrs[0].id == drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert c.attrs[0].value.programmaticStreamSerializationAllowed == 1
    c = launch.launch_config(7, (4, 2), 0, 0, pdl=False)
    assert (c.gridDimX, c.blockDimX, c.blockDimY, c.numAttrs) == (7, 4, 2, 0)
    for grid in ((), (0,), (1, 1, 1, 1)):
        with pytest.raises(launch.LaunchError, match="grid must be"):
            launch.launch_config(grid, (32,), 0, 0)


def test_pdl_categories():
    assert pdl_categories(False) == frozenset() and pdl_categories(True) == frozenset(CATEGORIES)
    assert pdl_categories("gemv") == frozenset(GEMV_CATEGORIES)
    assert pdl_categories(["norm", "mlp"]) == {"norm", "mlp"}
    with pytest.raises(ValueError, match="pdl category 'mlpp'"):
        pdl_categories(["mlpp"])


def _body_at(text: str, i: int) -> str:
    """The brace-balanced block starting at the first "{" at or after index i."""
    i = text.index("{", i)
    depth, j = 0, i
    while True:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
        if depth == 0:
            return text[i:j]


def _globals(text: str):
    """(name, body) of every extern "C" __global__ function in a .cu source. A wrapper whose body only forwards
    to a ``*_body`` device function of the same file (the M = 1 builds of gemv.cu) is given that function's body."""
    for m in re.finditer(r'extern "C" __global__ void(?:\s+__launch_bounds__\([^)]*\))?\s+(\w+)\s*\(', text):
        body = _body_at(text, m.end())
        fwd = re.fullmatch(r"\{\s*(\w+_body)\s*<[^>]*>\s*\([^;]*\);\s*\}", body)
        if fwd:
            d = re.search(r"\bvoid\s+" + fwd.group(1) + r"\s*\(", text)
            assert d, f"{m.group(1)} forwards to {fwd.group(1)}, not defined in the same file"
            body = _body_at(text, d.end())
        yield m.group(1), body


def test_kernel_call_path_with_a_stub_driver(monkeypatch):
    """Kernel.__call__ with pdl=True end to end, the driver replaced by a recorder: the CUfunction handle, the
    current stream, the attribute and every packed argument reach cuLaunchKernelEx; pdl=False calls CuPy's own
    launch unchanged, and so does pdl=True outside a stream capture."""
    drv = pytest.importorskip("cuda.bindings.driver")
    cp = pytest.importorskip("cupy")
    seen = {}

    def fake_launch(cfg, f, params, extra):
        sizes = (8, 4, 8)
        ptrs = (ctypes.c_void_p * 3).from_address(params)
        seen.update(cfg=cfg, f=int(f), extra=extra, args=[ctypes.string_at(p, n) for p, n in zip(ptrs, sizes)])
        return (drv.CUresult.CUDA_SUCCESS,)

    class Raw:
        name = "stub"

        class kernel:  # noqa: N801 - mimics RawKernel.kernel (a cupy.cuda.function.Function)
            ptr = 0xF00D

        def __call__(self, grid, block, args, shared_mem=0):
            seen["cupy"] = (grid, block, args, shared_mem)

    class Stream:
        ptr = 0x5EED
        capturing = True

        def is_capturing(self):
            return self.capturing

    stream = Stream()
    monkeypatch.setattr(launch, "param_sizes", lambda h: (8, 4, 8))
    monkeypatch.setattr(drv, "cuLaunchKernelEx", fake_launch)
    monkeypatch.setattr(cp.cuda, "get_current_stream", lambda: stream)
    k = launch.Kernel(Raw(), pdl=True)
    k((5, 2), (128,), (FakeDeviceArray(0xABC0), np.int32(9), None), shared_mem=64)
    c = seen["cfg"]
    assert seen["f"] == 0xF00D and seen["extra"] == 0 and int(c.hStream) == 0x5EED
    assert (c.gridDimX, c.gridDimY, c.blockDimX, c.sharedMemBytes, c.numAttrs) == (5, 2, 128, 64, 1)
    assert seen["args"] == [(0xABC0).to_bytes(8, "little"), np.int32(9).tobytes(), bytes(8)]
    with pytest.raises(launch.LaunchError, match="stub: argument 1 packs to 8 bytes"):
        k((1,), (32,), (None, np.int64(1), None))
    monkeypatch.setattr(drv, "cuLaunchKernelEx", lambda *a: (drv.CUresult.CUDA_ERROR_INVALID_VALUE,))
    monkeypatch.setattr(drv, "cuGetErrorString", lambda e: (drv.CUresult.CUDA_SUCCESS, b"invalid argument"))
    with pytest.raises(RuntimeError, match="stub: cuLaunchKernelEx: CUDA_ERROR_INVALID_VALUE: invalid argument"):
        k((1,), (32,), (None, np.int32(1), None))
    plain = launch.Kernel(Raw(), pdl=False)
    plain((3,), (64,), (1, 2), shared_mem=8)
    assert seen["cupy"] == ((3,), (64,), (1, 2), 8)
    # pdl=True outside a stream capture (eager prefill passes): CuPy's cheaper launch, same kernel
    stream.capturing = False
    seen.clear()
    k((4,), (32,), (1, 2), shared_mem=16)
    assert seen == {"cupy": ((4,), (32,), (1, 2), 16)}
