"""DeviceState (discrete/device_state.py) on the CPU, and the interface the megakernel, the prefill and the executors
use to reach a DecodeStep.

CuPy cannot allocate without a GPU, so the host logic runs against a NumPy-backed stand-in for the few CuPy calls
the class makes (``empty`` / ``zeros`` / ``full``, ``.set`` / ``.get`` / ``.fill``, ``cuda.Stream``), which also
records every allocation: the order and sizes of the session's device memory are checked, as are the control
block's words after each host call. The interface checks read the sources (AST): the megakernel and the prefill
touch only the step's public names, and every name other code imports from ``megakernel.runner`` exists there.
"""
from __future__ import annotations

import ast
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from assembler.numerics import MAX_ROWS
from discrete.control import CONTROL_DTYPE
from discrete.device_state import POISON, DeviceState
from discrete.gdn import CONV_RING
from loader.config import FIRST_PADDING_ID, preset
from tests.helpers import FakeStream

ROOT = Path(__file__).resolve().parents[2]


class _Arr(np.ndarray):
    """A NumPy array with the CuPy methods DeviceState and PagedKVCache call."""

    def set(self, a, stream=None):
        self[...] = np.asarray(a).reshape(self.shape)

    def get(self, stream=None, out=None):
        return np.asarray(self).copy()

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


@pytest.fixture
def fake_cupy(monkeypatch):
    """A ``cupy`` module backed by NumPy; ``.allocs`` lists (kind, shape, dtype) of every allocation in order."""
    cp = types.ModuleType("cupy")
    cp.allocs = []

    def alloc(kind, fill=None):
        def f(shape, *args, dtype=None):
            if kind == "full":
                fill_value, dt = args[0], dtype if dtype is not None else (args[1] if len(args) > 1 else None)
                a = np.full(shape, fill_value, dt)
            else:
                a = np.zeros(shape, dtype if dtype is not None else (args[0] if args else np.float64))
                if kind == "empty":
                    a.view(np.uint8)[...] = 0xA5  # garbage, as device memory would be
            cp.allocs.append((kind, tuple(np.atleast_1d(shape).tolist()), a.dtype.name))
            return a.view(_Arr)
        return f

    cp.empty, cp.zeros, cp.full = alloc("empty"), alloc("zeros"), alloc("full")
    for n in ("uint8", "uint16", "uint32", "int32", "int64", "uint64", "float32"):
        setattr(cp, n, getattr(np, n))
    cp.ndarray = _Arr
    cp.cuda = types.SimpleNamespace(Stream=FakeStream)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    return cp


def _layout_errors(arena_bytes: int, base: int, views: dict) -> list[str]:
    """Problems of arena views (name → array): outside the arena, not 256-byte aligned, or overlapping."""
    errs, spans = [], []
    for name, v in views.items():
        lo = v.__array_interface__["data"][0] - base
        hi = lo + v.nbytes
        if lo < 0 or hi > arena_bytes:
            errs.append(f"{name} outside the arena")
        if lo % 256:
            errs.append(f"{name} at {lo}, not 256-byte aligned")
        spans.append((lo, hi, name))
    spans.sort()
    for (_, h0, n0), (l1, _, n1) in zip(spans, spans[1:]):
        if l1 < h0:
            errs.append(f"{n0} overlaps {n1}")
    return errs


