"""The sm_90 compile check (discrete/compile_check.py): every CUDA unit compiles for both presets with no
local memory in hot kernels; planted syntax errors, spills and misplaced markers fail with a clear message."""
import textwrap

import pytest

from discrete import compile_check as cc

pytestmark = pytest.mark.skipif(cc.nvcc_path() is None, reason="nvcc not installed (CI has /usr/local/bin/nvcc)")


def _src(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_all_sources_compile_without_hot_spills():
    units = cc.find_units()
    if not units:
        pytest.skip("no .cu files under discrete/kernels or megakernel yet")
    res = cc.check(units)
    assert res.ok, cc.format_table(res)
    assert {(r.unit, r.preset) for r in res.results} == {(cc._rel(u), p) for u in units for p in cc.PRESETS}


def test_planted_syntax_error_fails_with_file_and_line(tmp_path, capsys):
    bad = _src(tmp_path, "planted_syntax.cu", """\
        extern "C" __global__ void planted(float* y) {
          y[threadIdx.x] = QMK_HIDDEN
        }
        """)
    assert cc.main(["--no-cache", "--preset", "tiny", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "planted_syntax.cu [tiny, sm_90]: compile error" in out
    assert "planted_syntax.cu(3): error" in out  # the compiler's own file(line) message is shown
    assert "FAILED" in out


_LOCAL_ARRAY = """\
    {marker}
    __global__ void {name}(float* y, const int* idx, int n) {{
      float a[256];  // runtime-indexed: lives in local memory
      for (int i = 0; i < 256; ++i) a[i] = y[i * n];
      y[threadIdx.x] = a[idx[threadIdx.x] & 255];
    }}
    """


def test_planted_local_array_in_marked_hot_kernel_fails(tmp_path):
    bad = _src(tmp_path, "planted_local.cu", _LOCAL_ARRAY.format(marker="// qmk: hot", name="planted_local"))
    res = cc.check([bad], presets=("tiny",), cache_dir=None)
    assert not res.ok
    assert any("hot kernel planted_local" in f and "1024 bytes stack frame" in f for f in res.failures), \
        res.failures


def test_local_memory_in_cold_kernel_is_reported_not_failed(tmp_path):
    # negative control for the rule above: the same kernel unmarked and not hot by name passes
    ok = _src(tmp_path, "cold_local.cu", _LOCAL_ARRAY.format(marker="// some comment", name="cold_local"))
    res = cc.check([ok], presets=("tiny",), cache_dir=None)
    assert res.ok, res.failures
    (k,) = res.results[0].kernels
    assert (k.name, k.hot, k.stack_frame) == ("cold_local", False, 1024)


def test_planted_register_spill_in_hot_by_name_kernel_fails(tmp_path):
    bad = _src(tmp_path, "planted_spill.cu", """\
        // 1024 threads x 2 blocks caps registers at 32: 96 live accumulators must spill
        __global__ void __launch_bounds__(1024, 2) gemv_planted(float* y, const float* x) {
          float acc[96];
        #pragma unroll
          for (int i = 0; i < 96; ++i) acc[i] = x[i * blockDim.x + threadIdx.x];
        #pragma unroll
          for (int j = 0; j < 8; ++j)
        #pragma unroll
            for (int i = 0; i < 96; ++i) acc[i] = acc[i] * acc[(i + j + 1) % 96] + x[j];
          float s = 0.f;
        #pragma unroll
          for (int i = 0; i < 96; ++i) s += acc[i];
          y[threadIdx.x] = s;
        }
        """)
    res = cc.check([bad], presets=("tiny",), cache_dir=None)
    msg = "\n".join(res.failures)
    assert "hot kernel gemv_planted" in msg and "spill stores" in msg, msg


def test_both_presets_defines_are_applied(tmp_path):
    # fails only under the 27B preset: proves each unit is compiled once per preset with its QMK_* defines
    src = _src(tmp_path, "preset_probe.cu", """\
        #if QMK_HIDDEN == 5120
        #error "qwen3.5-27b defines seen"
        #endif
        extern "C" __global__ void probe(float* y) { y[threadIdx.x] = QMK_HIDDEN; }
        """)
    res = cc.check([src], cache_dir=None)
    by = {r.preset: r for r in res.results}
    assert by["tiny"].ok and not by["qwen3.5-27b"].ok
    assert "qwen3.5-27b defines seen" in by["qwen3.5-27b"].log


def test_arch_marker_selects_sm_90a(tmp_path):
    src = _src(tmp_path, "arch_probe.cu", """\
        // qmk: arch sm_90a
        #if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
        #error "not compiled for sm_90a"
        #endif
        extern "C" __global__ void probe(float* y) { y[0] = 1.f; }
        """)
    res = cc.check([src], presets=("tiny",), cache_dir=None)
    assert res.ok, res.failures
    assert [r.arch for r in res.results] == ["sm_90a"]


def test_misplaced_hot_marker_fails(tmp_path):
    src = _src(tmp_path, "misplaced.cu", """\
        // qmk: hot

        extern "C" __global__ void probe(float* y) { y[0] = 1.f; }
        """)
    res = cc.check([src], presets=("tiny",), cache_dir=None)
    assert any("misplaced.cu:1: '// qmk: hot' is not directly above" in f for f in res.failures), res.failures


def test_hot_marker_through_template_line(tmp_path):
    src = _src(tmp_path, "tmpl.cu", """\
        // qmk: hot
        // sums rows
        template <int N>
        __global__ void __launch_bounds__(128) rowsum(float* y) { y[threadIdx.x] *= N; }
        """)
    names, errors = cc.hot_markers(src)
    assert names == {"rowsum"} and not errors
    src.write_text('// qmk: hot\nextern "C"\n__global__ void plain(float* y) { y[0] = 1.f; }\n')
    assert cc.hot_markers(src) == ({"plain"}, [])


def test_cache_hit_and_invalidation_by_included_header(tmp_path):
    hdr = _src(tmp_path, "planted.cuh", "__device__ inline float twice(float x) { return 2.f * x; }\n")
    src = _src(tmp_path, "uses_header.cu", """\
        #include "planted.cuh"
        extern "C" __global__ void probe(float* y) { y[0] = twice(y[1]); }
        """)
    cache = tmp_path / "cache"
    first = cc.check([src], presets=("tiny",), cache_dir=cache)
    second = cc.check([src], presets=("tiny",), cache_dir=cache)
    assert [r.cached for r in first.results + second.results] == [False, True]
    assert second.results[0].kernels == first.results[0].kernels
    hdr.write_text("__device__ inline float twice(float x) { return 2.f * x syntax error; }\n")
    third = cc.check([src], presets=("tiny",), cache_dir=cache)
    assert not third.ok and not third.results[0].cached


def test_parse_ptxas_and_demangle():
    log = textwrap.dedent("""\
        ptxas info    : Compiling entry function '_ZN3qmk6attn_tILi128EEEvPf' for 'sm_90'
        ptxas info    : Function properties for _ZN3qmk6attn_tILi128EEEvPf
            8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
        ptxas info    : Used 40 registers, used 1 barriers, 512 bytes smem, 16 bytes lmem
        ptxas info    : Compiling entry function 'plain' for 'sm_90'
        ptxas info    : Used 10 registers, used 0 barriers
        """)
    a, b = cc.parse_ptxas(log)
    assert (a.name, a.registers, a.barriers, a.smem, a.lmem) == ("attn_t", 40, 1, 512, 16)
    assert (a.stack_frame, a.spill_stores, a.spill_loads) == (8, 4, 12)
    assert (b.name, b.registers, b.stack_frame) == ("plain", 10, 0)
    # nvcc 13 prints a non-inlined helper's properties after the entry's: they are not the entry's
    log2 = textwrap.dedent("""\
        ptxas info    : Compiling entry function 'mk_main' for 'sm_90'
        ptxas info    : Function properties for mk_main
            304 bytes stack frame, 284 bytes spill stores, 496 bytes spill loads
        ptxas info    : Used 128 registers, used 1 barriers, 304 bytes cumulative stack size
        ptxas info    : Compile time = 12313.219 ms
        ptxas info    : Function properties for __internal_trig_reduction_slowpathd
            0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        """)
    (c,) = cc.parse_ptxas(log2)
    assert (c.name, c.registers, c.stack_frame, c.spill_stores, c.spill_loads) == ("mk_main", 128, 304, 284, 496)
    assert cc.demangle("_Z10gemv_spillPfPKf") == "gemv_spill"
    assert cc.is_hot("gemv_spill", set()) and cc.is_hot("x", {"x"}) and not cc.is_hot("embed", set())
    assert cc.is_hot("qmk_attn_prep", set()) and not cc.is_hot("qmk_hash_fill", set())


def test_defines_provider_variants_are_each_compiled(tmp_path, monkeypatch):
    (tmp_path / "planted_launch.py").write_text(
        "def variants(cfg):\n    return [{'QMK_PLANT': 1, 'QMK_H': cfg.hidden_size}, {'QMK_PLANT': 2}]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    src = _src(tmp_path, "planted_defs.cu", """\
        // qmk: defines planted_launch:variants
        #if QMK_PLANT == 2
        #error "variant 2 seen"
        #endif
        extern "C" __global__ void probe(float* y) { y[0] = QMK_PLANT; }
        """)
    res = cc.check([src], presets=("tiny",), cache_dir=None)
    h = cc.get_preset("tiny").hidden_size
    assert [(r.variant, r.ok) for r in res.results] == [(f"QMK_H={h},QMK_PLANT=1", True), ("QMK_PLANT=2", False)]
    assert any("QMK_PLANT=2]: compile error" in f and "variant 2 seen" in f for f in res.failures), res.failures
    src.write_text(src.read_text().replace("planted_launch:variants", "planted_launch:nope"))
    res = cc.check([src], presets=("tiny",), cache_dir=None)
    assert any("defines provider planted_launch:nope does not exist" in f for f in res.failures), res.failures


def test_local_budget_is_a_ceiling(tmp_path, monkeypatch):
    """A kernel with a LOCAL_BUDGETS entry passes under its ceiling and fails over it (the planted kernel keeps
    a local array: a stack frame)."""
    src = _src(tmp_path, "planted_budget.cu", _LOCAL_ARRAY.format(marker="// qmk: hot", name="planted_budget"))
    base = cc.check([src], presets=("tiny",), cache_dir=None)
    (k,) = [k for r in base.results for k in r.kernels]
    assert k.stack_frame > 0 and not base.ok
    monkeypatch.setitem(cc.LOCAL_BUDGETS, "planted_budget", {"stack_frame": k.stack_frame, "spill_stores": 0,
                                                              "spill_loads": 0, "lmem": k.lmem, "why": "test"})
    assert cc.check([src], presets=("tiny",), cache_dir=None).ok
    monkeypatch.setitem(cc.LOCAL_BUDGETS, "planted_budget", {"stack_frame": k.stack_frame - 4, "spill_stores": 0,
                                                              "spill_loads": 0, "lmem": k.lmem, "why": "test"})
    res = cc.check([src], presets=("tiny",), cache_dir=None)
    assert not res.ok and "exceeds its local-memory budget" in "\n".join(res.failures)
