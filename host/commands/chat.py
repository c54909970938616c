"""``qwen-mk chat``: an interactive conversation that keeps one session between turns.

Each turn renders the whole conversation with the chat template; the session reuses what its state already
holds and runs only the rest (``host.session``). Ctrl-C during a reply interrupts it, drops that turn and keeps
the session usable; Ctrl-C at the prompt clears the line and asks again (as Python's REPL does), EOF (Ctrl-D)
or ``/exit`` ends the chat. A line starting with ``/`` is a command
(``HELP``; an unknown one is reported and nothing is sent); ``//`` sends a line starting with ``/``. A blank line
sends nothing (as in other REPLs); an empty message is otherwise valid (``generate ""``, ``Engine.chat``).
"""
from __future__ import annotations

import click

from host.commands.generate import (ERROR, agent_kwargs, agent_options, check_against_model, check_model_args,
                                   check_sampling_args, gen_kwargs, handle_errors, load_engine, model_options,
                                   print_calls, sampling_options, timing_line, warned_already)
from host.errors import GenerationInterrupted, InvalidArgument, PromptTooLong

HELP = ("commands: /reset clears the conversation, /tool TEXT sends TEXT as the result of the last tool call(s) "
        "(a tool message), /exit or /quit ends the chat, /help lists them; start a message with // to send a "
        "leading /")


def assistant_message(engine, ids: list[int], text: str, thinking: bool) -> dict:
    """The assistant turn to keep in the history of a reply given by its ids and text. With thinking on, the
    reasoning (up to id 248069 ``</think>``, split by ``loader.toolcall.split_reasoning``) goes to
    ``reasoning_content`` so the template can drop it from earlier turns as the real one does. A
    GenerationResult at hand: :func:`assistant_turn` keeps its parsed tool calls too."""
    from loader.toolcall import split_reasoning  # deferred: the engine side (host.commands.generate)

    if not thinking:
        return {"role": "assistant", "content": text.strip()}
    reasoning, content, _complete = split_reasoning(ids, engine.tokenizer)
    msg = {"role": "assistant", "content": content.strip()}
    if reasoning.strip():
        msg["reasoning_content"] = reasoning.strip()
    return msg


def assistant_turn(r) -> dict:
    """The assistant turn to keep in the history, from a GenerationResult's parsed fields (by token id,
    ``host.reply``): the content, the reasoning in ``reasoning_content`` (so the template can drop it from
    earlier turns as the real one does) and the parsed ``tool_calls``."""
    msg = {"role": "assistant", "content": r.content.strip()}
    if r.reasoning_content and r.reasoning_content.strip():
        msg["reasoning_content"] = r.reasoning_content.strip()
    if r.tool_calls:
        msg["tool_calls"] = [{k: c[k] for k in ("id", "type", "function")} for c in r.tool_calls]
    return msg


def read_line(prompt: str = ">>> ") -> str | None:
    """One line of input, None at EOF (Ctrl-D). Ctrl-C while typing clears the line and asks again, as Python's
    REPL does; ``/exit`` or Ctrl-D ends the chat."""
    while True:
        try:
            return input(prompt)
        except EOFError:
            click.echo("", err=True)
            return None
        except KeyboardInterrupt:
            click.echo("\n[line cleared; Ctrl-D or /exit ends the chat]", err=True)


@click.command()
@model_options
@sampling_options
@agent_options
@click.option("--system", default=None, help="System message.")
@click.option("--timings/--no-timings", default=True, show_default=True, help="Timing line after each reply.")
@handle_errors
def command(system, timings, **kw):
    """Chat interactively (keeps the session between turns)."""
    check_model_args(kw)
    check_sampling_args(kw)  # bad sampling flags fail before the model loads
    agent = agent_kwargs(kw)  # tool and grammar flags too
    tools = agent.pop("tools", None)
    from host.sampling import check_text  # deferred: the engine side (host.commands.generate)

    if system:
        check_text(system, "--system")
    eng = load_engine(kw)
    check_against_model(eng, kw)
    sess = eng.new_session()
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    click.echo("qwen-mk chat: /reset clears the conversation, /exit or Ctrl-D quits, /help lists the commands, "
               "Ctrl-C interrupts a reply.", err=True)
    while True:
        line = read_line()
        if line is None:
            return
        cmd = line.strip()
        if cmd.startswith("//"):  # an escaped leading slash: text for the model
            line = line.replace("/", "", 1)
        elif cmd in ("/exit", "/quit"):
            return
        elif cmd == "/reset":
            messages = list(base)
            click.echo("[conversation cleared]", err=True)
            continue
        elif cmd == "/help":
            click.echo(HELP, err=True)
            continue
        elif cmd == "/tool" or cmd.startswith("/tool "):
            turn = messages + [{"role": "tool", "content": cmd[len("/tool"):].strip()}]
            line = None
        elif cmd.startswith("/"):
            click.echo(f"unknown command {cmd.split()[0]!r} (nothing sent); {HELP}", err=True)
            continue
        if line is not None:
            if not line.strip():
                continue
            turn = messages + [{"role": "user", "content": line}]
        try:
            check_text(line if line is not None else turn[-1]["content"], "input")
            with warned_already():  # printed once before loading, not again each turn
                g = sess.chat(turn, enable_thinking=not kw["no_think"], tools=tools, **gen_kwargs(kw), **agent)
        except (PromptTooLong, InvalidArgument) as e:  # this turn only: the conversation so far stays usable
            click.echo(f"{ERROR} {e}\n[turn dropped, conversation kept; /reset starts over]", err=True)
            continue
        try:
            for d in g:
                click.echo(d.text, nl=False)
            r = g.result()
        except (GenerationInterrupted, KeyboardInterrupt):
            g.close()
            click.echo("\n[interrupted: turn dropped, session kept]", err=True)
            continue
        except PromptTooLong as e:
            g.close()
            click.echo(f"\n{ERROR} {e}\n[turn dropped, conversation kept; /reset starts over]", err=True)
            continue
        except BaseException:
            click.echo("", err=True)  # end the cut-short reply line before handle_errors' one-line message
            raise
        click.echo("")
        print_calls(r)
        if timings:
            click.echo(timing_line(r), err=True)
        messages = turn + [assistant_turn(r)]