@pytest.mark.parametrize("name", ["tiny", "qwen3.5-27b"])
def test_allocations_in_order_with_the_graph_sizes(fake_cupy, name):
    cfg = preset(name)
    st = DeviceState(cfg, 300, debug_logits=True)
    kinds = [a[0] for a in fake_cupy.allocs]
    nlin = len(cfg.linear_layers)
    pages = -(-300 // 256)
    # arena, split-K scratch, recurrent states, conv rings, KV pool, page table, control block: in that order
    assert kinds == ["empty", "empty"] + ["zeros"] * (2 * nlin) + ["zeros", "full", "zeros"], kinds
    assert fake_cupy.allocs[0][2] == "uint8" and fake_cupy.allocs[1][2] == "float32"
    assert fake_cupy.allocs[2:2 + nlin] == [("zeros", (cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                                                       cfg.linear_key_head_dim), "float32")] * nlin
    assert fake_cupy.allocs[2 + nlin:2 + 2 * nlin] == [("zeros", (CONV_RING, cfg.gdn_conv_dim), "uint16")] * nlin
    assert fake_cupy.allocs[-3] == ("zeros", (pages, len(cfg.full_layers), 2, cfg.num_key_value_heads, 256,
                                              cfg.head_dim), "uint16")
    assert fake_cupy.allocs[-2] == ("full", (pages,), "int32")
    assert fake_cupy.allocs[-1] == ("zeros", (CONTROL_DTYPE.itemsize // 4,), "uint32")
    # every activation buffer of the graph, the normed inputs and hn; each in its own aligned slot of the arena
    acts = {b.name for b in st.graph.buffers.values() if b.kind == "act"}
    normed = {f"xn.{i}" for i in range(cfg.num_hidden_layers)} | {f"xn.{i}.post" for i in range(cfg.num_hidden_layers)}
    assert set(st.buf) == acts | normed | {"hn"}
    for n, b in st.graph.buffers.items():
        if b.kind == "act":
            assert st.buf[n].shape == tuple(b.shape) and st.buf[n].dtype == (np.uint16 if b.dtype == "bf16" else np.int32)
    base = st.arena.__array_interface__["data"][0]
    assert _layout_errors(st.arena.nbytes, base, st.buf) == []
    assert st.arena.nbytes - max(v.__array_interface__["data"][0] - base + v.nbytes for v in st.buf.values()) < 256
    assert st.sess.pages == list(range(pages))  # all pages of the capacity reserved at start-up


def test_layout_check_catches_overlap_and_misalignment():
    """Negative control of _layout_errors: planted overlapping / misaligned / outside views are reported."""
    arena = np.zeros(4096, np.uint8)
    base = arena.__array_interface__["data"][0]
    assert _layout_errors(4096, base, {"a": arena[0:512], "b": arena[512:1024]}) == []
    errs = _layout_errors(4096, base, {"a": arena[0:512], "b": arena[256:768], "c": arena[1000:1100]})
    assert any("overlaps" in e for e in errs) and any("c at 1000" in e for e in errs)
    assert _layout_errors(1024, base, {"a": arena[768:1280]}) == ["a outside the arena"]


def test_logits_only_with_debug_logits(fake_cupy):
    assert "logits" not in DeviceState(preset("tiny"), 64).buf
    assert "logits" in DeviceState(preset("tiny"), 64, debug_logits=True).buf


def _ctrl(st) -> np.ndarray:
    return np.frombuffer(np.asarray(st.ctrl).tobytes(), CONTROL_DTYPE)[0]


def test_control_block_inputs_and_position(fake_cupy):
    cfg = preset("tiny")
    st = DeviceState(cfg, 40)
    st.rec[cfg.linear_layers[0]][...] = 1.0
    st.reset(pos=3, tokens=[7], max_pos=30, m_rows=2)
    c = _ctrl(st)
    assert (int(c["pos"]), int(c["m_rows"]), int(c["max_pos"]), int(c["tokens"][0])) == (3, 2, 30, 7)
    assert list(c["eos"][:int(c["n_eos"])]) == list(cfg.eos_token_ids)[:int(c["n_eos"])]
    assert st.pos == 3 and not any(a.any() for a in st.rec.values())
    assert st.set_tokens([5, 6, 9]) == 3 and list(_ctrl(st)["tokens"][:3]) == [5, 6, 9]
    assert list(np.asarray(st.tokens_dev[:3])) == [5, 6, 9]
    st.note_steps(2, 3)
    assert (st.pos, st.last_m) == (9, 3) and int(_ctrl(st)["pos"]) == 3  # the device's finish moves its own copy
    st.advance(4)
    assert st.pos == 13 and int(_ctrl(st)["pos"]) == 13 and int(np.asarray(st.pos_dev)[0]) == 13
    st.ctrl_words("go")[...] = 11
    assert int(st.control()["go"]) == 11 and int(st.control()["pos"]) == 13
    c = st.control()
    c["pos"] = 5
    st.write_control(c)
    assert st.pos == 5 and int(_ctrl(st)["pos"]) == 5
    st.ctrl[CONTROL_DTYPE.fields["out_token"][1] // 4] = 1234
    assert st.read_token() == 1234


def test_bad_inputs_are_refused(fake_cupy):
    cfg = preset("tiny")
    with pytest.raises(ValueError, match="capacity=0"):
        DeviceState(cfg, 0)
    st = DeviceState(cfg, 16)
    with pytest.raises(ValueError, match=f"expected 1..{MAX_ROWS} tokens"):
        st.set_tokens(list(range(MAX_ROWS + 1)))
    with pytest.raises(ValueError, match="token ids must lie"):
        st.set_tokens([FIRST_PADDING_ID])
    st.check_room(16)
    with pytest.raises(ValueError, match="Megakernel: positions 0..16 exceed capacity 16"):
        st.check_room(17, "Megakernel")
    with pytest.raises(ValueError, match="outside 0..capacity"):
        st.advance(17)
    with pytest.raises(ValueError, match="CONTROL_DTYPE"):
        st.write_control(np.zeros((), np.dtype([("pos", "<u4")])))


def test_poison_and_buffer(fake_cupy):
    st = DeviceState(preset("tiny"), 16)
    st.poison()
    assert (np.asarray(st.arena).view(np.uint16) == POISON).all() and np.isnan(np.asarray(st.partials)).all()
    st.buf["x.0"][:2] = 0x3F80  # bf16 1.0
    st.last_m = 2
    x = st.buffer("x.0")
    assert x.shape[0] == 2 and x.dtype.name == "bfloat16" and (x.astype(np.float32) == 1.0).all()


# ---------------------------------------------------------------------- who reaches into a DecodeStep
STEP_PUBLIC = {"state", "weights", "w", "cfg", "m", "attention", "next_ids", "layer_ops", "embed"}
BOUND = {"megakernel/runner.py": ("self.ds", "ds"), "megakernel/diagnose.py": ("a", "b"),
         "discrete/prefill.py": ("self.d", "d", "dstep"), "host/executors.py": ("self.dstep",)}


def _reaches(src: str, holders: tuple[str, ...]) -> list[str]:
    """``holder.attr`` uses in ``src`` whose attr is not in STEP_PUBLIC (private names above all)."""
    bad = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in holders and node.attr not in STEP_PUBLIC:
            bad.append(f"{ast.unparse(node.value)}.{node.attr}")
    return bad


@pytest.mark.parametrize("path", sorted(BOUND))
def test_decode_step_is_reached_through_its_public_interface(path):
    src = (ROOT / path).read_text()
    holders = BOUND[path]
    if path == "host/executors.py":  # the executors call the step's own API; only its memory moved to DeviceState
        allowed = {"reset", "read_token", "buffer", "run_eager", "replay", "capture"}
        bad = [b for b in _reaches(src, holders) if b.split(".")[-1] not in allowed]
    else:
        bad = _reaches(src, holders)
    assert bad == [], bad


def test_reach_check_finds_a_private_reach():
    """Negative control: a planted private call and a write of the step's position are reported."""
    planted = "def f(self, t):\n    self.ds._set_tokens(t)\n    self.ds.pos += 1\n    return self.ds.state.pos\n"
    assert sorted(_reaches(planted, ("self.ds",))) == ["self.ds._set_tokens", "self.ds.pos"]


def _runner_names(text: str) -> set[str]:
    """Names imported from megakernel.runner (``from megakernel.runner import ...``) or used as ``runner.X``."""
    out = set()
    for m in re.finditer(r"from megakernel\.runner import (?:\(([^)]*)\)|([\w ,]+))", text):
        names = m.group(1) if m.group(1) is not None else m.group(2)
        out.update(n.strip().split(" as ")[0] for n in names.split(",") if n.strip())
    if re.search(r"from megakernel import runner\b", text):
        out.update(re.findall(r"\brunner\.(\w+)", text))
    return out


def test_names_imported_from_the_runner_exist():
    """The split of megakernel/runner.py keeps every name other code imports from it."""
    import megakernel.runner as runner
    files = [p for d in ("tests", "host", "bench", "tools", "megakernel", "discrete", "assembler")
             for p in (ROOT / d).rglob("*.py") if p.name != "test_device_state.py"]
    used = {n: p for p in files for n in _runner_names(p.read_text())}
    assert {"Megakernel", "split_gdn", "compare_steps", "DEFAULT_FUSE"} <= set(used)  # the scan sees them
    missing = sorted(f"{n} ({used[n].relative_to(ROOT)})" for n in used if not hasattr(runner, n))
    assert missing == [], missing
    assert not hasattr(runner, "no_such_name") and "no_such_name" in _runner_names(
        "from megakernel.runner import Megakernel, no_such_name\n")  # negative control of the scan
