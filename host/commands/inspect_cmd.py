"""``qwen-mk inspect``: assemble a preset's decode (or verify / MTP) program and print it with its stats."""
from __future__ import annotations

import dataclasses
import json

import click
from click.core import ParameterSource

from assembler.options import PROGRAM
from host.errors import ExecutorUnavailable
from host.executors import gpu_available
from loader.config import PRESETS, preset


class _NoGPU(click.ClickException):
    """``--timings`` without a usable GPU: the exit code of ExecutorUnavailable, as generate / compare / bench."""

    exit_code = ExecutorUnavailable.exit_code


MAX_SMS = 1024  # far above any GPU's SM count; the assembler's time and memory grow with it (10,000 SMs: 2 GB)

# options that shape the assembled program; --timings runs the megakernel's own default decode program instead
_PROGRAM_ONLY = {"layer_limit": "--layer-limit", "rows": "--rows", "kind": "--kind", "fuse_reduce": "--fuse-reduce",
                 "defer_reduce": "--defer-reduce", "local_reduce": "--local-reduce", "check": "--verify",
                 "gdn_split": "--gdn-split", "mlp_groups": "--mlp-groups"}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--preset", "preset_name", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True,
              help="model configuration")
@click.option("--sms", type=click.IntRange(min=1, max=MAX_SMS), default=132, show_default=True,
              help=f"SM count (132 on the H200; at most {MAX_SMS})")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "stats"]), default="text", show_default=True,
              help="full dump as text or JSON (its 'stats' object holds what the stats line prints: --context, and "
                   "'verified' with --verify), or the stats only; --timings prints JSON and accepts only json")
@click.option("--layer-limit", type=click.IntRange(min=0), default=None, help="keep only the first L layers")
@click.option("--rows", type=click.IntRange(1, 8), default=1, show_default=True, help="M rows (verify step when > 1)")
@click.option("--kind", type=click.Choice(["decode", "mtp"]), default="decode", show_default=True)
@click.option("--fuse-reduce/--no-fuse-reduce", default=None,
              help="split-K reduce inside the GEMV instructions (default: the megakernel's default program)")
@click.option("--defer-reduce/--no-defer-reduce", default=None,
              help="residual split-K reduces in the consumers' prologues instead of GEMV_REDUCE stages (default: the "
                   "megakernel's default program)")
@click.option("--local-reduce/--no-local-reduce", default=None,
              help="split-K in-projections reduced on their own instructions in shared memory instead of GEMV_REDUCE "
                   "stages (default: the megakernel's default program)")
@click.option("--mlp-groups/--no-mlp-groups", default=None,
              help="gate|up rows in one group per down split, each down split waiting only on its group and cut by "
                   "when its group ends (default: the megakernel's default program)")
@click.option("--gdn-split", type=click.IntRange(min=1), default=None,
              help="split every GDN step over its key head's value heads in this many parts, as the megakernel runner "
                   "does (default: the megakernel's default program, one part per value head; 1 = the program as "
                   "assembled)")
@click.option("--verify/--no-verify", "check", default=False,
              help="also run the static verifier (slow for the 27B); its summary goes into the stats ('verified')")
@click.option("--timings", is_flag=True, help="run the megakernel's default decode program (2 steps) on the GPU with "
              "per-instruction timing slots (QMK_MK_TIMING build) and print them as JSON; takes --preset, --sms, "
              "--context (and --format json); refuses --layer-limit, --rows, --kind, --fuse-reduce, --defer-reduce, "
              "--local-reduce, --mlp-groups, --verify, "
              "--format text/stats; exit 7 without a GPU")
@click.option("--context", type=click.IntRange(min=0), default=0, show_default=True,
              help="with --timings: start position; otherwise the KV context whose attention bytes the stats add")
