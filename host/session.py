"""Sessions and the decode loop: one host loop over any executor (``host.executors``).

A :class:`Session` owns one executor slot and the token ids whose effect is in that slot's state. A new turn
passes the whole prompt (all ids of the conversation so far): the session reuses the longest common prefix
and runs only the rest. GDN state cannot be rewound (article Part 3.6), so when the prompt diverges from
the session's ids (e.g. the template drops an earlier turn's reasoning) the session restores the latest
state checkpoint at or before the divergence and re-runs from there, or starts from scratch when there is
none. Checkpoints are taken at positions that are multiples of 64 (article Part 5.4): prefill pieces start
at those positions, so the chunks of the reference's chunked GDN prefill fall where a single pass from the
checkpoint would put them.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import asdict
from typing import Iterator, Sequence

import numpy as np

from host.errors import EmptyPrompt, EngineError, GenerationInterrupted, InvalidArgument, InvalidTokenId, PromptTooLong
from host.executors import Executor, ParkedState, StepOutput
from host.generation import Delta, Generation, GenerationResult, Timings
from host.reply import ReplyPlan, plan_reply
from host.stops import StopMatcher
from host.sampling import Sampler, SamplingParams, check_generation_args, token_logprobs
from host.speculate import parse_speculate, speculator, unavailable
from loader.config import FIRST_PADDING_ID, IM_START_ID

CKPT_ALIGN = 64        # GDN prefill chunk: state checkpoints sit on multiples of it (article Part 5.4)
PREFILL_PIECE = 256    # longest prefill call (a multiple of CKPT_ALIGN) unless the executor says otherwise
                       # (Executor.max_prefill_piece: the CPU paths' [T, V] logits; None on the GPU executors)
MAX_CHECKPOINTS = 8    # state snapshots kept per session (the newest)
MAX_TOP_LOGPROBS = 20  # most alternatives per token ``logprobs=`` may ask for (OpenAI's top_logprobs limit)
MAX_DRAFTS = 7         # speculative decoding: drafts per round at most (host.speculate.MAX_K)
MAX_FORCED = 7         # forced tokens run with the pending one in a pass of at most 8 rows


def validate_ids(ids: Sequence[int], vocab_size: int, what: str = "prompt", allow_empty: bool = False) -> list[int]:
    """ids as a list of ints; raises InvalidArgument (not a sequence, or a str), EmptyPrompt (unless
    allow_empty), or InvalidTokenId naming the first bad index and id."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise InvalidArgument(f"{what}: expected a sequence of integer token ids, got {type(ids).__name__}"
                              + (" (encode text with engine.encode(...) first)" if isinstance(ids, str) else ""))
    if isinstance(ids, (list, tuple)) and ids and all(type(t) is int for t in ids):
        # every turn hands the whole conversation (32k ids: ≈ 19 ms in the loop below on the 2-core machine): plain
        # ints are checked at once; anything out of range falls through to the loop, which names the first bad one
        try:
            a = np.fromiter(ids, np.int64, len(ids))
        except OverflowError:
            a = None
        if a is not None and a.min() >= 0 and a.max() < min(vocab_size, FIRST_PADDING_ID):
            return list(ids)
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise InvalidTokenId(f"{what}[{i}] = {t!r}: expected an integer token id")
        t = int(t)
        if not 0 <= t < vocab_size:
            raise InvalidTokenId(f"{what}[{i}] = {t}: outside the vocabulary [0, {vocab_size})")
        if t >= FIRST_PADDING_ID:
            raise InvalidTokenId(f"{what}[{i}] = {t}: a padding id ({FIRST_PADDING_ID}..{vocab_size - 1}), "
                                 "never a real token")
        out.append(t)
    if not out and not allow_empty:
        raise EmptyPrompt(f"{what} is empty: nothing to condition on")
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def tokens_text(n: int) -> str:
    """``1 token``, ``3 tokens``."""
    return f"{n} token" + ("" if n == 1 else "s")


def session_capacity(engine) -> int:
    """Tokens a session of ``engine`` holds: the executor's capacity, at most the model's context."""
    return min(engine.executor.capacity, engine.cfg.max_position_embeddings)


