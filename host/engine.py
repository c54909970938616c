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

from host.errors import (EmptyPrompt, EngineError, EnvironmentIOError, ExecutorUnavailable, InvalidArgument,
                         ModelLoadError)
from host.executors import CPU_KINDS, Executor, check_kind, cpu_too_large, default_kind, gpu_available, make_executor
from host.sampling import check_text
from host.session import Generation, Session, prepare, render_turn
from loader.config import PRESETS, ConfigError, ModelConfig
from loader.trained import DEFAULT_MODEL, TRAINED

DEFAULT_CAPACITY = 4096  # tokens per session slot unless the caller asks otherwise
DEFAULT_SLOTS = 4
# Start of the chat template ``loader.synthetic.write_checkpoint`` (``qwen-mk make-checkpoint``) puts in
# tokenizer_config.json (``loader/templates/chat_template.jinja``); a real checkpoint ships its own template.
SYNTHETIC_TEMPLATE_MARK = "qwen-mk's chat template for synthetic"


def synthetic_marker(d: Path) -> str | None:
    """How checkpoint directory ``d`` shows it holds synthetic weights written by ``loader.synthetic``, or None:
    the ``.qwen-mk-stamp`` file of a cached checkpoint (``ensure_checkpoint``), else qwen-mk's chat template in
    tokenizer_config.json (``write_checkpoint`` stores no other marker). Never raises: a file it cannot read is
    reported by the loader later."""
    import json

    from loader.synthetic import STAMP

    if (d / STAMP).is_file():
        return f"{STAMP} of a cached synthetic checkpoint"
    try:
        tmpl = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(tmpl, str) and SYNTHETIC_TEMPLATE_MARK in tmpl[:200]:
        return "qwen-mk's synthetic chat template in tokenizer_config.json"
    return None


def _resolve_model(path_or_preset: str | Path | None, seed: int, quiet: bool, kind: str,
                   defaulted: bool) -> tuple[Path, str | None]:
    """(directory, preset) for a path, a trained model's name or a preset name. A trained model is expanded into
    the cache once (``loader.trained.ensure_checkpoint``) and returned as (directory, None). A preset's weights are
    synthetic: on the CPU the tiny
    checkpoint is written once into the cache and read back; on a GPU no weight file is written at all (the
    directory holds config and tokenizer files; the executor materialises the weights in GPU memory).
    A preset too large for the cpu executor (``cpu_too_large``) raises ExecutorUnavailable before anything is
    written: the preset is valid, the executor cannot run it (``defaulted``: the cpu executor was chosen because
    there is no GPU, and the message says so)."""
    if path_or_preset is None:
        path_or_preset = DEFAULT_MODEL
    p = Path(path_or_preset)
    if str(path_or_preset) in TRAINED and not p.is_dir():  # a trained model: expanded into the cache once
        from loader.trained import ensure_checkpoint as ensure_trained
        name = str(path_or_preset)

        def log(msg: str) -> None:
            if not quiet:
                print(f"qwen-mk: {name}: {msg}", file=sys.stderr)
        return Path(ensure_trained(name, log=log, progress=not quiet)), None
    if str(path_or_preset) in PRESETS and not p.is_dir():
        name = str(path_or_preset)
        if kind not in CPU_KINDS:
            d = _synthetic_meta_dir(name, seed)
        elif (why := cpu_too_large(PRESETS[name])) is not None:
            if defaulted:
                raise ExecutorUnavailable(
                    f"preset {name!r} needs a GPU executor (graph or megakernel) and no GPU is usable here: "
                    f"{gpu_available()[1]}. On the CPU it {why}; use --preset tiny there.")
            raise ExecutorUnavailable(f"cpu executor: preset {name!r} {why}. Use --executor graph or megakernel on "
                                      "a GPU, or --preset tiny on the CPU.")
        else:
            from loader.synthetic import ensure_checkpoint

            d = Path(ensure_checkpoint(name, seed=seed, progress=not quiet))
        if not quiet:
            print(f"qwen-mk: preset {name!r} uses SYNTHETIC random weights (seed {seed}, {d}): the text is "
                  "meaningless by design", file=sys.stderr)
        return d, name
    if not p.is_dir():
        raise ModelLoadError(f"model {str(path_or_preset)!r}: not a directory and not a preset "
                             f"(presets: {', '.join(sorted(PRESETS))})")
    mark = synthetic_marker(p)
    if mark and not quiet:  # as for a preset: a checkpoint from `qwen-mk make-checkpoint` is random too
        print(f"qwen-mk: model {p} holds SYNTHETIC random weights ({mark}): the text is meaningless by design",
              file=sys.stderr)
    return p, None


