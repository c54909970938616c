"""All weights of the decode step on the GPU, in the engine's fused layouts (DESIGN.md "Weights stay in the
checkpoint's byte order"; the fusions of ``assembler/graph.py`` and ``assembler.ref.model.proj_splits``).

Fused matrices are the stored matrices concatenated by rows, fp8 payload and bf16 block scales alike (every
part's row count is a multiple of 128, so scale rows concatenate too):
  GDN layer   ``in``  = in_proj_qkv | in_proj_z  [conv_dim + value_dim, H];  ``ba`` = in_proj_b | in_proj_a
              [2·n_v, H] bf16 (views ``b``, ``a``); ``out`` = out_proj; conv1d as [conv_dim, 4]
  attention   ``in``  = q_proj | k_proj | v_proj  [q_rows + 2·kv_rows, H];  ``out`` = o_proj
  every layer ``gate_up`` = gate_proj | up_proj  [2F, H];  ``down`` = down_proj
CuPy has no bf16/fp8 dtypes: bf16 tensors are ``uint16`` bit patterns, fp8 e4m3 payloads ``uint8``.
MTP tensors are not loaded (the decode graph does not use them).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loader.checkpoint import FP8, SCALE_SUFFIX, expected_tensors
from loader.config import FULL, ModelConfig
from loader.staging import StagedUpload, Transfer


@dataclass
class Proj:
    """A (fused) projection on the device: ``w`` uint8 [N, K] (fp8 bits) with ``scale`` uint16 [N/128, K/128]
    (bf16 bits), or ``w`` uint16 [N, K] (bf16 bits) with ``scale=None``. ``parts``: canonical names, in row order;
    ``rows``: row offset of each part plus the total."""
    w: object
    scale: object
    parts: tuple[str, ...]
    rows: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(self.w.nbytes + (0 if self.scale is None else self.scale.nbytes))


class WeightsGPU:
    """Every tensor of one decode step on the device. Build with :meth:`from_source` (a WeightSource, uploaded
    tensor by tensor) or :meth:`from_synthetic` (filled on the device by ``discrete.synthetic_gpu``).

    Attributes: ``cfg``; ``embed`` [V, H], ``final_norm`` [H], ``lm_head`` [V, H] (uint16); ``layers``: one dict
    per layer with ``in_norm``, ``post_norm`` (uint16 [H]), ``in``, ``out``, ``gate_up``, ``down`` (:class:`Proj`),
    and for GDN layers ``ba`` (uint16 [2n_v, H]), ``b``, ``a`` (views), ``conv_w`` [conv_dim, 4], ``A_log``,
    ``dt_bias`` [n_v], ``norm`` [d_v]; for attention layers ``q_norm``, ``k_norm`` [head_dim]."""

    load_stats: dict | None = None  # from_source's upload statistics (loader.staging.StagedUpload.run)

    def __init__(self, cfg: ModelConfig, fill):
        """``fill(name, out, scale_out)`` writes tensor ``name`` (stored shape) into device views ``out`` (and its
        fp8 scales into ``scale_out``). Use the classmethods."""
        import cupy as cp
        self.cfg = cfg
        self._exp = expected_tensors(cfg)
        self._fill = fill
        self.fp8 = cfg.quant_method is not None
        H = cfg.hidden_size
        self.embed = self._vec("model.embed_tokens.weight")
        self.final_norm = self._vec("model.norm.weight")
        self.lm_head = self._vec("lm_head.weight")
        self.layers = []
        for i, kind in enumerate(cfg.layer_types):
            p = f"model.layers.{i}."
            L = {"in_norm": self._vec(p + "input_layernorm.weight"),
                 "post_norm": self._vec(p + "post_attention_layernorm.weight"),
                 "gate_up": self._proj([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                 "down": self._proj([p + "mlp.down_proj.weight"])}
            if kind == FULL:
                a = p + "self_attn."
                L["in"] = self._proj([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"])
                L["out"] = self._proj([a + "o_proj.weight"])
                L["q_norm"], L["k_norm"] = self._vec(a + "q_norm.weight"), self._vec(a + "k_norm.weight")
            else:
                a = p + "linear_attn."
                nv = cfg.linear_num_value_heads
                L["in"] = self._proj([a + "in_proj_qkv.weight", a + "in_proj_z.weight"])
                L["out"] = self._proj([a + "out_proj.weight"])
                ba = cp.empty((2 * nv, H), cp.uint16)
                fill(a + "in_proj_b.weight", ba[:nv], None)
                fill(a + "in_proj_a.weight", ba[nv:], None)
                L["ba"], L["b"], L["a"] = ba, ba[:nv], ba[nv:]
                L["conv_w"] = self._vec(a + "conv1d.weight").reshape(cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim)
                for n in ("A_log", "dt_bias"):
                    L[n] = self._vec(a + n)
                L["norm"] = self._vec(a + "norm.weight")
            self.layers.append(L)
        cp.cuda.Device().synchronize()

    # ------------------------------------------------------------------ builders
    def _vec(self, name: str):
        import cupy as cp
        shape, dtype = self._exp[name]
        if dtype == FP8:
            raise ValueError(f"weights_gpu: {name} is fp8; expected a bf16 tensor")
        out = cp.empty(shape, cp.uint16)
        self._fill(name, out, None)
        return out

    def _proj(self, names: list[str]) -> Proj:
        import cupy as cp
        shapes = [self._exp[n][0] for n in names]
        fp8 = self._exp[names[0]][1] == FP8
        K = shapes[0][1]
        if any(s[1] != K for s in shapes) or any((self._exp[n][1] == FP8) != fp8 for n in names):
            raise ValueError(f"weights_gpu: cannot fuse {names}: shapes {shapes} / dtypes differ")
        rows = [0]
        for s in shapes:
            rows.append(rows[-1] + s[0])
        if fp8 and any(r % 128 for r in rows):
            raise ValueError(f"weights_gpu: fused fp8 rows {rows} of {names} must be multiples of 128")
        w = cp.empty((rows[-1], K), cp.uint8 if fp8 else cp.uint16)
        scale = cp.empty((rows[-1] // 128, K // 128), cp.uint16) if fp8 else None
        for n, r0, r1 in zip(names, rows[:-1], rows[1:]):
            self._fill(n, w[r0:r1], scale[r0 // 128:r1 // 128] if fp8 else None)
        return Proj(w, scale, tuple(names), tuple(rows))

    @property
    def nbytes(self) -> int:
        """Device bytes held (all tensors)."""
        n = self.embed.nbytes + self.final_norm.nbytes + self.lm_head.nbytes
        for L in self.layers:
            for k, v in L.items():
                if isinstance(v, Proj):
                    n += v.nbytes
                elif k not in ("a", "b"):
                    n += v.nbytes
        return int(n)

    # ------------------------------------------------------------------ sources
    @classmethod
    def from_source(cls, src, *, pipeline: bool = True, progress: str | None = None,
                    buffers: int | None = None, buffer_bytes: int | None = None) -> "WeightsGPU":
        """Upload from a WeightSource (``loader.checkpoint.Checkpoint`` or ``SyntheticWeights``).

        ``pipeline`` True: every device buffer is allocated first (a dry pass records each tensor's destination),
        then ``loader.staging.StagedUpload`` reads the tensors in file order into ``buffers`` pinned host buffers of
        ``buffer_bytes`` (None: ``loader.staging``'s defaults, 3 × 128 MiB) on a reader thread while this thread
        copies the filled ones to the device on a stream (host RAM holds the ring); ``progress`` (a label) shows a
        bar of the bytes with the rate on stderr when it is a terminal; ``load_stats`` then holds the upload's
        statistics. ``pipeline`` False: one tensor at a time from pageable memory (host RAM holds one tensor).
        Raises ValueError naming the tensor (and file) on a dtype/shape mismatch or a short read
        (``loader.staging.UploadError``); a failed load frees the device memory it allocated."""
        if not pipeline:
            return cls(src.config, _serial_fill(src))
        import cupy as cp
        jobs: list[Transfer] = []

        def record(name, out, scale_out):
            for n, o in ((name, out), (name + SCALE_SUFFIX, scale_out)):
                if o is not None:
                    if not o.flags.c_contiguous:
                        raise ValueError(f"weights_gpu: destination of {n} is not contiguous")
                    jobs.append(Transfer(n, tuple(o.shape), np.dtype(o.dtype), o))
        w = cls.__new__(cls)
        up = None
        try:
            w.__init__(src.config, record)
            up = StagedUpload(src, jobs, _CupyStaging(cp), buffers=buffers, buffer_bytes=buffer_bytes,
                              progress=progress)
            w.load_stats = up.run()
        except BaseException:
            w.__dict__.clear()  # the traceback keeps these frames: drop their device arrays
            jobs.clear()
            if up is not None:
                up.transfers.clear()
            cp.get_default_memory_pool().free_all_blocks()
            raise
        w._fill = None
        return w

    @classmethod
    def from_synthetic(cls, syn) -> "WeightsGPU":
        """Materialise a ``loader.synthetic.SyntheticWeights`` directly on the device (same bits as its
        ``get``; seconds for the 27B)."""
        from discrete.synthetic_gpu import fill as gfill

        def fill(name, out, scale_out):
            if scale_out is None:
                gfill(syn, name, out=out)
            else:
                gfill(syn, name, out=out, scale_out=scale_out)
        return cls(syn.config, fill)


def _serial_fill(src):
    """The fill of the serial upload: ``src.get`` then a synchronous copy from pageable memory, per tensor."""
    def fill(name, out, scale_out):
        a = np.asarray(src.get(name))
        bits = np.ascontiguousarray(a).view(np.uint8 if a.dtype.itemsize == 1 else np.uint16)
        if bits.shape != tuple(out.shape) or np.dtype(out.dtype) != bits.dtype:
            raise ValueError(f"weights_gpu: {name}: source gives {a.dtype} {a.shape}, expected "
                             f"{'fp8' if out.dtype == np.uint8 else 'bf16'} {tuple(out.shape)}")
        out.set(bits)
        if scale_out is not None:
            s = np.ascontiguousarray(np.asarray(src.get(name + SCALE_SUFFIX))).view(np.uint16)
            if s.shape != tuple(scale_out.shape):
                raise ValueError(f"weights_gpu: {name + SCALE_SUFFIX}: shape {s.shape}, expected {scale_out.shape}")
            scale_out.set(s)
    return fill


class _CupyStaging:
    """The device of ``loader.staging.StagedUpload`` on CuPy: page-locked host buffers (cudaHostAlloc, freed
    explicitly), async host-to-device copies on one non-blocking stream, an event per filled buffer."""

    def __init__(self, cp):
        self.cp, self.rt = cp, cp.cuda.runtime
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._ptrs: dict[int, int] = {}  # id(buffer) -> host pointer

    def host_buffer(self, nbytes: int) -> np.ndarray:
        import ctypes
        ptr = self.rt.hostAlloc(nbytes, 0)
        buf = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        self._ptrs[id(buf)] = ptr
        return buf

    def free_host_buffer(self, buf: np.ndarray) -> None:
        self.rt.freeHost(self._ptrs.pop(id(buf)))

    def copy(self, dest, offset: int, view: np.ndarray) -> None:
        self.rt.memcpyAsync(dest.data.ptr + offset, view.ctypes.data, view.nbytes, self.rt.memcpyHostToDevice,
                            self.stream.ptr)

    def record(self):
        ev = self.cp.cuda.Event(disable_timing=True)
        ev.record(self.stream)
        return ev

    def done(self, ev) -> bool:
        return ev.done

    def wait(self, ev) -> None:
        ev.synchronize()

    def sync(self) -> None:
        self.stream.synchronize()
