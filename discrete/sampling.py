"""Sampling on the GPU (``kernels/sample.cu``): one token drawn from one row of bf16 logits already on the device,
with the rules of the host's sampler (``assembler/ref/sampling.sample``: temperature, then top-k, then top-p, then
the first id in ascending order whose cumulative probability exceeds u·Σp). The host passes u, its seeded
generator's next draw, so only the chosen id (and two small counters) crosses the bus instead of the 248,320
logits. Rounding points and the one place the draw can differ from the host's are in docs/sampling.md.

The launch is cooperative (every block resident; the blocks meet at grid barriers between passes), goes to the
current CuPy stream, and allocates nothing after construction.
"""
from __future__ import annotations

import numpy as np

from discrete.build import load_module
from loader.config import FIRST_PADDING_ID, ModelConfig

SOURCES = ("sample.cu",)
THREADS = 256                 # QMK_SAMPLE_THREADS
PER = 8                       # QMK_SAMPLE_PER: scores per thread, held in registers
SLICE = THREADS * PER
MAX_BLOCKS = 256              # QMK_SAMPLE_MAX_BLOCKS
MAX_IDS = 1 << 18             # the top-p tie search spans 18 id bits
WS_WORDS = 8 + 4 * MAX_BLOCKS + 13 * 256  # QMK_SAMPLE_WS_WORDS
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).smallest_subnormal)


def device_params(temperature: float, top_k: int | None, top_p: float | None) -> tuple:
    """The kernel's scalar arguments for host sampling parameters, exactly as ``filter_logits`` applies them:
    (temp f32, scale int32, top_k int32, top_p_thr f32, use_top_p int32). temperature > 0 (greedy decoding never
    samples); top_k None/0 = off; top_p None/1.0 = off. Raises ValueError for values the host sampler refuses."""
    if not (temperature is not None and temperature > 0):
        raise ValueError(f"device sampling: temperature must be > 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, (int, np.integer)) or top_k < 0):
        raise ValueError(f"device sampling: top_k must be an integer >= 0, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"device sampling: top_p must be in (0, 1], got {top_p!r}")
    temp = np.float32(min(max(float(temperature), _F32_TINY), _F32_MAX))
    use_p = top_p is not None and top_p < 1.0
    thr = np.float32(1 - top_p) if use_p else np.float32(0)
    return temp, np.int32(temperature != 1.0), np.int32(top_k or 0), thr, np.int32(use_p)


class DeviceSampler:
    """Draws tokens from rows of ``cfg.vocab_size`` bf16 logits on the device.

    ``sampler(logits, temperature, top_k, top_p, u)``: logits a CuPy uint16 [V] array (bf16 bits, C-contiguous;
    a row view of the step's logits buffer); u a float in [0, 1). Returns the chosen id (int, never a padding id:
    ids >= FIRST_PADDING_ID count as -inf). ``last`` holds (kept, fallback) of the latest draw. Raises
    ValueError naming a bad argument, RuntimeError if the kernel chose nothing (a kernel fault)."""

    def __init__(self, cfg: ModelConfig):
        import cupy as cp

        self.V = int(cfg.vocab_size)
        if self.V > MAX_IDS:
            raise ValueError(f"device sampling: vocab_size {self.V} exceeds {MAX_IDS}")
        self.blocks = -(-self.V // SLICE)
        if self.blocks > MAX_BLOCKS:
            raise ValueError(f"device sampling: {self.blocks} blocks exceed {MAX_BLOCKS}")
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        if self.blocks > sms:  # one block per SM at least must fit, or the grid barrier could never complete
            raise RuntimeError(f"device sampling: {self.blocks} blocks need {self.blocks} SMs, the GPU has {sms}")
        mod = load_module(cfg, SOURCES, {"QMK_SAMPLE_THREADS": THREADS, "QMK_SAMPLE_PER": PER}, cooperative=True)
        self._kernel = mod.get_function("qmk_sample")
        self.ws = cp.zeros(WS_WORDS, dtype=cp.uint64)
        self.out = cp.full(3, -1, dtype=cp.int32)
        self._host = np.empty(3, dtype=np.int32)
        self.last: tuple[int, int] = (0, 0)

    def launch(self, logits, temperature: float, top_k: int | None, top_p: float | None, u: float) -> None:
        """Queue one draw on the current stream (result in ``self.out``: id, kept, fallback)."""
        import cupy as cp

        if not (isinstance(logits, cp.ndarray) and logits.dtype == np.uint16 and logits.shape == (self.V,)
                and logits.flags.c_contiguous):
            raise ValueError(f"device sampling: logits must be a C-contiguous cupy uint16 array of shape "
                             f"({self.V},), got {type(logits).__name__} "
                             f"{getattr(logits, 'dtype', '?')} {getattr(logits, 'shape', '?')}")
        if not 0.0 <= u < 1.0:
            raise ValueError(f"device sampling: u must be in [0, 1), got {u!r}")
        temp, scale, k, thr, use_p = device_params(temperature, top_k, top_p)
        self.ws.fill(0)
        self.out.fill(-1)
        self._kernel((self.blocks,), (THREADS,), (logits, np.int32(self.V), np.int32(FIRST_PADDING_ID), temp,
                                                   scale, k, thr, use_p, np.float64(u), self.ws, self.out))

    def __call__(self, logits, temperature: float, top_k: int | None, top_p: float | None, u: float) -> int:
        import cupy as cp

        self.launch(logits, temperature, top_k, top_p, u)
        self.out.get(out=self._host, stream=cp.cuda.get_current_stream())
        cp.cuda.get_current_stream().synchronize()
        tok, kept, fallback = (int(v) for v in self._host)
        if not 0 <= tok < FIRST_PADDING_ID:
            raise RuntimeError(f"device sampling: the kernel chose no valid id (got {tok}, kept {kept})")
        self.last = (kept, fallback)
        return tok
