"""Typed errors and warnings of the engine's Python API. The CLI turns each error into a one-line message and a
non-zero exit (``exit_code``); API users catch :class:`EngineError` or a subclass. Warnings
(:class:`IgnoredArgumentWarning`) go through the ``warnings`` module and never stop a call."""
from __future__ import annotations

ERROR = "qwen-mk: error:"  # prefix of every CLI error line that is not a usage error (host.cli.Main says the rule)


class EngineError(Exception):
    """Base class: every error the engine raises on bad input or an unusable configuration."""

    exit_code = 1


class EmptyPrompt(EngineError):
    """The prompt has no tokens (an empty string, an empty id list, or a conversation with no messages)."""

    exit_code = 3


class PromptTooLong(EngineError):
    """The prompt leaves no room for a reply in the session (``Session.capacity``: the executor's capacity, at
    most the model's context): it has as many tokens or more, refused as vLLM refuses a prompt of max_model_len
    tokens or more (prompt + generated <= max_model_len, at least one token generated). A prompt that leaves
    less room than ``max_new_tokens`` is not an error: the generation ends early with finish_reason ``length``,
    finish_detail ``capacity``."""

    exit_code = 4


class InvalidTokenId(EngineError):
    """A prompt id outside ``[0, vocab_size)`` or in the padding range ``[FIRST_PADDING_ID, vocab_size)``."""

    exit_code = 5


class InvalidArgument(EngineError):
    """An argument of the Python API or the CLI that is of the wrong type, out of range or inconsistent with the
    engine, raised before any work: a sampling parameter (``SamplingParams``: temperature < 0 or not finite,
    top_k < 0, top_p outside (0, 1], min_p outside [0, 1], seed < 0, a bool for any of them); ``logprobs`` not
    an integer in [0, 20]; ``speculate`` not ``"off"``, ``"auto"`` or an integer in [0, 7]; ``max_new_tokens`` < 1
    or not below the
    session capacity / model context (``host.sampling.check_generation_args``); an empty stop string; an unknown
    executor name; a ``capacity`` below 2 (no room for a prompt token and a reply), above the model's context or
    too large for host / GPU memory; ``slots`` < 1; a ``path_or_preset`` that is not a str / Path; a ``chat``
    conversation that is not a list of messages or that the chat template cannot render; prompt ids that are not a
    sequence of ints; text (a prompt, a chat message, the CLI's ``--system`` or a chat input line) that is not
    valid UTF-8."""

    exit_code = 2


class RequestError(InvalidArgument):
    """A request parameter of the agent interface that cannot be served, raised before any work with the session
    intact: ``param`` names it (``tools``, ``tool_choice``, ``response_format``, ``--tools``, ...). Raised for a
    tool list that is not a list of functions (or, on the CLI, a file that is not valid JSON), a ``tool_choice``
    naming a function the tools do not have, a ``response_format`` of an unknown type, a JSON schema, regex or
    tool schema that xgrammar rejects, and control-token sentinels in message text (``host.prompt_text``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class ModelLoadError(EngineError):
    """A model directory or preset that cannot be opened or fails validation (wraps the loader's error)."""

    exit_code = 6


class ExecutorUnavailable(EngineError):
    """The requested executor cannot run here: no GPU/CuPy device, not built yet, or a model too large for it."""

    exit_code = 7


class EnvironmentIOError(EngineError):
    """A file or stream of the user's environment that cannot be written (an OSError: permission denied, a full
    device, a path that is a file): the first-use cache directory (``$QWEN_MK_CACHE``, default
    ``~/.cache/qwen-mk``) where a trained model or a preset's checkpoint is written, or the CLI's stdout (``>
    /dev/full``). A closed stdout (``| head -1``) is not an error: the CLI ends quietly with exit 0."""

    exit_code = 8


class GenerationInterrupted(EngineError):
    """A generation stopped by KeyboardInterrupt. A session from ``Engine.new_session()`` stays usable (its state
    is rolled back); a one-shot ``Engine.generate`` / ``chat`` keeps nothing of it (its session is closed): the
    deltas streamed before are all there is. ``tokens``: how many were generated before the interrupt (None where
    not known). The Generation has no result: ``result()`` / ``text`` raise it again."""

    exit_code = 130

    def __init__(self, message: str, tokens: int | None = None):
        super().__init__(message)
        self.tokens = tokens


class IgnoredArgumentWarning(UserWarning):
    """Warning, not an error (``warnings.warn``; the call goes on): generation arguments that were given but have
    no effect and are ignored. Issued by ``host.sampling.check_generation_args`` (``Session.generate``,
    ``Engine.generate`` / ``chat``) for top_k, top_p or seed under greedy decoding (temperature below 1e-5, 0
    included), which vLLM ignores too; the CLI prints it as a ``qwen-mk: warning:`` line. ``names``: the ignored
    arguments, in signature order. Silence with ``warnings.simplefilter("ignore", IgnoredArgumentWarning)``."""

    def __init__(self, message: str, names: tuple[str, ...] = ()):
        super().__init__(message)
        self.names = tuple(names)
