"""``qwen-mk compare``: the CUDA-graph path and the megakernel on the same synthetic model and inputs.

Two DecodeSteps share one WeightsGPU; the graph path runs on one, the megakernel on the other's allocations.
After every step every buffer the program writes (activations of every layer, logits, argmax ids, GDN state,
conv rings, KV pages) is compared bit for bit; the first mismatch is reported as (buffer, layer, index). Then
each path is timed over the same number of greedy steps (CUDA events; the megakernel runs them in one launch).
Needs a GPU.
"""
from __future__ import annotations

import json

import click
import numpy as np

from host.commands.generate import handle_errors
from host.errors import ExecutorUnavailable
from host.executors import gpu_available
from loader.config import preset as get_preset
from loader.synthetic import SyntheticWeights


def compare(preset: str, steps: int, rows: int, context: int = 0, seed: int = 0, time_steps: int = 32) -> dict:
    """Run the comparison; returns {"identical", "first_mismatch", "steps", "rows", "graph_ms_per_step",
    "megakernel_ms_per_step", ...}. Raises RuntimeError without a GPU."""
    import cupy as cp  # deferred, with the GPU packages: only a GPU run loads them
    from discrete.step import DecodeStep
    from discrete.weights_gpu import WeightsGPU
    from megakernel.runner import Megakernel, compare_steps
    cfg = get_preset(preset)
    w = WeightsGPU.from_synthetic(SyntheticWeights(cfg, seed))
    cap = context + rows * (steps + time_steps + 2) + 8
    a = DecodeStep(cfg, w, cap, rows, debug_logits=True)
    b = DecodeStep(cfg, w, cap, rows, debug_logits=True)
    mk = Megakernel(b)
    rng = np.random.default_rng(seed)
    for s in (a, b):
        s.poison()
        s.reset(context, [int(rng.integers(0, 248000))])
    a.capture()
    mismatch = None
    for k in range(steps):
        t = None if rows == 1 else rng.integers(0, 248000, size=rows).astype(np.int32)
        a.replay(t)
        mk.step(t)
        mk.check()
        r = compare_steps(a, b, mk.program, rows)
        if r is not None:
            mismatch = {"step": k, "buffer": r[0], "layer": r[1], "index": r[2], "graph": r[3], "megakernel": r[4],
                        "count": r[5]}
            break

    def timed(fn, stream):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        fn()
        e1.record(stream)
        e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1) / time_steps

    g_ms = timed(lambda: [a.replay() for _ in range(time_steps)], a.stream)
    m_ms = timed(lambda: mk.run_steps(time_steps), b.stream)
    mk.check()
    return {"preset": preset, "rows": rows, "steps": steps, "context": context, "identical": mismatch is None,
            "first_mismatch": mismatch, "graph_ms_per_step": g_ms, "megakernel_ms_per_step": m_ms,
            "timed_steps": time_steps, "num_sms": mk.num_sms, "program": mk.program.stats()}


@click.command()
@click.option("--preset", default="tiny", type=click.Choice(["tiny", "qwen3.5-27b"]), show_default=True)
@click.option("--steps", default=16, show_default=True, type=click.IntRange(min=1), help="steps compared bit for bit")
@click.option("--rows", default=1, show_default=True, type=click.IntRange(1, 8),
              help="rows per step (M ≤ 8; M > 1 teacher-forced)")
@click.option("--context", default=0, show_default=True, type=click.IntRange(min=0), help="start position")
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
@handle_errors
def command(preset: str, steps: int, rows: int, context: int, as_json: bool) -> None:
    """Graph path vs megakernel: bit identity of every buffer after every step, and ms/token of each."""
    ok, why = gpu_available()
    if not ok:
        raise ExecutorUnavailable(f"compare runs the graph path and the megakernel on a GPU: {why}")
    r = compare(preset, steps, rows, context)
    if as_json:
        click.echo(json.dumps(r))
        return
    if r["identical"]:
        click.echo(f"identical: every buffer of {steps} steps × {rows} rows ({preset})")
    else:
        f = r["first_mismatch"]
        click.echo(f"MISMATCH at step {f['step']}: buffer {f['buffer']} layer {f['layer']} index {f['index']} "
                   f"(graph {f['graph']:#x}, megakernel {f['megakernel']:#x}; {f['count']} differ)")
    click.echo(f"graph {r['graph_ms_per_step']:.3f} ms/step, megakernel {r['megakernel_ms_per_step']:.3f} ms/step "
               f"({r['timed_steps']} greedy steps each, measured with CUDA events)")
    if not r["identical"]:
        raise SystemExit(1)
