"""The program options: the one place that says which instruction program a step runs.

``PROGRAM`` is the program the GPU runs (the megakernel runner's default). The scheduler's ``assemble``, the CPU
VM executor (``cpu-vm``), the megakernel runner, ``qwen-mk inspect``, ``tools/mk_variants.py`` and the
benchmarks take their defaults from it, so the CPU VM's program is the GPU's, and ``inspect`` prints which
options it used. The discrete (CUDA-graph) path runs no program: it launches one kernel per op (its own
split-K reduce rule: ``discrete/gemv.py`` FUSE_MAX_SPLIT) and shares the work partition with the program, not
these options; its graph (``verify_graph(cfg, MAX_ROWS)``) only sizes the buffers.

Each option changes the program's form, never a result (the bit-identity tests of tests/gpu compare every form
with the graph path, and the CPU VM tests compare them with the NumPy reference):

* ``fuse_reduce``: split-K reduces folded into the GEMV instructions (the last arriving warp of a tile reduces
  it) instead of separate GEMV_REDUCE instructions. Off: the fused tail measured slower in the megakernel.
* ``defer_reduce``: in 1-row programs, residual split-K reduces happen in the consumers' prologues
  (``graph.defer_reduces``). Never for M > 1 rows: every consumer instruction would re-read S·M·K partials
  (M = 8, 27B: ≈ 1.3 MB each), so verify programs keep GEMV_REDUCE (``for_rows``).
* ``local_reduce``: split-K in-projections reduced on their own instructions in shared memory.
* ``mlp_groups``: gate|up rows grouped per down split, each down split waiting only on its group
  (``graph._mlp``). Off: not yet measured faster on the H200.
* ``gdn_split``: GDN_STEP instructions split over that many value-head parts (``megakernel.runner.split_gdn``);
  None: one part per value head (``cfg.gdn_head_group``, measured faster on the 27B); 1: as assembled.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ProgramOptions:
    """The form of an assembled program (module docstring). Frozen; ``dataclasses.replace`` makes variants.
    Raises ValueError for ``gdn_split`` < 1."""

    fuse_reduce: bool = False
    defer_reduce: bool = True
    local_reduce: bool = True
    mlp_groups: bool = False
    gdn_split: int | None = None

    def __post_init__(self):
        if self.gdn_split is not None and int(self.gdn_split) < 1:
            raise ValueError(f"ProgramOptions: gdn_split={self.gdn_split}; expected None or ≥ 1")

    def for_rows(self, m: int) -> "ProgramOptions":
        """The options of an ``m``-row program: ``defer_reduce`` only where m == 1 (module docstring)."""
        return dataclasses.replace(self, defer_reduce=bool(self.defer_reduce and m == 1))

    def gdn_parts(self, cfg) -> int:
        """GDN_STEP parts for ``cfg`` (a ModelConfig): ``gdn_split``, or the value heads per key head when None."""
        return int(cfg.gdn_head_group if self.gdn_split is None else self.gdn_split)

    def as_dict(self, cfg=None) -> dict:
        """The options as a JSON-ready dict; with ``cfg``, ``gdn_split`` resolved to its part count."""
        d = dataclasses.asdict(self)
        if cfg is not None:
            d["gdn_split"] = self.gdn_parts(cfg)
        return d


PROGRAM = ProgramOptions()  # the program the GPU runs (megakernel runner default); use PROGRAM.for_rows(m)
