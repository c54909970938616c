"""What a generation hands out: the streamed :class:`Delta` pieces, the :class:`GenerationResult` with its
:class:`Timings`, and the lazy :class:`Generation` iterator that a session (``host.session``) or a one-shot
``Engine`` call drives."""
from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

from host.errors import EngineError, GenerationInterrupted


@dataclass
class Delta:
    """One streamed piece: ``text`` (complete UTF-8 characters, possibly empty while held back for a stop
    string), the generated ``ids`` it accounts for, and on the last delta ``finish_reason`` and ``stop_reason``
    (vLLM's names: ``stop`` = an EOS or stop token or a stop string, ``length`` = max_new_tokens reached or the
    session full, ``tool_calls`` = the reply ended with tool calls, ``grammar_dead_end`` = the grammar admitted
    no token; ``stop_reason`` = the matched stop string or stop token id, None otherwise).

    The parsed view of the same ids (``host.reply``): ``reasoning_content`` / ``content`` text pieces and the
    ``tool_calls`` completed by them (each whole: ``{"index", "id", "type": "function", "function": {"name",
    "arguments"}}``); concatenated over the stream they equal the result's fields.
    ``logprobs`` (when the generation was asked for them): per id, (id, log-probability, [(id, log-probability)
    of the most likely alternatives])."""

    text: str
    ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    reasoning_content: str = ""   # reasoning text these ids decided (host.reply); "" when none
    content: str = ""             # content text (outside reasoning and tool calls)
    tool_calls: list[dict] = field(default_factory=list)  # calls completed by these ids, whole (OpenAI shape + index)
    logprobs: list | None = None


@dataclass
class Timings:
    """Wall-clock times in milliseconds (``time.perf_counter``) and token counts of one generation."""

    prefill_ms: float = 0.0          # syncing the session to the prompt (restores + prefill calls)
    ttft_ms: float = 0.0             # call start -> first token chosen
    decode_ms: float = 0.0           # first token -> last token
    decode_tokens_per_s: float | None = None  # (generated - 1) / decode time; None with < 2 tokens
    tokens_per_step: float = 0.0     # generated tokens per model pass (1.0 without speculation)
    prompt_tokens: int = 0
    reused_tokens: int = 0           # prompt tokens already in the session's state
    prefilled_tokens: int = 0        # tokens run through prefill (re-runs from a checkpoint included)
    generated_tokens: int = 0
    steps: int = 0                   # model passes after the first token (executor steps + verify passes)
    rounds: int = 0                  # speculative rounds (draft k, verify k + 1 rows in one pass)
    forced_tokens: int = 0           # ids the grammar admitted alone, emitted without a model pass of their own
    tokens_per_round: float | None = None   # tokens emitted per speculative round; None without rounds
    acceptance: list = field(default_factory=list)  # per draft position i: accepted / proposed (drafts < i accepted)
    acceptance_counts: list = field(default_factory=list)  # per draft position i: [accepted, proposed]
    ms_per_token: float | None = None  # decode time per emitted token after the first (1000 / decode_tokens_per_s)
    speculate: str = "off"           # the speculation that ran: off, auto, K, or "off (why; plain decode)"


@dataclass
class GenerationResult:
    """Final result: text (stop strings/tokens excluded), generated ids (a stop token included), timings.

    ``finish_reason`` (vLLM / OpenAI): ``stop``, ``length``, ``tool_calls`` (the reply ended with at least one
    parsed tool call and nothing but whitespace after it; ``finish_detail`` still says how it stopped, ``eos``) or
    ``grammar_dead_end`` (the grammar of ``response_format`` / ``tool_choice`` admitted no token: finish_detail
    ``grammar_dead_end``; the text so far is kept). ``stop_reason`` (vLLM): the matched stop string or
    the stop token id, None for EOS (one of the config's eos ids) and for ``length``. ``finish_detail``: ``eos``,
    ``stop_token``, ``stop_string`` (finish_reason ``stop``), ``max_new_tokens`` or ``capacity`` (finish_reason
    ``length``). ``capacity``: prompt and generated tokens filled the session (at most the model's context;
    vLLM's prompt + output <= max_model_len) before max_new_tokens were generated; max_new_tokens itself is at
    most capacity - 1 (``check_generation_args``), so this happens when the prompt (a session's earlier turns
    included) leaves less room than max_new_tokens.

    Parsed by token id (``host.reply``): ``reasoning_content`` (None when the reply did not start in reasoning:
    thinking off or a raw prompt), ``content``, ``tool_calls`` (OpenAI shape: ``{"index", "id", "type":
    "function", "function": {"name", "arguments": JSON text typed by the tool's schema}}``),
    ``invalid_tool_calls`` (``{"index", "raw", "reason": "malformed" | "unterminated"}``), ``tool_call_warnings``
    (``{"index", "id", "name", "warnings": [...]}``). ``grammar``: what constrained the reply (``host.grammar``:
    kind, key, compile and mask times), None when nothing did."""

    text: str
    ids: list[int]
    finish_reason: str
    stop_reason: str | int | None
    finish_detail: str
    timings: Timings
    executor: str
    executor_detail: str
    seed: int
    sampling: dict = field(default_factory=dict)
    session_note: str = ""
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    reasoning_content: str | None = None
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    invalid_tool_calls: list[dict] = field(default_factory=list)
    tool_call_warnings: list[dict] = field(default_factory=list)
    grammar: dict | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("prompt_ids")
        return d


class Generation:
    """Iterator of :class:`Delta`; ``result()`` drains it and returns the :class:`GenerationResult`; ``text`` is
    the whole generated text (vLLM's ``output.text``; drains the stream too).

    Lazy: nothing runs until it is iterated (or ``result()`` / ``text`` is read); argument errors were raised by
    the call that made it. ``close()``, or dropping the last reference, stops it where it is: a session's state
    stays consistent (the session is free for its next turn), and a one-shot ``Engine.generate`` / ``chat``
    gives its slot back."""

    def __init__(self, body: Callable[["Generation"], Iterator[Delta]]):
        self._result: GenerationResult | None = None
        self._closed = False  # close() called (a Generation closed before it started never runs its body)
        self._interrupted: GenerationInterrupted | None = None  # the Ctrl-C that ended the body, if one did
        # The body sees a weak proxy: no reference cycle, so dropping the Generation closes its running body at
        # once (CPython refcounting), not at the next cyclic garbage collection.
        self._it = body(weakref.proxy(self))

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> Delta:
        try:
            return next(self._it)
        except GenerationInterrupted as e:  # the body is over: result() / text say why, not "closed"
            self._interrupted = e
            raise

    def close(self) -> None:
        self._closed = True
        self._it.close()

    def result(self) -> GenerationResult:
        for _ in self:
            pass
        if self._result is None:
            if self._interrupted is not None:
                raise GenerationInterrupted(f"this generation was interrupted (Ctrl-C) and has no result: "
                                            f"{self._interrupted}", self._interrupted.tokens)
            raise EngineError("generation was closed before it finished")
        return self._result

    @property
    def text(self) -> str:
        """The whole generated text, as ``result().text`` (whatever was already iterated included)."""
        return self.result().text