def cache_root() -> Path:
    """The first-use cache directory: ``$QWEN_MK_CACHE``, else ``~/.cache/qwen-mk`` (the loader's writers' rule)."""
    import os

    return Path(os.environ.get("QWEN_MK_CACHE") or Path.home() / ".cache" / "qwen-mk")


def cache_error(e: OSError) -> EnvironmentIOError:
    """The one-line error for an OSError met while writing the cache: it names the directory, the reason and
    the variable that moves it."""
    root = cache_root()
    why = e.strerror or str(e) or type(e).__name__
    if root.exists() and not root.is_dir():
        why = "it is a file, not a directory"
    elif e.filename and str(e.filename) != str(root):
        why += f" ({e.filename})"
    return EnvironmentIOError(f"cannot write the cache directory {root}: {why}; set QWEN_MK_CACHE to a writable "
                              "directory with room for the checkpoint")


def _synthetic_meta_dir(name: str, seed: int) -> Path:
    """Cache directory with the config, generation config and tokenizer files of a synthetic preset, and no
    weights (written once; ~15 MB)."""
    import json
    import os

    from loader.config import preset
    from loader.synthetic import GENERATION_CONFIG, config_json
    from loader.tokenizer import write_tokenizer_files

    d = cache_root() / f"meta-{name}-seed{seed}"
    if not (d / "tokenizer_config.json").is_file():
        import shutil

        tmp = d.with_name(d.name + f".tmp{os.getpid()}")
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / "config.json").write_text(json.dumps(config_json(preset(name)), indent=2) + "\n")
            (tmp / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
            write_tokenizer_files(tmp)
            if d.exists():
                shutil.rmtree(d)
            tmp.rename(d)
        finally:  # a failed write (a full disk) leaves no partial directory
            shutil.rmtree(tmp, ignore_errors=True)
    return d


class Engine:
    """A loaded model: config, weights, tokenizer, chat template and one executor with session slots.

    Build with :meth:`load`. Attributes: ``cfg`` (ModelConfig), ``model_dir``, ``tokenizer``, ``template``,
    ``executor``.
    """

    def __init__(self, cfg: ModelConfig, model_dir: Path, weights, tokenizer, template, executor: Executor):
        self.cfg, self.model_dir, self.weights = cfg, model_dir, weights
        self.tokenizer, self.template, self.executor = tokenizer, template, executor
        self._free = list(range(executor.slots))

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
        read-only, full, or a file; nothing partial is left in it). ``quiet`` drops the stderr warning printed for synthetic weights (a preset, or a directory
        written by ``qwen-mk make-checkpoint``).
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
        from loader.chat_template import ChatTemplate
        from loader.checkpoint import Checkpoint, CheckpointError
        from loader.tokenizer import Tokenizer, TokenizerError

        try:
            if synthetic is not None and kind not in CPU_KINDS:
                from loader.config import preset
                from loader.synthetic import SyntheticWeights

                weights = SyntheticWeights(preset(synthetic), seed)  # drawn on the GPU by the executor
            else:
                weights = Checkpoint.open(model_dir)
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
            ex = make_executor(kind, weights, capacity, slots)
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
        if not self._free:
            raise EngineError(f"all {self.executor.slots} session slots are in use (open sessions and one-shot "
                              "generations still streaming); close() a session or finish a generation first")
        return Session(self, self._free.pop(0))

    def _release_slot(self, slot: int) -> None:
        if slot not in self._free:
            self._free.append(slot)

    def new_detok(self):
        from loader.detok import StreamDetokenizer

        return StreamDetokenizer(self.tokenizer)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    enable_thinking: bool = True) -> list[int]:
        """Prompt ids of a conversation through the checkpoint's chat template (generation prompt added).
        Raises EmptyPrompt for no messages, InvalidArgument for a malformed conversation."""
        if not isinstance(messages, (list, tuple)):
            raise InvalidArgument(f"chat: messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                                  f"{type(messages).__name__} (for one user turn: [{{'role': 'user', 'content': text}}])")
        if not messages:
            raise EmptyPrompt("chat: messages is empty; expected a list of {'role': ..., 'content': ...}")
        try:
            text = self.template.render(list(messages), tools=tools, add_generation_prompt=True,
                                        enable_thinking=enable_thinking)
        except EngineError:
            raise
        except Exception as e:  # the template layer names the message at fault
            raise InvalidArgument(f"chat: cannot render the conversation: {e}") from e
        return self.encode(text, "chat")

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
        max_new_tokens, temperature, top_k, top_p, seed, stop, stop_ids). Holds a slot only while it runs, as
        :meth:`generate`."""
        ids, marks = render_turn(self, messages, tools, enable_thinking)
        return self._oneshot(prepare(self, ids, checkpoint_at=marks, **kw))

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
