"""The control-token policy of chat prompts: text that a caller supplies is text, whatever it spells.

Message contents (every role: system, user, tool results, assistant history), reasoning, tool-call argument values
and every string of the tool definitions may hold the text of an added token (``<|im_end|>``, ``<|im_start|>``,
``<tool_call>``, ``</tool_response>``, ``<think>``…). Such text is tokenised as ordinary byte-level tokens
(``Tokenizer.encode_text``), never as the control id it spells, so a user message cannot end its turn, open a
fake assistant turn or close a tool response early. Only the chat template's own markup becomes control ids. One
exception keeps the template's documented inline-reasoning form working: in an assistant message's ``content``
the template itself splits on ``<think>`` / ``</think>`` (their text is consumed there, not rendered).

How: before rendering, each such string in caller text is replaced by one private-use sentinel character
(U+10FF00 + its index among the added tokens); the rendered prompt is encoded piecewise: the template's text with
``Tokenizer.encode`` (added tokens recognised), each sentinel as ``Tokenizer.encode_text`` of the string it stands
for. Caller text that already holds a character of the sentinel range is refused (RequestError, param
``messages`` or ``tools``). A prompt without control text encodes exactly as before (one ``encode`` call).

The output side needs no policy: the reply parser (``host.reply``) reads only generated ids, so a tag that came
from the prompt is never parsed as model output.
"""
from __future__ import annotations

import re

from host.errors import RequestError
from loader.tokenizer import ADDED_TOKENS

SENTINEL_BASE = 0x10FF00
CONTROL_TEXT = [t for t, _ in ADDED_TOKENS]  # index k ↔ sentinel chr(SENTINEL_BASE + k)
_SENTINELS = re.compile(f"[{chr(SENTINEL_BASE)}-{chr(SENTINEL_BASE + len(CONTROL_TEXT) - 1)}]")
_CONTROL = re.compile("|".join(re.escape(t) for t in sorted(CONTROL_TEXT, key=len, reverse=True)))
_THINK_TAGS = ("<think>", "</think>")


def _shield_str(s: str, where: str, param: str, keep=()) -> str:
    if _SENTINELS.search(s):
        raise RequestError(f"{where}: holds a character of U+{SENTINEL_BASE:X}..U+"
                           f"{SENTINEL_BASE + len(CONTROL_TEXT) - 1:X} (private use, reserved by the prompt "
                           "encoder)", param)
    return _CONTROL.sub(lambda m: m.group(0) if m.group(0) in keep else
                        chr(SENTINEL_BASE + CONTROL_TEXT.index(m.group(0))), s)


def _shield_any(v, where: str, param: str):
    if isinstance(v, str):
        return _shield_str(v, where, param)
    if isinstance(v, dict):
        return {k: _shield_any(x, f"{where}.{k}", param) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_shield_any(x, f"{where}[{i}]", param) for i, x in enumerate(v)]
    return v


def shield(messages, tools):
    """(messages, tools) with control text in caller strings replaced by sentinels (module docstring). Non-dict
    messages and non-list tools pass through unchanged for the template's own checks to report."""
    out = []
    for i, m in enumerate(messages if isinstance(messages, (list, tuple)) else ()):
        if not isinstance(m, dict):
            out.append(m)
            continue
        m = dict(m)
        keep = _THINK_TAGS if m.get("role") == "assistant" else ()
        c = m.get("content")
        if isinstance(c, str):
            m["content"] = _shield_str(c, f"messages[{i}].content", "messages", keep)
        elif isinstance(c, list):
            m["content"] = [dict(p, text=_shield_str(p["text"], f"messages[{i}].content[{j}].text", "messages", keep))
                            if isinstance(p, dict) and isinstance(p.get("text"), str) else p
                            for j, p in enumerate(c)]
        for k in ("reasoning_content", "thinking", "reasoning", "tool_calls"):
            if m.get(k) is not None:
                m[k] = _shield_any(m[k], f"messages[{i}].{k}", "messages")
        out.append(m)
    if not isinstance(messages, (list, tuple)):
        out = messages
    if isinstance(tools, (list, tuple)):
        tools = [_shield_any(t, f"tools[{i}]", "tools") for i, t in enumerate(tools)]
    return out, tools


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Ids of a rendered prompt holding sentinels: template text with ``encode``, each sentinel as
    ``encode_text`` of its control string. Without sentinels: ``tokenizer.encode(text)``."""
    if not _SENTINELS.search(text):
        return tokenizer.encode(text)
    ids, pos = [], 0
    for m in _SENTINELS.finditer(text):
        if m.start() > pos:
            ids += tokenizer.encode(text[pos:m.start()])
        ids += tokenizer.encode_text(CONTROL_TEXT[ord(m.group(0)) - SENTINEL_BASE])
        pos = m.end()
    if pos < len(text):
        ids += tokenizer.encode(text[pos:])
    return ids