def prepare(engine, prompt_ids: Sequence[int], *, max_new_tokens: int | None = None, temperature: float = 0.0,
            top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
            stop: Sequence[str] | None = (), stop_ids: Sequence[int] | None = None,
            checkpoint_at: Sequence[int] = (), tools: list | None = None, tool_choice=None,
            response_format: dict | None = None, reasoning: bool = False, tool_grammar: bool = True,
            min_p: float | None = None, logprobs: int | None = None, speculate=None) -> tuple:
    """Every check of ``Session.generate`` that needs no slot (its arguments and raises, the session's own state
    aside), done before any work; returns the arguments of ``Session._loop`` after the Generation. Shared with the
    one-shot ``Engine.generate`` / ``chat``, which take a slot only when their Generation starts. The agent
    arguments (``tools`` … ``tool_grammar``) go to ``host.reply.plan_reply``, which compiles their grammar."""
    cfg = engine.cfg
    prompt = validate_ids(prompt_ids, cfg.vocab_size)
    cap = session_capacity(engine)
    if len(prompt) >= cap:  # vLLM: prompt + generated <= max_model_len, and at least one token is generated
        raise PromptTooLong(f"prompt has {len(prompt)} tokens; the session holds at most {cap} "
                            f"(executor capacity {engine.executor.capacity}, model context "
                            f"{cfg.max_position_embeddings})"
                            + ("" if len(prompt) > cap else ", prompt and reply together: no room is left for a "
                               "reply"))
    if stop is None:  # vLLM's default
        stop = ()
    if isinstance(stop, str):
        stop = [stop]
    if any(not isinstance(s, str) or not s for s in stop):
        raise InvalidArgument(f"stop: expected non-empty strings, got {list(stop)!r}")
    stop_set = set(cfg.eos_token_ids if stop_ids is None
                   else validate_ids(stop_ids, cfg.vocab_size, "stop_ids", allow_empty=True))
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, (int, np.integer))
                                 or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise InvalidArgument(f"logprobs: expected an integer in [0, {MAX_TOP_LOGPROBS}] (the most likely "
                              f"alternatives reported per token; None = no log-probabilities), got {logprobs!r}")
    params = SamplingParams(temperature, top_k, top_p, seed, min_p)  # the shared check last: it may warn
    max_new = check_generation_args(params, max_new_tokens, engine.executor.capacity, cfg.max_position_embeddings)
    plan = plan_reply(engine, tools=tools, tool_choice=tool_choice, response_format=response_format,
                      reasoning=reasoning, tool_grammar=tool_grammar)
    spec = parse_speculate(speculate)
    return (prompt, max_new, list(stop), stop_set, Sampler(params), [int(m) for m in checkpoint_at], plan,
            None if logprobs is None else int(logprobs), spec)


def render_turn(engine, messages: list[dict], tools: list[dict] | None,
                enable_thinking: bool) -> tuple[list[int], list[int]]:
    """(prompt ids, checkpoint positions) of a chat turn: the rendered conversation and the start of its
    generation prompt (the last ``<|im_start|>``), where the next turn's render usually diverges."""
    ids = engine.render_chat(messages, tools, enable_thinking)
    starts = [i for i, t in enumerate(ids) if t == IM_START_ID]
    return ids, starts[-1:]