def command(preset_name: str, sms: int, fmt: str, layer_limit: int | None, rows: int, kind: str,
            fuse_reduce: bool | None, defer_reduce: bool | None, local_reduce: bool | None,
            mlp_groups: bool | None, gdn_split: int | None, check: bool, timings: bool, context: int) -> None:
    """Print the instruction program of one step and its stats (bytes per SM, imbalance, waits, critical path).
    Options left out take the program the GPU runs (``assembler.options.PROGRAM.for_rows(rows)``); the options
    used are printed ('options' in the JSON, an ``# options`` line otherwise)."""
    if timings:
        ctx = click.get_current_context()
        given = []
        for name, flag in _PROGRAM_ONLY.items():
            if ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT):
                given.append(flag.replace("--", "--no-", 1) if ctx.params[name] is False else flag)
        if fmt != "json" and ctx.get_parameter_source("fmt") not in (None, ParameterSource.DEFAULT):
            given.append(f"--format {fmt}")
        if given:
            raise click.UsageError(f"--timings runs the megakernel's default decode program and prints JSON; it does "
                                   f"not take {', '.join(given)}")
        ok, why = gpu_available()
        if not ok:
            raise _NoGPU(f"--timings runs the megakernel and needs an NVIDIA GPU: {why}")
        from megakernel.timings import run
        click.echo(json.dumps(run(preset_name, steps=2, context=context, num_sms=sms), indent=1))
        return
    from assembler.scheduler import assemble  # lazy: start-up (~55 ms)

    cfg = preset(preset_name)
    if layer_limit is not None and layer_limit > cfg.num_hidden_layers:
        raise click.BadParameter(f"{layer_limit} > num_hidden_layers ({cfg.num_hidden_layers})", param_hint="--layer-limit")
    given = {"fuse_reduce": fuse_reduce, "defer_reduce": defer_reduce, "local_reduce": local_reduce,
             "mlp_groups": mlp_groups, "gdn_split": gdn_split}
    opts = dataclasses.replace(PROGRAM.for_rows(rows), **{k: v for k, v in given.items() if v is not None})
    gdn_split = opts.gdn_parts(cfg)
    if gdn_split > cfg.gdn_head_group:
        raise click.BadParameter(f"{gdn_split} > the value heads per key head ({cfg.gdn_head_group})",
                                 param_hint="--gdn-split")
    prog = assemble(cfg, rows, sms, opts, layer_limit if kind == "decode" else None, kind)
    if gdn_split > 1:
        from megakernel.runner import split_gdn
        prog = split_gdn(prog, gdn_split)
    used = opts.as_dict(cfg)
    st = prog.stats(kv_context=context)
    if check:
        from assembler.verify import VerifyError, verify  # lazy: start-up (~25 ms, --check only)
        try:
            st["verified"] = verify(prog)
        except VerifyError as e:
            raise click.ClickException(f"the static verifier rejects the program: {e}") from None
    if fmt == "json":
        d = json.loads(prog.to_json())
        d["stats"] = st  # the same object as the text dump's stats line (--context, and 'verified' with --verify)
        d["options"] = used  # the program options it was assembled with (assembler/options.py)
        click.echo(json.dumps(d))
        return
    if fmt == "text":
        click.echo(prog.to_text(), nl=False)
    click.echo("# stats " + json.dumps(st))
    click.echo(f"# bytes per SM: mean {st['bytes_mean'] / 1e6:.3f} MB, max {st['bytes_max'] / 1e6:.3f} MB, "
               f"min {st['bytes_min'] / 1e6:.3f} MB, imbalance {100 * st['imbalance']:.2f} % of the mean; "
               f"est. critical path {st['est_critical_path_ms']:.3f} ms vs floor {st['floor_ms']:.3f} ms "
               f"(estimate at 4,468 GB/s); est. megakernel step {st['est_step_ms']:.3f} ms for this program"
               + (" as assembled, GDN steps per key head" if gdn_split == 1 else f", GDN steps in {gdn_split} parts")
               + " (per-instruction costs measured on the H200 for the 27B, assembler/program.py"
               + ("; the runner's default splits GDN steps per value head: --gdn-split)" if gdn_split == 1 else ")"))
    click.echo("# options " + json.dumps(used) + " (assembler/options.py; the megakernel's default program: "
               + json.dumps(PROGRAM.for_rows(rows).as_dict(cfg)) + ")")
