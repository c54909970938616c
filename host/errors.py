"""Typed errors of the engine's Python API. The CLI turns each into a one-line message and a non-zero exit
(``EXIT_CODES``); API users catch :class:`EngineError` or a subclass."""
from __future__ import annotations


class EngineError(Exception):
    """Base class: every error the engine raises on bad input or an unusable configuration."""

    exit_code = 1


class EmptyPrompt(EngineError):
    """The prompt has no tokens (an empty string, an empty id list, or a conversation with no messages)."""

    exit_code = 3


class PromptTooLong(EngineError):
    """Prompt + requested new tokens exceed the session capacity or the model's context length."""

    exit_code = 4


class InvalidTokenId(EngineError):
    """A prompt id outside ``[0, vocab_size)`` or in the padding range ``[FIRST_PADDING_ID, vocab_size)``."""

    exit_code = 5


class InvalidArgument(EngineError):
    """A generation or sampling argument out of range (temperature < 0, top_p outside (0, 1], ...)."""

    exit_code = 2


class ModelLoadError(EngineError):
    """A model directory or preset that cannot be opened or fails validation (wraps the loader's error)."""

    exit_code = 6


class ExecutorUnavailable(EngineError):
    """The requested executor cannot run here: no GPU/CuPy device, not built yet, or a model too large for it."""

    exit_code = 7


class GenerationInterrupted(EngineError):
    """A generation stopped by KeyboardInterrupt; the session stays usable (its state is rolled back)."""

    exit_code = 130
