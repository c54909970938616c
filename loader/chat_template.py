"""Chat template rendering the way transformers does it, and the append-only check of the agent loop.

Environment (transformers ``utils/chat_template_utils.py``, v5.x): jinja2 ``ImmutableSandboxedEnvironment`` with
``trim_blocks``, ``lstrip_blocks`` and the ``loopcontrols`` extension; ``tojson`` = ``json.dumps(x,
ensure_ascii=False)`` (default separators ``", "``/``": "``); globals ``raise_exception`` and ``strftime_now``.
Variables: ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, ``enable_thinking`` and the
tokenizer_config's special-token strings. Reasoning given as ``thinking``/``reasoning`` is aliased to
``reasoning_content`` (transformers does the same). Tool-call ``arguments`` given as a JSON string are decoded first.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_PATH = Path(__file__).parent / "templates" / "chat_template.jinja"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """A conversation the template cannot render: names the message (by index) or the template's own message.
    ``reason``: the message without the template file's path (what a server may show its clients)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = message if reason is None else reason


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def make_environment() -> ImmutableSandboxedEnvironment:
    """A jinja2 environment configured as transformers configures it for chat templates."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _decode_arguments(args, where: str) -> dict:
    if args is None or (isinstance(args, str) and not args.strip()):
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ChatTemplateError(
                f"{where}: arguments is not valid JSON ({e.msg} at char {e.pos}): {args[:80]!r}") from None
    if not isinstance(args, dict):
        raise ChatTemplateError(f"{where}: arguments must be a JSON object, got {type(args).__name__}")
    return args


def prepare_messages(messages: list) -> list[dict]:
    """Copies of ``messages`` ready to render: checked roles/content, reasoning aliased, string arguments decoded.

    Raises ChatTemplateError naming the message index and field."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("messages: expected a non-empty list of dicts")
    out = []
    for i, m in enumerate(messages):
        where = f"message {i}"
        if not isinstance(m, dict):
            raise ChatTemplateError(f"{where}: expected a dict, got {type(m).__name__}")
        m = dict(m)
        if m.get("role") not in _ROLES:
            raise ChatTemplateError(f"{where}: role must be one of {_ROLES}, got {m.get('role')!r}")
        c = m.get("content")
        if not (c is None or isinstance(c, (str, list))):
            raise ChatTemplateError(
                f"{where}: content must be a string, a list of text parts or None, got {type(c).__name__}")
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise ChatTemplateError(f"{where}: reasoning_content must be a string, got {type(reasoning).__name__}")
            m["reasoning_content"] = reasoning
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant" or not isinstance(m["tool_calls"], (list, tuple)):
                raise ChatTemplateError(f"{where}: tool_calls must be a list on an assistant message")
            calls = []
            for j, tc in enumerate(m["tool_calls"]):
                w = f"{where} tool_calls[{j}]"
                if not isinstance(tc, dict):
                    raise ChatTemplateError(f"{w}: expected a dict, got {type(tc).__name__}")
                fn = dict(tc.get("function", tc))
                if not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise ChatTemplateError(f"{w}: missing function name")
                fn["arguments"] = _decode_arguments(fn.get("arguments"), w)
                calls.append({**tc, "function": fn} if "function" in tc else fn)
            m["tool_calls"] = calls
        out.append(m)
    return out


class ChatTemplate:
    """A compiled chat template. ``render(messages, tools=None, add_generation_prompt=True, enable_thinking=True)``."""

    def __init__(self, source: str, special_tokens: dict | None = None, origin: str = "chat_template"):
        self.source, self.origin = source, origin
        self.special_tokens = dict(special_tokens or {})
        try:
            self._tmpl = make_environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{origin}: template syntax error at line {e.lineno}: {e.message}") from None

    @classmethod
    def default(cls) -> "ChatTemplate":
        """Our template (``loader/templates/chat_template.jinja``), the one synthetic checkpoints ship."""
        return cls(TEMPLATE_PATH.read_text(encoding="utf-8"), {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                   str(TEMPLATE_PATH))

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path) -> "ChatTemplate":
        """Template of a checkpoint: ``chat_template.jinja`` if present, else tokenizer_config.json's ``chat_template``."""
        d = Path(ckpt_dir)
        cfg_path = d / "tokenizer_config.json"
        if not cfg_path.is_file() and not (d / "chat_template.jinja").is_file():
            raise ChatTemplateError(f"{cfg_path}: file not found (it holds the chat template and the special tokens; "
                                    f"no chat_template.jinja in {d} either)")
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        specials = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if k in cfg}
        specials = {k: (v["content"] if isinstance(v, dict) else v) for k, v in specials.items()}
        if (d / "chat_template.jinja").is_file():
            return cls((d / "chat_template.jinja").read_text(encoding="utf-8"), specials, str(d / "chat_template.jinja"))
        tmpl = cfg.get("chat_template")
        if isinstance(tmpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
            tmpl = next((t["template"] for t in tmpl if t.get("name") == "default"), None)
        if not isinstance(tmpl, str):
            raise ChatTemplateError(f"{cfg_path}: no chat_template string (and no chat_template.jinja in {d})")
        return cls(tmpl, specials, str(cfg_path))

    def render(self, messages: list, tools: list | None = None, add_generation_prompt: bool = True,
               enable_thinking: bool = True, **kwargs) -> str:
        """The prompt text for ``messages`` (OpenAI-style dicts). Raises ChatTemplateError naming the message."""
        msgs = prepare_messages(messages)
        if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools)):
            raise ChatTemplateError("tools: expected a list of JSON-schema dicts")
        try:
            return self._tmpl.render(messages=msgs, tools=tools, documents=None,
                                     add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                                     **{**self.special_tokens, **kwargs})
        except jinja2.TemplateError as e:
            reason = e.message if hasattr(e, "message") else str(e)
            raise ChatTemplateError(f"{self.origin}: {reason}", reason) from None


def append_only(render_k: str, render_k1: str, tokenizer) -> tuple[bool, int | None]:
    """Whether the tokens of ``render_k1`` start with the tokens of ``render_k`` (article Part 2.3).

    Returns ``(True, None)`` or ``(False, i)`` with ``i`` the first token index where they differ (``len`` of the
    shorter sequence when one is a strict prefix of the other the wrong way round)."""
    a, b = tokenizer.encode(render_k), tokenizer.encode(render_k1)
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return False, i
    return (True, None) if len(a) <= len(b) else (False, n)
