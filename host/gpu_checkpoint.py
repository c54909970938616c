"""Synthetic checkpoints drawn on the GPU: each tensor is filled in device memory by ``discrete.synthetic_gpu``
(the same bits as ``loader.synthetic.SyntheticWeights.get``), copied to the host and streamed into its shard by
``loader.synthetic.write_checkpoint`` (``generate=gpu_chunks``), so the disk, not the generator, sets the pace.
``qwen-mk make-checkpoint --device gpu`` (the default where a GPU is usable) and ``bench/bench_load.py`` use it.

One tensor is on the device and on the host at a time (the largest, the embedding and lm_head tables of the 27B,
are 2.5 GB each); an fp8 weight's block scales are kept on the host until the scale tensor's turn in the shard
(it follows its weight).
"""
from __future__ import annotations

from host.executors import gpu_available
from loader.checkpoint import SCALE_SUFFIX


def gpu_chunks(src, names: list[str], fill=None):
    """The bytes of tensors ``names`` of ``src`` (a ``SyntheticWeights``) in that order, each as a host NumPy array
    of raw bits (uint16 for bf16 and scales, uint8 for fp8 payloads). ``fill(src, name)`` draws a tensor on the
    device and returns an array with ``.get()`` (for an fp8 weight a pair (payload, scale)); None =
    ``discrete.synthetic_gpu.fill``. Raises ValueError for a scale whose weight does not come before it."""
    if fill is None:
        from discrete.synthetic_gpu import fill  # lazy: the GPU side stays off every CLI start (make-checkpoint)
    scales: dict = {}
    for n in names:
        if n.endswith(SCALE_SUFFIX):
            if n not in scales:
                raise ValueError(f"gpu_chunks: scale {n!r} comes before its weight {n[:-len(SCALE_SUFFIX)]!r}")
            yield scales.pop(n)
            continue
        r = fill(src, n)
        if isinstance(r, tuple):
            q, s = r
            scales[n + SCALE_SUFFIX] = s.get()
            yield q.get()
        else:
            yield r.get()


def gpu_usable() -> tuple[bool, str]:
    """(True, device name) when the GPU generator can run here, else (False, why): ``host.executors.gpu_available``."""
    return gpu_available()
