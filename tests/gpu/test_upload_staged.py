"""The staged upload on the device (``WeightsGPU.from_source``: pinned ring, async copies, events): bit-identical to
the serial upload and to the weights drawn on the device, whatever the ring; a load that fails part-way (a shard cut
short after it was opened) raises naming the file and tensor and leaves no device memory in use."""
from __future__ import annotations

import os
import shutil

import pytest

from loader.checkpoint import Checkpoint
from loader.staging import UploadError
from loader.synthetic import SyntheticWeights, ensure_checkpoint


def _tensors(w) -> dict:
    from bench.bench_load import device_tensors
    return device_tensors(w)


def _first_diff(wa, wb) -> str | None:
    import cupy as cp
    ta, tb = _tensors(wa), _tensors(wb)
    assert list(ta) == list(tb)
    for n, a in ta.items():
        if a.shape != tb[n].shape or a.dtype != tb[n].dtype or not bool(cp.array_equal(a, tb[n])):
            return n
    return None


@pytest.fixture(scope="module")
def tiny_dir():
    return ensure_checkpoint("tiny", seed=0)


@pytest.mark.parametrize("buffers,buffer_bytes", [(1, 1 << 20), (2, (3 << 20) - 12345), (3, 128 << 20)])
def test_staged_equals_serial_and_device_drawn(tiny_dir, buffers, buffer_bytes):
    """Every device tensor of the staged upload equals the serial upload's and from_synthetic's, bit for bit.
    Control: a tensor changed by one bit is reported."""
    import cupy as cp
    from discrete.weights_gpu import WeightsGPU
    ck = Checkpoint.open(tiny_dir)
    staged = WeightsGPU.from_source(ck, buffers=buffers, buffer_bytes=buffer_bytes)
    serial = WeightsGPU.from_source(ck, pipeline=False)
    drawn = WeightsGPU.from_synthetic(SyntheticWeights(ck.config, 0))
    assert staged.load_stats["bytes"] == staged.nbytes and staged.load_stats["buffers"] <= buffers
    assert _first_diff(staged, serial) is None
    assert _first_diff(staged, drawn) is None
    L = staged.layers[1]["gate_up"].w
    L[-1, -1] ^= cp.uint8(1)  # negative control
    assert _first_diff(staged, serial) == "layers.1.gate_up.w"


def test_failed_staged_load_names_the_tensor_and_frees_device_memory(tiny_dir, tmp_path):
    """A shard cut short after the headers were checked: UploadError naming the shard, the tensor and 'truncated';
    the pool's bytes in use are back where they were. Control: the intact copy loads."""
    import cupy as cp
    from discrete.weights_gpu import WeightsGPU
    d = tmp_path / "ck"
    shutil.copytree(tiny_dir, d)
    ck = Checkpoint.open(d)
    last = max((n for n in ck.names() if not n.startswith("mtp.")), key=lambda n: ck.byte_range(n)[2])
    f, b, e = ck.byte_range(last)
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    used = pool.used_bytes()
    ok = WeightsGPU.from_source(ck, buffers=2, buffer_bytes=1 << 20)
    assert pool.used_bytes() > used
    del ok
    assert pool.used_bytes() == used
    os.truncate(f, (b + e) // 2)
    with pytest.raises(UploadError) as err:
        WeightsGPU.from_source(ck, buffers=2, buffer_bytes=1 << 20)
    msg = str(err.value)
    assert "truncated" in msg and str(f) in msg and repr(last) in msg, msg
    err = None
    cp.cuda.Device().synchronize()
    assert pool.used_bytes() == used
