"""The Python API: ``Engine.load(...)`` then ``engine.chat(messages)`` / ``engine.generate(ids)`` or sessions.

    eng = Engine.load()                      # tiny synthetic checkpoint, CPU when there is no GPU
    for d in eng.chat([{"role": "user", "content": "Hi"}], max_new_tokens=8):
        print(d.text, end="")
    s = eng.new_session()                    # keeps the conversation's state between turns
    r = s.chat(messages, max_new_tokens=64).result()   # r.text, r.ids, r.finish_reason ("stop" | "length"), ...
    text = eng.generate(ids, max_new_tokens=8).text      # the whole text at once, as vLLM's output.text

``chat`` and ``generate`` on the engine run in a fresh session each call (nothing kept), which holds a slot only
while its Generation runs, so one-shot calls never exhaust the slots: ``[eng.generate(p) for p in prompts]``
then ``.text`` of each works for any number of prompts. A ``Session`` holds its slot until ``close()``, keeps
state and processes only what a new turn appends (``host.session``).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from host.errors import EmptyPrompt, EngineError, InvalidArgument, ModelLoadError
from host.executors import CPU_KINDS, Executor, check_kind, default_kind, make_executor
from host.generation import Generation
from host.grammar import GrammarCache, tool_names
from host.limits import DEFAULT_CAPACITY
from host.model_dir import _resolve_model, cache_error
from host.model_dir import synthetic_marker  # noqa: F401 - re-exported: part of this module's API
from host.prompt_text import encode_prompt, shield
from host.sampling import check_text
from host.session import Session, prepare, render_turn
from loader.chat_template import ChatTemplate
from loader.checkpoint import Checkpoint, CheckpointError
from loader.config import ConfigError, ModelConfig, preset
from loader.detok import StreamDetokenizer
from loader.synthetic import SyntheticWeights
from loader.tokenizer import Tokenizer, TokenizerError

DEFAULT_SLOTS = 4


class Engine:
    """A loaded model: config, weights, tokenizer, chat template and one executor with session slots.

    Build with :meth:`load`. Attributes: ``cfg`` (ModelConfig), ``model_dir``, ``tokenizer``, ``template``,
    ``executor``.
    """

    def __init__(self, cfg: ModelConfig, model_dir: Path, weights, tokenizer, template, executor: Executor):
        self.cfg, self.model_dir, self.weights = cfg, model_dir, weights
        self.tokenizer, self.template, self.executor = tokenizer, template, executor
        self._free = list(range(executor.slots))
        self._grammars = None

    @property
    def grammars(self):
        """The engine's ``host.grammar.GrammarCache``: every grammar compiled once per distinct schema / regex /
        tool list, made on the first constrained request."""
        if self._grammars is None:
            self._grammars = GrammarCache(self.tokenizer, self.cfg.eos_token_ids, self.cfg.vocab_size)
        return self._grammars

    @classmethod
    def load(cls, path_or_preset: str | Path | None = None, executor: str | None = None, *,
             capacity: int | None = None, slots: int = DEFAULT_SLOTS, seed: int = 0,
             quiet: bool = False) -> "Engine":
        """Open a checkpoint directory, a trained model (``qwen3.5-tiny-trained``, ``loader.trained``; the default when
        no argument is given) or a synthetic preset (``tiny``, ``qwen3.5-27b``) and start an executor.

        ``executor``: ``megakernel`` | ``graph`` | ``cpu`` | ``cpu-vm``; None = graph when a GPU is present (the faster
        of the two bit-identical GPU paths, measured), else cpu (fast float32 NumPy; ``cpu-vm`` = the bit-exact
        reference + CPU VM).
        ``capacity``: tokens per session slot, prompt and reply together, at least 2 (vLLM's prompt + generated
        <= max_model_len with a prompt of at least 1 token and at least one generated token); None =
        DEFAULT_CAPACITY (4096), or the model's context (max_position_embeddings) when smaller, as vLLM takes its
        default length from the model.
        ``seed``: of the synthetic weights of a preset.
        Raises ModelLoadError (bad directory, failed validation), InvalidArgument (a ``path_or_preset`` that is not a
        str / Path, an unknown executor name, ``slots`` < 1, a capacity < 2, one above the model's context or one
        whose state does not fit in memory), ExecutorUnavailable (a valid executor that cannot run here: a GPU
        one without a GPU, or the cpu executor, the default without a GPU, for a model too large for it such as the
        27B preset), EnvironmentIOError (the first-use cache directory, ``$QWEN_MK_CACHE``, cannot be written:
        read-only, full, or a file; nothing partial is left in it). ``quiet`` drops the stderr warnings printed for synthetic weights (a preset, or a directory
        written by ``qwen-mk make-checkpoint``) and for what the checkpoint reader tolerated (``Checkpoint.warnings``:
        a checkpoint without its ``mtp.*`` head loads with speculation off), and the progress bar of a GPU executor's
        weight upload from a checkpoint directory (bytes and GB/s on stderr, shown only when it is a terminal;
        ``discrete.weights_gpu.WeightsGPU.from_source``). A shard found cut short during the upload is a
        ModelLoadError naming the file and tensor.
        """
        kind = executor or default_kind()
        check_kind(kind)  # before reading any weights
        if path_or_preset is not None and not isinstance(path_or_preset, (str, Path)):
            raise InvalidArgument(f"path_or_preset: expected a checkpoint directory (str or Path) or a preset name, "
                                  f"got {type(path_or_preset).__name__} {path_or_preset!r}")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 2):
            raise InvalidArgument(f"capacity: expected an integer >= 2 (the session holds the prompt, at least 1 "
                                  f"token, and at least one generated token), got {capacity!r}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise InvalidArgument(f"slots: expected a positive integer (sessions open at once), got {slots!r}")
        try:
            model_dir, synthetic = _resolve_model(path_or_preset, seed, quiet, kind, defaulted=executor is None)
        except OSError as e:  # the first-use cache: read-only, full, or a file where its directory should be
            raise cache_error(e) from e
        try:
            if synthetic is not None and kind not in CPU_KINDS:
                weights = SyntheticWeights(preset(synthetic), seed)  # drawn on the GPU by the executor
            else:
                weights = Checkpoint.open(model_dir)
                for w in weights.warnings if not quiet else ():  # what the loader tolerated (a missing MTP head)
                    print(f"qwen-mk: warning: {w}", file=sys.stderr)
            tokenizer = Tokenizer.from_checkpoint(model_dir)
            template = ChatTemplate.from_checkpoint(model_dir)
        except (CheckpointError, ConfigError, TokenizerError, FileNotFoundError, OSError, ValueError) as e:
            msg = str(e)  # loader messages usually start with the path already: name it once
            raise ModelLoadError(msg if str(model_dir) in msg else f"model directory {model_dir}: {msg}") from e
        ctx = weights.config.max_position_embeddings
        if capacity is None:
            capacity = min(DEFAULT_CAPACITY, ctx)
        if capacity > ctx:  # as vLLM refuses a max_model_len above the model's context
            raise InvalidArgument(f"capacity: {capacity} tokens exceeds the model's context of {ctx} "
                                  f"(max_position_embeddings)")
        try:
            ex = make_executor(kind, weights, capacity, slots,
                               progress=None if quiet or synthetic is not None else f"loading {model_dir}")
        except CheckpointError as e:  # found while uploading (a shard cut short since it was opened)
            msg = str(e)
            raise ModelLoadError(msg if str(model_dir) in msg else f"model directory {model_dir}: {msg}") from e
        except MemoryError as e:  # host (NumPy) state of the CPU executor
            raise InvalidArgument(f"capacity: the state of {slots} session slot(s) × {capacity} tokens does not fit "
                                  f"in host memory ({e}); lower --capacity") from e
        except Exception as e:  # noqa: BLE001 - CuPy's device allocation error, without importing CuPy here
            if type(e).__name__ == "OutOfMemoryError":
                raise InvalidArgument(f"capacity: the KV cache and state of {slots} session slot(s) × {capacity} "
                                      f"tokens do not fit in GPU memory ({e}); lower --capacity") from e
            raise
        return cls(weights.config, model_dir, weights, tokenizer, template, ex)

    # ------------------------------------------------------------------ sessions
    def new_session(self) -> Session:
        """A session in a free executor slot. Raises EngineError when every slot is taken."""
        return Session(self, self._take_slot())

    def _take_slot(self) -> int:
        """A free slot, taken. Raises EngineError when every slot is in use."""
        if not self._free:
            raise EngineError(f"all {self.executor.slots} session slots are in use (open sessions and one-shot "
                              "generations still streaming); close() a session or finish a generation first")
        return self._free.pop(0)

    def _release_slot(self, slot: int) -> None:
        if slot not in self._free:
            self._free.append(slot)

    def new_detok(self):
        return StreamDetokenizer(self.tokenizer)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    enable_thinking: bool = True) -> list[int]:
        """Prompt ids of a conversation through the checkpoint's chat template (generation prompt added).
        Control-token text in the messages or tools (``<|im_end|>``, ``</tool_response>``...) is encoded as
        ordinary text, never as the control id (``host.prompt_text``). Raises EmptyPrompt for no messages,
        InvalidArgument for a malformed conversation (RequestError, param ``messages`` / ``tools``, for text
        holding the encoder's reserved sentinel characters)."""
        if not isinstance(messages, (list, tuple)):
            raise InvalidArgument(f"chat: messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                                  f"{type(messages).__name__} (for one user turn: [{{'role': 'user', 'content': text}}])")
        if not messages:
            raise EmptyPrompt("chat: messages is empty; expected a list of {'role': ..., 'content': ...}")
        if tools is not None:
            tool_names(tools)  # RequestError(param="tools") for anything but a list of named functions
        messages, tools = shield(list(messages), tools)
        try:
            text = self.template.render(messages, tools=tools, add_generation_prompt=True,
                                        enable_thinking=enable_thinking)
        except EngineError:
            raise
        except Exception as e:  # the template layer names the message at fault
            raise InvalidArgument(f"chat: cannot render the conversation: {e}") from e
        check_text(text, "chat")
        return encode_prompt(self.tokenizer, text)

    def encode(self, text: str, what: str = "prompt") -> list[int]:
        """Token ids of ``text`` (no special-token parsing beyond the tokenizer's own). Raises InvalidArgument when
        ``text`` is not a str or is not valid Unicode text (e.g. a lone surrogate from undecodable bytes, as
        Python's ``surrogateescape`` makes of invalid UTF-8 on the command line); ``what`` names it."""
        if not isinstance(text, str):
            raise InvalidArgument(f"{what}: expected a str, got {type(text).__name__}")
        check_text(text, what)
        return self.tokenizer.encode(text)

    # ------------------------------------------------------------------ one-shot calls (fresh state)
    def generate(self, prompt_ids: Sequence[int], **kw) -> Generation:
        """Generate from ``prompt_ids`` in a fresh session (see ``Session.generate`` for the arguments and errors,
        raised here, before any work). The Generation takes a session slot only while it runs: from its first
        delta to its last (or until it is closed or dropped), so any number of one-shot Generations may be made
        and consumed in turn (``[engine.generate(p) for p in prompts]``, then ``.text`` of each); more of them
        streamed at the same time than the engine has slots raise EngineError when the extra one starts."""
        return self._oneshot(prepare(self, prompt_ids, **kw))

    def chat(self, messages: list[dict], tools: list[dict] | None = None, enable_thinking: bool = True,
             **kw) -> Generation:
        """Render ``messages`` with the chat template and generate in a fresh session (``Session.generate`` args:
        max_new_tokens, temperature, top_k, top_p, min_p, seed, stop, stop_ids, logprobs, tool_choice,
        response_format, tool_grammar, speculate). ``tools`` are rendered into the system turn and parse the reply's tool
        calls; the reply starts in reasoning when ``enable_thinking``. Holds a slot only while it runs, as
        :meth:`generate`."""
        ids, marks = render_turn(self, messages, tools, enable_thinking)
        return self._oneshot(prepare(self, ids, checkpoint_at=marks, tools=tools, reasoning=enable_thinking, **kw))

    def _oneshot(self, job: tuple) -> Generation:
        """A Generation of the checked ``job`` (``host.session.prepare``) in a session opened when it starts and
        closed as it hands out its last delta (nothing runs on the slot after it), or when closed or dropped. A
        start refused because every slot is busy (EngineError) leaves it unstarted: iterating it again later
        retries."""
        return Generation(lambda g: _OneShotRun(self, job, g))


class _OneShotRun:
    """The iterator behind a one-shot Generation: its session is opened at the first ``next()`` (a refusal for
    want of a slot changes nothing, so a later ``next()`` retries) and closed with the last delta, on an error,
    on ``close()`` or when the Generation is dropped."""

    def __init__(self, engine: "Engine", job: tuple, g: Generation):
        self.engine, self.job, self.g = engine, job, g
        self.s: Session | None = None
        self.inner = None

    def __iter__(self) -> "_OneShotRun":
        return self

    def __next__(self):
        if self.inner is None:
            self.s = self.engine.new_session()  # EngineError when every slot is taken: still unstarted
            self.s.oneshot = True               # closed with the run: an interrupt keeps nothing of it
            self.inner = self.s._loop(self.g, *self.job)
        try:
            d = next(self.inner)
        except BaseException:  # StopIteration included: the run is over
            self._end()
            raise
        if d.finish_reason is not None:
            self._end()
        return d

    def _end(self) -> None:
        if self.s is not None:
            self.s.close()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
        self._end()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to free
            pass
