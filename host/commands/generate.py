"""``qwen-mk generate [PROMPT]``: one prompt in (argument or stdin), streamed text out, timings on stderr.

Also holds the option set and error handling that ``chat`` shares. Exit codes: 0 ok; ``EngineError.exit_code``
of the error raised (2 bad argument, 3 empty prompt, 4 too long, 5 bad token id, 6 model, 7 executor,
8 the cache directory or stdout cannot be written, 130 interrupted); click's own 2 for usage errors. An empty PROMPT is a valid chat message (the template still
gives the model a prompt, as vLLM accepts it); only with ``--raw`` is an empty (or blank) PROMPT refused (3).

The engine side (``host.engine``, ``host.session``, ``host.sampling``: the reference ops, tokenizer and template
behind them) is imported inside the functions that use it, so ``qwen-mk --help`` and flag errors never load it.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
import warnings

import click

from host.errors import (ERROR, EmptyPrompt, EngineError, GenerationInterrupted, IgnoredArgumentWarning,
                         InvalidArgument, RequestError)
from host.executors import KINDS
from host.grammar import normalize_tool_choice, tool_names
from host.limits import DEFAULT_CAPACITY, DEFAULT_MAX_NEW_TOKENS, EPS_TEXT, SAMPLING_EPS
from host.stdout_guard import StdoutClosed, StdoutError
from loader.config import PRESETS
from loader.trained import DEFAULT_MODEL, TRAINED
from loader.trained import config as trained_config



def model_options(f):
    """--model/--preset/--executor/--capacity, shared by generate and chat."""
    f = click.option("--capacity", type=click.IntRange(min=2), default=None,
                     show_default="4096, or the model's context when smaller",
                     help="Tokens per session (KV cache rows), prompt and reply together: at least 2 (a prompt of "
                          "at least 1 token and one generated token).")(f)
    f = click.option("--executor", type=click.Choice(KINDS), default=None,
                     help="Default: graph when a GPU is present (faster today), else cpu.")(f)
    f = click.option("--preset", type=click.Choice(sorted([*PRESETS, *TRAINED])), default=None,
                     help=f"A trained model or the synthetic checkpoint of a preset (default {DEFAULT_MODEL} when "
                          "--model is absent).")(f)
    f = click.option("--model", "model_dir", type=click.Path(file_okay=False), default=None,
                     help="Checkpoint directory.")(f)
    return f


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange that also refuses nan and inf (FloatRange lets them through), so a sampling value out of
    ``SamplingParams``' range is a usage error of the command line, as ``--max-new-tokens 0`` is."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{rv} is not a finite number.", param, ctx)
        return rv


class SpeculateType(click.ParamType):
    """``off`` | ``auto`` | an integer 0..7 (0 = off), as ``host.speculate.parse_speculate`` takes it."""

    name = "off|auto|K"

    def convert(self, value, param, ctx):
        v = str(value).strip()
        if v in ("off", "auto") or (v.isdigit() and 0 <= int(v) <= 7):
            return v if not v.isdigit() else int(v)
        self.fail(f"{value!r} is not off, auto or a number of drafts 0..7.", param, ctx)


def sampling_options(f):
    """Sampling and stopping options, shared by generate and chat. Their declared ranges are those of
    ``host.sampling.SamplingParams`` (which still checks them for API callers): a value outside is click's usage
    error (exit 2)."""
    for opt in reversed([
        click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
                     show_default=f"{DEFAULT_MAX_NEW_TOKENS}, or --capacity - 1 or the model's context - 1 when "
                                  "smaller",
                     help="At most --capacity - 1 and the model's context - 1 (the session holds the prompt, at "
                          "least 1 token, and the reply)."),
        click.option("--temperature", type=FiniteFloatRange(min=0), default=0.0, show_default=True,
                     help=f"0 = greedy; so is any value below {EPS_TEXT} (vLLM's rule)."),
        click.option("--top-k", type=click.IntRange(min=0), default=None,
                     help="Keep the k most likely (ties kept); 0 = off. Sampling only (--temperature >= "
                          f"{EPS_TEXT})."),
        click.option("--top-p", type=FiniteFloatRange(0, 1, min_open=True), default=None,
                     help=f"Nucleus mass in (0, 1]. Sampling only (--temperature >= {EPS_TEXT})."),
        click.option("--seed", type=click.IntRange(min=0), default=None, help="Sampling seed (printed when drawn)."),
        click.option("--stop", multiple=True, help="Stop string (repeatable); not emitted."),
        click.option("--no-think", is_flag=True, help="Render the prompt with enable_thinking=False."),
        click.option("--speculate", type=SpeculateType(), default=None, show_default="off",
                     help="MTP speculative decoding: off, auto (k chosen by measurement) or K drafts per round "
                          "(1..7); greedy output is identical to off. cpu executor only; elsewhere plain decode "
                          "with the reason in the timing line (docs/speculation.md)."),
    ]):
        f = opt(f)
    return f


def agent_options(f):
    """Tool and grammar options, shared by generate and chat (docs/agent.md)."""
    for opt in reversed([
        click.option("--tools", "tools_file", type=click.Path(dir_okay=False), default=None,
                     help="JSON file holding the OpenAI tool list ([{\"type\": \"function\", \"function\": "
                          "{...}}, ...]): rendered into the prompt; the reply's tool calls are parsed."),
        click.option("--tool-choice", default=None,
                     help="auto (default with --tools) | required | none | a function name; required and a name "
                          "are enforced by the grammar."),
        click.option("--no-tool-grammar", is_flag=True,
                     help="Parse tool calls without constraining them (tool choice auto or none only)."),
        click.option("--response-format", type=click.Choice(["text", "json_object"]), default=None,
                     help="json_object: the answer is one JSON object (grammar-constrained)."),
        click.option("--json-schema", "json_schema_file", type=click.Path(dir_okay=False), default=None,
                     help="JSON file holding a JSON schema the answer must follow (grammar-constrained)."),
        click.option("--regex", default=None, help="Regular expression the answer must match (grammar-constrained)."),
    ]):
        f = opt(f)
    return f


def _json_file(path: str, param: str):
    """The JSON value in ``path``; RequestError(param) when it cannot be read or is not valid JSON."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise RequestError(f"{param} {path}: cannot read it ({e})", param) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"{param} {path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})",
                           param) from None