class Session:
    """A conversation's state resident in one executor slot between turns.

    ``generate(prompt_ids, ...)`` takes the whole prompt each turn (not a suffix). ``ids`` are the tokens whose
    effect is in the state; ``checkpoints`` are (position, snapshot) pairs, the newest MAX_CHECKPOINTS: the last
    multiple of 64 each prefill reaches, and the generation-prompt start of each chat turn. Create through
    ``Engine.new_session()``; ``close()`` returns the slot; ``park()`` / ``unpark()`` move it to host memory and
    back; ``fork()`` makes a second session from its state (an agent trying two continuations).
    """

    def __init__(self, engine, slot: int):
        self._fields(engine, slot)
        self._ex().reset(slot)

    def _fields(self, engine, slot: int | None) -> None:
        self.engine, self.slot = engine, slot
        self.closed = False
        self.oneshot = False  # opened by a one-shot Engine.generate / chat: closed when its Generation ends
        self.ids: list[int] = []
        self.checkpoints: list[tuple[int, object]] = []
        self._last: StepOutput | None = None  # output of the last processed token (valid when ids non-empty)
        self._outs: dict[int, StepOutput] = {}  # host-side outputs at checkpoint positions (see _checkpoint)
        self._pending = None                   # weakref to the last Generation made, until it ends
        self._parked: ParkedState | None = None  # the state while parked in host memory (slot is then None)

    def _ex(self) -> Executor:
        self._check_open()  # a Generation made before close() must not run on a slot that may be reused
        ex = self.engine.executor
        ex.select(self.slot)
        return ex

    @property
    def capacity(self) -> int:
        """Tokens this session holds, prompt and reply together: the executor's capacity, at most the model's
        context (max_position_embeddings)."""
        return session_capacity(self.engine)

    def close(self) -> None:
        """Give the slot back (or drop the parked state); the session can no longer be used (EngineError).
        Closing twice is a no-op."""
        if self.closed:
            return
        self.closed = True
        if self._parked is not None:
            self._parked = None
        else:
            self.engine._release_slot(self.slot)

    def _check_open(self) -> None:
        if self.closed:
            raise EngineError("this session is closed (its slot may belong to another session now); "
                              "open a new one with Engine.new_session()")
        if self._parked is not None:
            raise EngineError("this session is parked in host memory: unpark() it into a slot first")

    # ------------------------------------------------------------------ parking (host memory)
    @property
    def parked(self) -> ParkedState | None:
        """The ParkedState while the session is parked (``park()``), else None."""
        return self._parked

    def park(self) -> ParkedState:
        """Move the session's whole state (the executor slot's and its checkpoints' snapshots) into host memory
        (``Executor.park``) and give its slot back; ``ids``, checkpoint positions and the host-side outputs stay.
        The output of the last token is kept when it is host logits (the cpu executors); a GPU executor's reads
        device buffers that the next session reuses, so it is dropped (the same prompt again then re-runs its
        last token). Returns the ParkedState (``nbytes``: host memory held). Raises EngineError when the session
        is closed, parked or generating; NotImplementedError when the executor cannot park."""
        self._check_idle()
        parked = self._ex().park([snap for _, snap in self.checkpoints])
        self._hold(parked, self)
        self.engine._release_slot(self.slot)
        self.slot = None
        return parked

    def _hold(self, parked: ParkedState, src: "Session") -> None:
        """Hold ``parked``, ``src``'s state in host memory: ``src``'s checkpoint positions (their snapshots are in
        ``parked``) and its last output when that is host logits (a GPU output reads device buffers reused later)."""
        self.checkpoints = [(p, None) for p, _ in src.checkpoints]
        self._last = src._last if type(src._last) is StepOutput else None
        self._parked = parked

    def unpark(self) -> int:
        """Put a parked session back into a free slot (``Executor.unpark``): it continues bit-identically to a
        session never parked. Returns the slot. Raises EngineError when it is not parked, is closed, or no slot
        is free (nothing changes then)."""
        if self.closed:
            self._check_open()
        if self._parked is None:
            raise EngineError("unpark: this session is not parked")
        slot = self.engine._take_slot()
        try:
            snaps = self.engine.executor.unpark(self._parked, slot)
        except BaseException:
            self.engine._release_slot(slot)
            raise
        self.checkpoints = [(p, snap) for (p, _), snap in zip(self.checkpoints, snaps)]
        self._parked, self.slot = None, slot
        return slot

    def fork(self) -> "Session":
        """A second session with this one's history and state: the same ``ids``, checkpoints and host-side outputs,
        the state copied through host memory (``Executor.park`` of this slot and of its checkpoints' snapshots;
        this session keeps its slot and its state). The fork then takes a free slot (``unpark``) when there is
        one, else it stays parked: ``unpark()`` it once a slot is free (a GPU engine has one: park or close this
        session first). Each continues as a session that never forked would. Raises EngineError when this
        session is closed, parked or generating; NotImplementedError when the executor cannot park."""
        self._check_idle()
        parked = self._ex().park([snap for _, snap in self.checkpoints])
        child = Session.__new__(Session)
        child._fields(self.engine, None)
        child.ids = list(self.ids)
        child._outs = dict(self._outs)  # host-side outputs only (``_checkpoint``)
        child._hold(parked, self)
        if self.engine._free:
            child.unpark()
        return child

    def _check_idle(self) -> None:
        self._check_open()
        prev = self._pending() if self._pending is not None else None
        if prev is not None and prev._result is None and not prev._closed:
            raise EngineError("this session is generating: finish or close() its Generation first")

    # ------------------------------------------------------------------ state bookkeeping
    def _rewind(self, pos: int) -> int:
        """Put the state back to the newest checkpoint at or before ``pos``; returns its position."""
        ex = self._ex()
        self.checkpoints = [(p, s) for p, s in self.checkpoints if p <= pos]
        if self.checkpoints:
            p, snap = self.checkpoints[-1]
            ex.state_restore(snap)
        else:
            p = 0
            ex.reset(self.slot)
        self.ids = self.ids[:p]
        self._outs = {q: o for q, o in self._outs.items() if q <= p}
        self._last = self._outs.get(p)
        return p

    def _prefill(self, new: list[int], marks: Sequence[int] = ()) -> int:
        """Run ``new`` after ``self.ids`` in pieces that start on multiples of 64 (after a first piece up to the
        next one) and are at most the executor's ``max_prefill_piece`` (PREFILL_PIECE by default) long, or, for
        an executor without a bound (the GPU ones), in one piece up to each snapshot position; snapshot the state
        at the last multiple of 64 reached and at each position in ``marks`` (turn starts: a restart there is
        valid, though chunks are then anchored off the 64 grid; a mark at the end keeps the end's output too, so
        the same prompt again runs nothing). Returns the number of tokens run."""
        ex = self._ex()
        cap = getattr(ex, "max_prefill_piece", PREFILL_PIECE)
        start, end = len(self.ids), len(self.ids) + len(new)
        last_b = end // CKPT_ALIGN * CKPT_ALIGN
        stops = sorted({m for m in marks if start < m <= end} | ({last_b} if last_b > start else set()))
        while len(self.ids) < end:
            p = len(self.ids)
            if cap is None:
                nxt = end
            else:
                nxt = -(-p // CKPT_ALIGN) * CKPT_ALIGN if p % CKPT_ALIGN else p + cap
            nxt = min([nxt, end] + [m for m in stops if m > p])
            piece = new[p - start:nxt - start]
            out = ex.prefill(piece)
            self.ids += piece
            self._last = out
            if nxt in stops:
                self._checkpoint()
        return end - start

    def _checkpoint(self) -> None:
        pos = len(self.ids)
        if self.checkpoints and self.checkpoints[-1][0] == pos:
            return
        self.checkpoints.append((pos, self._ex().state_snapshot()))
        self.checkpoints = self.checkpoints[-MAX_CHECKPOINTS:]
        if type(self._last) is StepOutput:  # logits on the host (a GPU output reads device buffers reused later)
            self._outs[pos] = self._last
        kept = {p for p, _ in self.checkpoints}
        self._outs = {q: o for q, o in self._outs.items() if q in kept}

    def _sync(self, prompt: list[int], marks: Sequence[int] = ()) -> tuple[StepOutput, int, int, str]:
        """Bring the state to ``prompt``; returns (last output, reused tokens, prefilled tokens, note)."""
        common = _common_prefix(self.ids, prompt)
        if common == len(self.ids) == len(prompt) and self._last is not None:
            return self._last, common, 0, f"prompt equals the session's {common} tokens: nothing to run"
        note = ""
        if common == len(prompt) and common in self._outs:  # a checkpoint at the prompt's end kept its output
            had = len(self.ids)
            self._rewind(common)
            return self._last, common, 0, f"prompt is the first {common} of the session's {had} tokens: restored " \
                                          "the checkpoint at its end, nothing to run"
        if common == len(prompt):  # prompt is a prefix of the state: need the last prompt token's output again
            common -= 1
        if common < len(self.ids):
            had = len(self.ids)
            back = self._rewind(common)
            note = (f"prompt diverges from the session's {had} tokens at token {common}; "
                    + (f"re-ran from the checkpoint at {back}" if back else "no checkpoint before it: fresh prefill"))
        elif common:
            note = f"appended to the session's {common} tokens"
        reused = len(self.ids)
        ran = self._prefill(prompt[reused:], marks)
        return self._last, min(common, reused), ran, note

    # ------------------------------------------------------------------ the decode loop
    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int | None = None, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop: Sequence[str] = (), stop_ids: Sequence[int] | None = None,
                 checkpoint_at: Sequence[int] = (), tools: list | None = None, tool_choice=None,
                 response_format: dict | None = None, reasoning: bool = False,
                 tool_grammar: bool = True, min_p: float | None = None,
                 logprobs: int | None = None, speculate=None) -> Generation:
        """Continue the conversation whose whole token stream is ``prompt_ids``; returns a streaming Generation.

        Stops on ``stop_ids`` (default: the config's eos ids 248046, 248044), on any ``stop`` string matched on
        the detokenised text (text past it is never emitted), after ``max_new_tokens``, or when the session is
        full: prompt and generated tokens together reach ``capacity``, vLLM's rule (finish_reason ``stop`` for the
        first two, ``length`` for the others; see GenerationResult). ``max_new_tokens``: at most ``capacity`` - 1
        (the prompt takes at least one token; as the CLI's ``--max-new-tokens``); None = 256, or ``capacity`` - 1
        when smaller. ``temperature``: 0 = greedy, and so is any value below 1e-5 (vLLM's rule). ``top_k`` /
        ``top_p`` / ``min_p`` / ``seed`` act only when sampling (temperature >= 1e-5). ``logprobs``: None, or
        k in [0, 20]: each Delta then carries ``logprobs``, per id (id, its log-probability, the k most likely
        (id, log-probability) pairs) under the model's raw distribution (``host.sampling.token_logprobs``).
        ``checkpoint_at``: extra prompt positions to snapshot (``chat`` passes the start of the generation
        prompt, where a re-rendered history usually diverges).
        Agent arguments (docs/agent.md): ``tools`` (OpenAI tool list: the reply's tool calls are parsed by token id
        and typed by their schemas), ``tool_choice`` (``auto`` | ``required`` | ``none`` | a function name),
        ``response_format`` (``{"type": "json_object"}`` | ``{"type": "json_schema", "json_schema": {"schema":
        S}}`` | ``{"type": "regex", "pattern": P}``), ``reasoning`` (the prompt ends inside a reasoning block:
        ``chat`` passes ``enable_thinking``), ``tool_grammar`` (constrain tool calls with xgrammar; default True).
        A grammar masks every step's logits, greedy included (``host.grammar``); the result carries
        ``reasoning_content``, ``content``, ``tool_calls``, ``invalid_tool_calls`` (GenerationResult).
        ``speculate``: ``"off"``, ``"auto"`` (k chosen per round by measurement) or K drafts per round (0..7; 0 =
        off); None = ``host.speculate.DEFAULT_SPECULATE``. MTP speculative decoding (docs/speculation.md): greedy
        output is identical to plain decoding; sampled output has the same distribution (not the same draws for a
        seed). Where the executor cannot speculate (the GPU executors, a model without an MTP head, a grammar or ``logprobs`` in force) it decodes
        plainly and ``timings.speculate`` says why.

        Raises, before any work: EmptyPrompt (no ids); InvalidTokenId (an id outside the vocabulary or a padding
        id, in the prompt or ``stop_ids``); PromptTooLong (the prompt leaves no room in ``capacity``
        for a reply: it has ``capacity`` tokens or more, refused as vLLM does);
        InvalidArgument (prompt_ids not a sequence of ints, max_new_tokens not an integer >= 1 or not below
        ``capacity`` or the model's context, a sampling parameter out of range, an empty stop string);
        RequestError, an InvalidArgument with ``.param`` (tools not a tool list, an unknown tool_choice or function
        name, a response_format xgrammar rejects; ``host.reply.plan_reply``);
        EngineError (this session is closed or already generating). Warns IgnoredArgumentWarning when decoding is
        greedy and top_k, top_p or seed is given (they are ignored; ``host.sampling.check_generation_args``).
        While running: GenerationInterrupted on KeyboardInterrupt (the session is rolled back to a checkpoint and
        stays usable; a one-shot ``Engine.generate`` / ``chat`` keeps nothing: its session is closed); the
        Generation then has no result (``result()`` / ``text`` raise GenerationInterrupted again).
        """
        self._check_open()
        prev = self._pending() if self._pending is not None else None
        if prev is not None and prev._result is None and not prev._closed:
            # a Generation made and not yet finished, closed or dropped (even one not started yet: two of them
            # stepped in turn would share the slot's state)
            raise EngineError("this session is already generating: finish or close() its Generation first")
        job = prepare(self.engine, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                      top_p=top_p, seed=seed, stop=stop, stop_ids=stop_ids, checkpoint_at=checkpoint_at,
                      tools=tools, tool_choice=tool_choice, response_format=response_format, reasoning=reasoning,
                      tool_grammar=tool_grammar, min_p=min_p, logprobs=logprobs, speculate=speculate)
        g = Generation(lambda g: self._loop(g, *job))
        self._pending = weakref.ref(g)
        return g

    def chat(self, messages: list[dict], *, tools: list[dict] | None = None, enable_thinking: bool = True,
             **kw) -> Generation:
        """Render ``messages`` (the whole conversation) with the checkpoint's chat template and generate. The state
        at the generation prompt's ``<|im_start|>`` is kept: the next turn's render drops this turn's reasoning
        and re-tokenises its reply, so it diverges there and re-runs from that point, not from scratch."""
        ids, marks = render_turn(self.engine, messages, tools, enable_thinking)
        return self.generate(ids, checkpoint_at=marks, tools=tools, reasoning=enable_thinking, **kw)

    def _spec(self, mode, tm: Timings, plain: str | None = None):
        """(Speculator or None, fixed k or None for auto) for ``mode``; ``tm.speculate`` records what runs.
        ``plain``: a reason of this generation's to decode plainly (a grammar, ``logprobs``)."""
        if mode == "off":
            tm.speculate = "off"
            return None, None
        if plain is not None:
            tm.speculate = f"off ({plain}; plain decode)"
            return None, None
        why = unavailable(self.engine)
        if why is not None:
            tm.speculate = f"off ({why}; plain decode)"
            return None, None
        sp = speculator(self.engine)
        tm.speculate = str(mode)
        return sp, (None if mode == "auto" else int(mode))

    def _loop(self, g: Generation, prompt: list[int], max_new: int, stops: list[str], stop_set: set[int],
              sampler: Sampler, marks: list[int], plan: ReplyPlan, n_logprobs: int | None = None,
              spec_mode="off") -> Iterator[Delta]:
        ex = self.engine.executor
        tm = Timings(prompt_tokens=len(prompt))
        detok, match = self.engine.new_detok(), StopMatcher(stops)
        reply, gram = plan.parser(self.engine.tokenizer, stops), plan.constraint(self.engine.cfg.vocab_size)
        cfg_eos = set(self.engine.cfg.eos_token_ids)
        out_ids: list[int] = []
        paused = 0.0
        finish, why, stop_reason = None, "", None
        tried, acc = np.zeros(8, np.int64), np.zeros(8, np.int64)   # this generation, draft positions 1..7

        def choose(out: StepOutput, allowed: np.ndarray | None = None) -> int | None:
            """The next id for a step's output under the grammar's mask (``allowed``: that mask, computed
            already); None when the grammar admits nothing (the turn ends with finish reason
            ``grammar_dead_end``)."""
            nonlocal finish, why
            if out.token is None and out.logits is None:
                raise EngineError(f"{ex.name} executor returned neither logits nor a token")
            if allowed is None and gram is not None:
                allowed = gram.allowed()
            if allowed is not None and not allowed.any():
                finish, why = "grammar_dead_end", "grammar_dead_end"
                return None
            return sampler.choose(out, allowed)

        def dead_end() -> Delta:
            """The last Delta of a turn the grammar ended: the held-back text and the reply parser's rest."""
            text, _ = match.feed(detok.flush())
            return self._delta(text + match.flush(), [], finish, None, reply.finish())

        def emit(tok: int, out: StepOutput | None = None) -> Delta:
            """Account for one emitted token: grammar, stop ids, max tokens, capacity, stop strings, the reply's
            reasoning / content / tool calls, its log-probabilities from ``out`` (the step that chose it; with
            ``logprobs`` asked for, speculation is off, so every token has one); its Delta."""
            nonlocal finish, why, stop_reason
            lps = None if n_logprobs is None else [(tok, *token_logprobs(out.logits, tok, n_logprobs))]
            out_ids.append(tok)
            if gram is not None and not gram.accept(tok):  # the mask admitted it: a bug, not bad input
                raise EngineError(f"grammar refused token {tok}, which its own mask admitted")
            ended = gram is not None and gram.terminated
            if tok in stop_set or (ended and tok in cfg_eos):
                finish, piece = "stop", detok.flush()
                why, stop_reason = ("eos", None) if tok in cfg_eos else ("stop_token", tok)
            else:
                piece = detok.push(tok)
                if len(out_ids) == max_new:
                    finish, why = "length", "max_new_tokens"
                elif len(prompt) + len(out_ids) >= self.capacity:  # vLLM's prompt + output <= max_model_len;
                    finish, why = "length", "capacity"               # a turn's prompt holds its history
                if finish:
                    piece += detok.flush()
            text, hit = match.feed(piece)
            if hit is not None:
                finish, why, stop_reason = "stop", "stop_string", hit
            elif finish:
                text += match.flush()
            pieces = reply.feed(tok)
            if finish:
                pieces = _merge(pieces, reply.finish())
                if finish == "stop" and why == "eos" and reply.ends_with_calls:
                    finish = "tool_calls"
            return self._delta(text, [tok], finish, stop_reason, pieces, lps)

        try:
            plain = ("a grammar constrains the output" if gram is not None
                     else "logprobs were asked for" if n_logprobs is not None else None)
            force = gram is not None and n_logprobs is None and getattr(self.engine, "jump_forward", True)
            sp, k_fixed = self._spec(spec_mode, tm, plain)  # the first use builds the MTP head: not in the timings
            t0 = time.perf_counter()
            out, tm.reused_tokens, tm.prefilled_tokens, note = self._sync(prompt, marks)
            t1 = time.perf_counter()
            tm.prefill_ms = (t1 - t0) * 1e3
            tok = choose(out)
            t_first = time.perf_counter()
            tm.ttft_ms = (t_first - t0) * 1e3
            deltas = [emit(tok, out) if tok is not None else dead_end()]
            if sp is not None:
                self._ex()
                sp.begin()
            while True:
                for d in deltas:
                    ty = time.perf_counter()
                    yield d  # hand the text out before the next step computes
                    paused += time.perf_counter() - ty  # time the consumer held the stream is not decode time
                if finish is not None:
                    break
                room = min(max_new - len(out_ids), self.capacity - len(prompt) - len(out_ids)) - 1
                k = 0
                if sp is not None:
                    k = min(k_fixed if k_fixed is not None else sp.chooser.choose(MAX_DRAFTS), max(room, 0))
                ts = time.perf_counter()
                if k == 0:
                    # forced tokens (jump-forward by token): while the grammar admits exactly one id next, emit it
                    # now and run it with the pending token as rows of one pass, as plain decoding's steps would
                    # have chosen it whatever their logits (a sampler's draw is spent for it all the same)
                    deltas, allowed = [], None
                    while force and finish is None and len(deltas) < MAX_FORCED:
                        allowed = gram.allowed()
                        if np.count_nonzero(allowed) != 1:
                            break
                        f = int(np.argmax(allowed))
                        allowed = None
                        if not sampler.params.greedy:
                            sampler.rng.random()
                        deltas.append(emit(f))
                    forced = out_ids[len(out_ids) - len(deltas):] if deltas else []
                    run = [tok] + (forced if finish is None else forced[:-1])  # a stopping id is never run
                    tm.forced_tokens += len(forced)
                    out = self._ex().step(tok) if len(run) == 1 else self._ex().step_rows(run)  # re-select the
                    self.ids += run                                        # slot: another session may have run
                    self._last = out
                    tm.steps += 1
                    if finish is None:
                        tok = choose(out, allowed)
                        deltas.append(emit(tok, out) if tok is not None else dead_end())
                    if sp is not None:
                        sp.observed(0, 0, (time.perf_counter() - ts) * 1e3)
                    continue
                self._ex()
                emitted, logits, a = sp.round(tok, k, sampler)
                tm.steps += 1
                tm.rounds += 1
                n = min(a + 1, k)
                tried[1:n + 1] += 1
                acc[1:a + 1] += 1
                deltas = []
                for e in emitted:  # a stop inside the accepted run truncates the run and the state
                    deltas.append(emit(e))
                    if finish is not None:
                        break
                rows = len(deltas)  # the pending token and the drafts before the last emitted token
                sp.commit(rows, emitted[:rows])
                self.ids += [tok] + emitted[:rows - 1]
                self._last = StepOutput(logits=logits[rows - 1])
                tok = emitted[rows - 1]
                sp.observed(k, a, (time.perf_counter() - ts) * 1e3)
        except KeyboardInterrupt:
            back = self._rewind(len(self.ids))
            raise GenerationInterrupted(f"generation interrupted after {tokens_text(len(out_ids))}; " + (
                "its one-shot session is closed (the deltas streamed before are all there is of it)" if self.oneshot
                else f"the session was rolled back to {tokens_text(back)} (its last checkpoint; the next turn "
                     "recomputes the conversation from there) and stays usable"),
                len(out_ids)) from None
        except GeneratorExit:  # closed at a yield: the state is consistent
            raise
        except BaseException:
            self._rewind(len(self.ids))  # state may be half-updated: return to a clean checkpoint
            raise
        finally:
            self._pending = None  # ended (finished, failed or closed): the next turn may start
        t2 = time.perf_counter()
        tm.generated_tokens = len(out_ids)
        busy = t2 - t_first - paused
        tm.decode_ms = busy * 1e3
        if len(out_ids) > 1 and busy > 0:
            tm.decode_tokens_per_s = (len(out_ids) - 1) / busy
            tm.ms_per_token = busy * 1e3 / (len(out_ids) - 1)
        tm.tokens_per_step = len(out_ids) / (1 + tm.steps)
        if tm.rounds:
            tm.tokens_per_round = (len(out_ids) - 1 - (tm.steps - tm.rounds)) / tm.rounds
            last = int(np.max(np.flatnonzero(tried), initial=0))
            tm.acceptance = [round(float(acc[i] / tried[i]), 4) for i in range(1, last + 1)]
            tm.acceptance_counts = [[int(acc[i]), int(tried[i])] for i in range(1, last + 1)]
        g._result = GenerationResult(match.text, out_ids, finish, stop_reason, why, tm, ex.name, ex.detail,
                                     sampler.seed, asdict(sampler.params), note, prompt,
                                     reply.reasoning_content, reply.content, reply.tool_calls,
                                     reply.invalid_tool_calls, reply.tool_call_warnings,
                                     gram.report() if gram is not None else None)

    @staticmethod
    def _delta(text: str, ids: list[int], finish, stop_reason, pieces, logprobs=None) -> Delta:
        return Delta(text, ids, finish, stop_reason, pieces.reasoning, pieces.content, pieces.tool_calls, logprobs)


def _merge(a, b):
    """Two ``host.reply.ReplyPieces`` as one (the last id's pieces and the parser's final ones)."""
    a.reasoning += b.reasoning
    a.content += b.content
    a.tool_calls += b.tool_calls
    a.invalid += b.invalid
    return a
