"""Request bodies of the OpenAI API (the fields qwen-mk serves) and the OpenAI error shape.

The models are strict (a string where a number belongs is refused, ``"0.5"`` included, as OpenAI refuses it) and
ignore fields they do not name, as vLLM does, so clients that send ``user`` or ``service_tier`` still work.
Everything a model refuses becomes a 400 ``invalid_request_error`` naming the field (``app.py``).
"""
from __future__ import annotations

import math
from typing import Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = code if code is not None else status
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON body of the response."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage and empty ``choices``."""

    include_usage: bool = False


class FunctionDefinition(_Strict):
    """``tools[i].function``, as vLLM's ``FunctionDefinition``: a name, optionally a description and a JSON schema
    of the arguments (checked by xgrammar when the grammar is built)."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: Union[dict[str, Any], bool, None] = None
    strict: bool | None = None


class Tool(_Strict):
    """One entry of ``tools``; ``type`` defaults to ``"function"`` as in vLLM."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class _Sampling(_Strict):
    """Fields the chat and completion requests share."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)      # vLLM: -1 (or 0) = off
    min_p: float | None = Field(default=None, ge=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(default=None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    tools: list[Tool] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None       # checked by host.grammar.normalize_tool_choice
    response_format: dict[str, Any] | None = None               # checked by host.grammar.response_format_spec
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text or token ids (one prompt; a list of one is accepted)."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(default=16, ge=1)  # the legacy endpoint's default, as OpenAI and vLLM
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


def path(loc) -> str:
    """A field path as OpenAI writes it: ``tools[0].function.name`` for pydantic's ``("tools", 0, "function",
    "name")``."""
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else f".{x}" if out else str(x)
    return out


def _bound(meta, name: str):
    return next((getattr(m, name) for m in meta if getattr(m, name, None) is not None), None)


def allowed_range(field: FieldInfo) -> str | None:
    """The range of a bounded number field in words (``from 0 to 2``, ``greater than 0 and at most 1``,
    ``at least 1``); None when it has no bounds."""
    ge, gt, le = (_bound(field.metadata, k) for k in ("ge", "gt", "le"))
    if ge is not None:
        return f"from {ge:g} to {le:g}" if le is not None else f"at least {ge:g}"
    if gt is not None:
        return f"greater than {gt:g} and at most {le:g}" if le is not None else f"greater than {gt:g}"
    return None


def range_error(model: type[BaseModel], err: dict) -> str | None:
    """A clean message for a number outside its field's range (NaN and infinity included), naming the field and
    the range; None for any other error."""
    loc = err.get("loc", ())
    loc = loc[1:] if loc[:1] == ("body",) else loc
    field = model.model_fields.get(loc[0]) if len(loc) == 1 and isinstance(loc[0], str) else None
    rng = allowed_range(field) if field is not None else None
    x = err.get("input")
    if rng is None or isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    shown = "NaN" if math.isnan(x) else "Infinity" if x == math.inf else "-Infinity" if x == -math.inf else repr(x)
    kind = "an integer" if int in (field.annotation, *get_args(field.annotation)) else "a number"
    return f"{loc[0]}: expected {kind} {rng}, got {shown}"


_CONTENT_ROLES = ("system", "user", "tool")


def check_messages(messages: list[dict]) -> None:
    """400 naming ``messages[i].content`` for a message without content: a system, user or tool message needs it
    (a string or a list of text parts), an assistant message unless it has ``tool_calls`` (OpenAI's rule)."""
    for i, m in enumerate(messages):
        role = m.get("role")
        if m.get("content") is not None or role not in (*_CONTENT_ROLES, "assistant"):
            continue  # other roles and content types: the template's checks name them
        if role == "assistant" and m.get("tool_calls"):
            continue
        got = "null" if "content" in m else "nothing"
        need = "a string or a list of text parts" + (" (or tool_calls)" if role == "assistant" else "")
        raise APIError(400, f"messages[{i}].content: a {role} message needs content, {need}; got {got}",
                       param=f"messages[{i}].content")