def agent_kwargs(kw: dict) -> dict:
    """The API's agent arguments (tools, tool_choice, tool_grammar, response_format) from the CLI flags, read
    and checked before the model loads. Raises RequestError naming the flag: a --tools file that is missing or
    not valid JSON or not a tool list, a --tool-choice naming no tool, more than one of --response-format /
    --json-schema / --regex, a --json-schema file that is not valid JSON."""
    out: dict = {}
    tools = None
    if kw["tools_file"] is not None:
        tools = _json_file(kw["tools_file"], "--tools")
        if isinstance(tools, dict) and "tools" in tools:  # a request body's tools field
            tools = tools["tools"]
        try:
            tool_names(tools)
        except RequestError as e:
            raise RequestError(f"--tools {kw['tools_file']}: {e}", "--tools") from None
        out["tools"] = tools
    if kw["tool_choice"] is not None or tools is not None:
        try:
            out["tool_choice"] = normalize_tool_choice(kw["tool_choice"], tools)
        except RequestError as e:
            raise RequestError(f"--tool-choice: {str(e).removeprefix('tool_choice: ')}", "--tool-choice") from None
    if kw["no_tool_grammar"]:
        out["tool_grammar"] = False
    given = [n for n, v in (("--response-format", kw["response_format"]), ("--json-schema", kw["json_schema_file"]),
                            ("--regex", kw["regex"])) if v is not None]
    if len(given) > 1:
        raise RequestError(f"{' and '.join(given)}: give one of them", given[1])
    if kw["json_schema_file"] is not None:
        schema = _json_file(kw["json_schema_file"], "--json-schema")
        out["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
    elif kw["regex"] is not None:
        out["response_format"] = {"type": "regex", "pattern": kw["regex"]}
    elif kw["response_format"] is not None:
        out["response_format"] = {"type": kw["response_format"]}
    return out


def print_calls(r) -> None:
    """One stderr line per parsed tool call and per invalid call region of a result (the text mode's summary)."""
    for c in r.tool_calls:
        click.echo(f"[tool call {c['index']}: {c['function']['name']} {c['function']['arguments']}]", err=True)
    for c in r.invalid_tool_calls:
        click.echo(f"[invalid tool call {c['index']} ({c['reason']}): {c['raw'][:200]!r}]", err=True)


def gen_kwargs(kw: dict) -> dict:
    return dict(max_new_tokens=kw["max_new_tokens"], temperature=kw["temperature"], top_k=kw["top_k"],
                top_p=kw["top_p"], seed=kw["seed"], stop=list(kw["stop"]), speculate=kw["speculate"])


def check_model_args(kw: dict) -> None:
    """UsageError for --model together with --preset."""
    if kw["model_dir"] and kw["preset"]:
        raise click.UsageError("give --model DIR or --preset NAME, not both")


def _params(kw: dict):
    """The ``host.sampling.SamplingParams`` of the command's sampling flags (InvalidArgument when out of range)."""
    from host.sampling import SamplingParams  # deferred: the engine side (module docstring)

    return SamplingParams(kw["temperature"], kw["top_k"], kw["top_p"], kw["seed"])


def check_sampling_args(kw: dict) -> None:
    """Checks of the sampling flags before the model loads, by the function the Python API runs in
    ``Session.generate`` (``host.sampling.check_generation_args``): their ranges (``SamplingParams``; click's
    option types refused what is out of range already), an empty --stop string and --max-new-tokens against
    --capacity and a preset's context (InvalidArgument), and a ``qwen-mk: warning:``
    line on stderr for each IgnoredArgumentWarning it issues (--top-k, --top-p or --seed under greedy decoding,
    where they have no effect; vLLM ignores them there too). Leaves an absent ``kw["max_new_tokens"]`` None: the
    API fills in its default (DEFAULT_MAX_NEW_TOKENS, or --capacity - 1 or the model's context - 1 when smaller)
    once the model is loaded, since a ``--model DIR``'s context is not known here."""
    from host.sampling import check_generation_args  # deferred: the engine side (module docstring)

    p = _params(kw)
    if any(not s for s in kw["stop"]):  # Session.generate's check, before the model loads
        raise InvalidArgument(f"stop: expected non-empty strings, got {list(kw['stop'])!r}")
    name = kw["preset"] or (None if kw["model_dir"] else DEFAULT_MODEL)  # Engine.load's default
    cfg = PRESETS.get(name) or (trained_config(name) if name in TRAINED else None)
    ctx = cfg.max_position_embeddings if cfg else None
    cap = kw["capacity"]
    if cap is None:  # Engine.load's default (4096, or the model's context when smaller; a --model DIR's context
        # is known only after loading: the API checks again there)
        cap = min(DEFAULT_CAPACITY, ctx) if ctx else DEFAULT_CAPACITY
        if ctx:
            kw["capacity"] = cap
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", IgnoredArgumentWarning)
        check_generation_args(p, kw["max_new_tokens"], cap, ctx, cli=True,
                              context_of=f"max_position_embeddings of preset {name!r}")
    for w in caught:
        if issubclass(w.category, IgnoredArgumentWarning):
            click.echo(f"qwen-mk: warning: {w.message}", err=True)
        else:  # not ours: let it through as it would have gone
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def check_against_model(eng, kw: dict) -> None:
    """A given --max-new-tokens against the loaded model (``check_generation_args`` with its context and
    capacity): a ``--model DIR``'s context is known only now. For ``chat``: InvalidArgument once, before the first
    turn, rather than a dropped turn each time (``generate``'s one call raises the same by itself)."""
    if kw["max_new_tokens"] is None:  # the API's default fits the model by construction
        return
    from host.sampling import check_generation_args  # deferred: the engine side (module docstring)

    with warned_already():
        check_generation_args(_params(kw), kw["max_new_tokens"], eng.executor.capacity,
                              eng.cfg.max_position_embeddings, cli=True)


@contextlib.contextmanager
def warned_already():
    """Around the API calls of a command whose flags ``check_sampling_args`` checked: its warnings were printed
    once as ``qwen-mk: warning:`` lines, so the same IgnoredArgumentWarning from ``Session.generate`` is muted."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredArgumentWarning)
        yield


def load_engine(kw: dict):
    """Engine for the CLI options (raises EngineError subclasses)."""
    from host.engine import Engine  # deferred: the engine side (module docstring)

    return Engine.load(kw["model_dir"] or kw["preset"], kw["executor"], capacity=kw["capacity"])


def handle_errors(f):
    """Turn EngineError into one ``qwen-mk: error: ...`` line on stderr and its exit code; Ctrl-C into exit 130.
    A command that streams ends its open reply line itself before the error propagates."""
    @functools.wraps(f)
    def wrapper(*a, **kw):
        try:
            return f(*a, **kw)
        except EngineError as e:
            click.echo(f"{ERROR} {e}", err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo(f"{ERROR} interrupted", err=True)
            sys.exit(GenerationInterrupted.exit_code)
    return wrapper


def finish_text(r) -> str:
    """``length (max_new_tokens)``, ``stop (eos)``, ``stop (stop_string '###')``: finish_reason, then the detail."""
    why = r.finish_detail + (f" {r.stop_reason!r}" if r.stop_reason is not None else "")
    return f"{r.finish_reason} ({why})"


def timing_line(r) -> str:
    """One line summarising a GenerationResult's timings (measured wall clock, time.perf_counter)."""
    t = r.timings
    pre = f"prefill {t.prefilled_tokens} tok in {t.prefill_ms:.1f} ms"
    if t.prefilled_tokens and t.prefill_ms > 0:
        pre += f" ({t.prefilled_tokens / t.prefill_ms * 1e3:.1f} tok/s)"
    if t.reused_tokens:
        pre += f", {t.reused_tokens} reused"
    dec = f"decode {t.generated_tokens} tok"
    if t.decode_tokens_per_s:
        dec += f" at {t.decode_tokens_per_s:.2f} tok/s ({1e3 / t.decode_tokens_per_s:.1f} ms/tok)"
    seed = f" | seed {r.seed}" if r.sampling.get("temperature", 0) >= SAMPLING_EPS else ""  # drawn when sampling
    spec = ""
    if t.rounds:
        acc = " ".join(f"{a:.2f}" for a in t.acceptance)
        spec = (f" | speculate {t.speculate}: {t.rounds} rounds, {t.tokens_per_round:.2f} tok/round, "
                f"acceptance per position {acc}")
    elif t.speculate != "off":
        spec = f" | speculate {t.speculate}"
    if t.forced_tokens:
        spec += f" | {t.forced_tokens} forced tok"
    return (f"[{pre} | ttft {t.ttft_ms:.1f} ms | {dec} | {t.tokens_per_step:.2f} tok/step{spec} | "
            f"finish {finish_text(r)}{seed} | {r.executor_detail}]")


def interrupted_oneshot(e: GenerationInterrupted, shown: str) -> GenerationInterrupted:
    """The CLI's wording of Ctrl-C in a one-shot ``generate``: what was printed (``shown``) is all there is."""
    from host.session import tokens_text  # deferred: the engine side (module docstring)

    after = "" if e.tokens is None else f" after {tokens_text(e.tokens)}"
    return GenerationInterrupted(f"generation interrupted{after}; the one-shot session is closed ({shown})",
                                 e.tokens)


def read_prompt(prompt: str | None) -> str:
    if prompt is not None and prompt != "-":  # "-" reads stdin, as many CLIs do
        return prompt
    stdin = sys.stdin
    if stdin.isatty():
        raise click.UsageError("no prompt: give PROMPT as an argument or pipe it on stdin")
    return stdin.read()


@click.command()
@click.argument("prompt", required=False)
@model_options
@sampling_options
@agent_options
@click.option("--raw", is_flag=True, help="Tokenise PROMPT as is, without the chat template.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (text, ids, finish_reason, stop_reason, finish_detail, timings, "
                   "reasoning_content, content, tool_calls, invalid_tool_calls, ...).")
@handle_errors
def command(prompt, raw, as_json, **kw):
    """Generate a reply to PROMPT (or stdin) and stream it."""
    check_model_args(kw)
    check_sampling_args(kw)  # bad sampling flags fail before the model loads (as in chat)
    agent = agent_kwargs(kw)  # tool and grammar flags too
    if raw and kw["no_think"]:
        click.echo("qwen-mk: warning: --no-think has no effect with --raw (no chat template is rendered)", err=True)
    text = read_prompt(prompt)
    if raw and not text.strip():  # an empty user message is a valid chat prompt: the template gives it tokens
        raise EmptyPrompt("the prompt is empty (or blank); with --raw no chat template adds tokens to it")
    from host.sampling import check_text  # deferred: the engine side (module docstring)

    check_text(text, "prompt")  # before the model loads
    eng = load_engine(kw)
    with warned_already():  # generate checks max_new_tokens against the loaded model too (InvalidArgument)
        if raw:
            g = eng.generate(eng.encode(text), **gen_kwargs(kw), **agent)
        else:
            g = eng.chat([{"role": "user", "content": text}], enable_thinking=not kw["no_think"], **gen_kwargs(kw),
                         **agent)
    if as_json:
        try:
            r = g.result()
        except GenerationInterrupted as e:
            raise interrupted_oneshot(e, "no JSON was printed") from None
        click.echo(json.dumps(r.to_json(), ensure_ascii=False))
        return
    out = sys.stdout
    wrote = False
    try:
        for d in g:
            if d.text:
                out.write(d.text)
                out.flush()
                wrote = True
    except BaseException as e:
        if wrote and not isinstance(e, (StdoutClosed, StdoutError)):  # end the cut-short reply line
            out.write("\n")
            out.flush()
        if isinstance(e, GenerationInterrupted):
            raise interrupted_oneshot(e, "the text above is all there is" if wrote else "no text was printed") \
                from None
        raise
    out.write("\n")
    print_calls(g.result())
    click.echo(timing_line(g.result()), err=True)
