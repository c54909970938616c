"""Constrained decoding with xgrammar: JSON schema, JSON object, regex and this model's tool-call format.

Every constraint is an xgrammar *structural tag* (``xgrammar.StructuralTag``), compiled once per distinct tag and
kept in a :class:`GrammarCache` (one per engine, keyed by the tag's canonical JSON):

- ``response_format={"type": "json_object"}`` → JSON schema ``{"type": "object"}``;
  ``{"type": "json_schema", "json_schema": {"schema": S}}`` → S; ``{"type": "regex", "pattern": P}`` → P;
- tools with ``tool_choice`` ``auto`` / ``required`` / a named function → xgrammar's built-in ``qwen_3_5`` tag
  (``get_model_structural_tag``: ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>…``, each
  call's parameters by its JSON schema in the ``qwen_xml`` style, markers matched as token ids).

JSON whitespace runs are capped at MAX_WHITESPACE (16) characters: a greedy small model otherwise pads a value
with spaces until max_new_tokens.

With thinking on (the prompt ends in ``<think>\\n``) the reply may reason first: the tag starts with any tokens up to
id 248069 ``</think>`` then ``\\n\\n`` (the reasoning prefix), then the format.

Vocabulary given to xgrammar (``TokenizerInfo``, RAW bytes, 248,320 rows): ordinary ids their bytes; the four
marker ids 248058/248059/248068/248069 the byte 0xFF then their text, so no JSON string or regex over UTF-8 text
can spell them (their text is spelled with ordinary tokens instead) while the tag still names them by id; every
other added id (``<|im_start|>``, ``<tool_response>``…) and the padding rows empty, which xgrammar treats as
special tokens it never admits. Stop ids: the config's eos ids (248046, 248044), admitted only where the grammar
may end.

Per generation a :class:`Constraint` holds the matcher: ``allowed()`` fills the token bitmask ([ceil(V/32)] int32)
and returns it unpacked as a bool [V]; the host sets every other logit to -inf before argmax or sampling
(``host.sampling.Sampler.choose``), greedy included. On a GPU executor the mask is applied to the host copy of the
logits row (``StepOutput.logits``, fetched from the device each constrained step); the head kernel does not read the
mask yet.
"""
from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from host.errors import RequestError
from loader.config import FIRST_PADDING_ID, THINK_END_ID, THINK_ID, TOOL_CALL_END_ID, TOOL_CALL_ID
from loader.tokenizer import FIRST_ADDED_ID

MARKER_IDS = (TOOL_CALL_ID, TOOL_CALL_END_ID, THINK_ID, THINK_END_ID)
MODEL_FORMAT = "qwen_3_5"   # xgrammar's built-in structural tag of this model's tool-call syntax
TOOL_CHOICES = ("auto", "required", "none")
MAX_WHITESPACE = 16  # longest run of JSON whitespace admitted (xgrammar max_whitespace_cnt): greedy pads otherwise


def _xgr():
    """The xgrammar module (imported on the first constrained request: it imports torch). Raises RequestError
    (param ``response_format``) when the ``agent`` extra is not installed."""
    try:
        import xgrammar
    except ImportError as e:
        raise RequestError(f"response_format / tool_choice: grammar-constrained decoding needs xgrammar, the "
                           f"'agent' extra (pip install -e '.[agent]'): {e}", "response_format") from None
    return xgrammar


@dataclass(frozen=True)
class GrammarSpec:
    """What constrains a reply: ``kind`` (``json_schema`` | ``json_object`` | ``regex`` | ``structural_tag`` |
    ``tool_call``), the
    structural tag as a dict (``tag``) and its canonical JSON (``key``, the cache key). ``param``: the request
    parameter it came from (named in errors)."""

    kind: str
    tag: dict
    param: str
    key: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", json.dumps(self.tag, sort_keys=True, ensure_ascii=False))


def _reasoning_prefix() -> dict:
    """Reasoning text (no think markers) up to id 248069, then the blank line the template's replies put after it."""
    return {"type": "sequence", "elements": [
        {"type": "tag", "begin": "", "content": {"type": "any_tokens", "exclude_tokens": [THINK_ID, THINK_END_ID]},
         "end": {"type": "token", "token": THINK_END_ID}},
        {"type": "const_string", "value": "\n\n"}]}


def response_format_spec(response_format, reasoning: bool) -> GrammarSpec | None:
    """The GrammarSpec of an OpenAI-style ``response_format`` (None or ``{"type": "text"}``: no constraint).

    Accepted: ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"schema": {...}}}`` (a bare
    ``{"schema": ...}``-less dict under ``json_schema`` is taken as the schema itself), ``{"type": "regex",
    "pattern": "..."}``, ``{"type": "structural_tag", "format": F}`` (F: xgrammar's structural-tag format JSON;
    ``token`` elements by id, or by marker text ``<tool_call>``, ``</tool_call>``, ``<think>``, ``</think>``).
    Raises RequestError(param="response_format") for anything else."""
    if response_format is None:
        return None
    p = "response_format"
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise RequestError(f"{p}: expected a dict with a 'type' (json_object, json_schema, regex or text), got "
                           f"{response_format!r:.80}", p)
    t = response_format["type"]
    if t == "text":
        return None
    if t == "json_object":
        fmt, kind = {"type": "json_schema", "json_schema": {"type": "object"},
                     "max_whitespace_cnt": MAX_WHITESPACE}, "json_object"
    elif t == "json_schema":
        js = response_format.get("json_schema")
        schema = js.get("schema", js) if isinstance(js, dict) else js
        if not isinstance(schema, (dict, bool)):
            raise RequestError(f"{p}.json_schema.schema: expected a JSON schema object, got {schema!r:.80}", p)
        fmt, kind = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}, "json_schema"
    elif t == "regex":
        pat = response_format.get("pattern")
        if not isinstance(pat, str) or not pat:
            raise RequestError(f"{p}.pattern: expected a non-empty regular expression string, got {pat!r:.80}", p)
        fmt, kind = {"type": "regex", "pattern": pat}, "regex"
    elif t == "structural_tag":
        fmt = response_format.get("format")
        if not isinstance(fmt, dict):
            raise RequestError(f"{p}.format: expected an xgrammar structural-tag format object, got {fmt!r:.80}", p)
        fmt, kind = _marker_ids(fmt), "structural_tag"
    else:
        raise RequestError(f"{p}.type: expected json_object, json_schema, regex, structural_tag or text, got {t!r}",
                           p)
    body = {"type": "sequence", "elements": [_reasoning_prefix(), fmt]} if reasoning else fmt
    return GrammarSpec(kind, {"type": "structural_tag", "format": body}, p)


def tool_names(tools) -> list[str]:
    """Function names of an OpenAI-style tool list (RequestError(param="tools") when it is not one)."""
    if not isinstance(tools, (list, tuple)):
        raise RequestError(f"tools: expected a list of tools, got {type(tools).__name__}", "tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ..., "
                               f"'parameters': {{...}}}}}}, got {t!r:.80}", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, (dict, bool)):
            raise RequestError(f"tools[{i}].function.parameters: expected a JSON schema object, got "
                               f"{type(params).__name__}", "tools")
        names.append(fn["name"])
    return names


def normalize_tool_choice(tool_choice, tools) -> str | dict:
    """``tool_choice`` as ``"auto"`` | ``"required"`` | ``"none"`` | ``{"type": "function", "function": {"name":
    N}}``. Accepts those, None (= auto with tools, none without) and a bare function name. Raises
    RequestError(param="tool_choice") for an unknown value or a name that is not among ``tools``, or a choice
    other than none/auto without tools."""
    names = tool_names(tools) if tools is not None else []
    if tool_choice is None:
        return "auto" if names else "none"
    p = "tool_choice"
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise RequestError(f"{p}: expected auto, required, none, a function name or {{'type': 'function', "
                               f"'function': {{'name': ...}}}}, got {tool_choice!r:.80}", p)
    elif isinstance(tool_choice, str) and tool_choice in TOOL_CHOICES:
        if tool_choice == "required" and not names:
            raise RequestError(f"{p}: 'required' needs at least one tool (tools is empty or missing)", p)
        return tool_choice
    elif isinstance(tool_choice, str) and tool_choice:
        name = tool_choice
    else:
        raise RequestError(f"{p}: expected auto, required, none or a function name, got {tool_choice!r:.80}", p)
    if name not in names:
        raise RequestError(f"{p}: function {name!r} is not among the tools ({', '.join(names) or 'none given'})", p)
    return {"type": "function", "function": {"name": name}}


def tool_call_spec(tools, tool_choice, reasoning: bool) -> GrammarSpec | None:
    """The GrammarSpec of this model's tool-call format for ``tools`` under ``tool_choice`` (normalized by
    :func:`normalize_tool_choice`); None for ``none``. Raises RequestError(param="tools") when xgrammar refuses
    the tool list."""
    if tool_choice == "none":
        return None
    try:
        st = _xgr().get_model_structural_tag(MODEL_FORMAT, tools=list(tools), tool_choice=tool_choice,
                                             reasoning="enabled" if reasoning else "disabled", token_markers=True,
                                             max_whitespace_cnt=MAX_WHITESPACE)
    except (ValueError, TypeError) as e:
        raise RequestError(f"tools: xgrammar cannot build the tool-call grammar: {e}", "tools") from None
    tag = json.loads(st.model_dump_json())
    return GrammarSpec("tool_call", _marker_ids(tag), "tools")


_MARKER_TEXT = {"<tool_call>": TOOL_CALL_ID, "</tool_call>": TOOL_CALL_END_ID, "<think>": THINK_ID,
                "</think>": THINK_END_ID}


def _marker_ids(o):
    """The tag with marker token strings replaced by their ids (our vocabulary spells the markers apart)."""
    if isinstance(o, dict):
        out = {}
        for k, v in o.items():
            if k == "token" and isinstance(v, str):
                out[k] = _MARKER_TEXT.get(v, v)
            elif k in ("exclude_tokens", "trigger_tokens"):
                out[k] = [_MARKER_TEXT.get(x, x) if isinstance(x, str) else x for x in v]
            else:
                out[k] = _marker_ids(v)
        return out
    if isinstance(o, list):
        return [_marker_ids(x) for x in o]
    return o


def xgrammar_vocab(tokenizer) -> list[bytes]:
    """The RAW vocabulary given to xgrammar, [vocab_size] bytes (module docstring: markers prefixed 0xFF, other
    added ids and padding empty)."""
    vb = list(tokenizer.vocab_bytes())
    for i in range(FIRST_ADDED_ID, FIRST_PADDING_ID):
        vb[i] = b"\xff" + vb[i] if i in MARKER_IDS else b""
    return vb


class GrammarCache:
    """xgrammar's tokenizer info and compiler for one tokenizer, and every grammar compiled for it (built lazily,
    on the first constrained request). ``compile(spec)`` returns the compiled grammar, compiling a tag the first
    time its key is seen (``compiles`` counts those). Thread-safe."""

    def __init__(self, tokenizer, eos_ids, vocab_size: int):
        self.tokenizer, self.eos_ids, self.vocab_size = tokenizer, [int(i) for i in eos_ids], int(vocab_size)
        self._compiler = None
        self._info = None
        self._compiled: dict[str, tuple[object, float]] = {}
        self._lock = threading.Lock()
        self.compiles = 0

    def _ensure(self):
        if self._compiler is None:
            xg = _xgr()
            self._info = xg.TokenizerInfo(xgrammar_vocab(self.tokenizer), xg.VocabType.RAW,
                                          vocab_size=self.vocab_size, stop_token_ids=self.eos_ids)
            self._compiler = xg.GrammarCompiler(self._info, max_threads=2)
        return self._compiler

    def compile(self, spec: GrammarSpec):
        """(compiled grammar, compile ms, cached) for ``spec``. Raises RequestError(param=spec.param) when
        xgrammar rejects the schema, the regex or the tag."""
        with self._lock:
            hit = self._compiled.get(spec.key)
            if hit is not None:
                return hit[0], hit[1], True
            comp = self._ensure()
            t0 = time.perf_counter()
            try:
                cg = comp.compile_structural_tag(spec.key)
            except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own types
                what = {"json_schema": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
                        "structural_tag": "structural tag", "tool_call": "tool list (a parameters schema)"}[spec.kind]
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                msg = re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", msg)  # xgrammar's "[time] file.cc:line: " prefix
                raise RequestError(f"{spec.param}: xgrammar rejects the {what}: {msg[:300]}", spec.param) from None
            ms = (time.perf_counter() - t0) * 1e3
            self._compiled[spec.key] = (cg, ms)
            self.compiles += 1
            return cg, ms, False


class Constraint:
    """One reply's grammar state. ``allowed() -> np.ndarray`` bool [V] (ids the grammar admits next; padding
    never), ``accept(tok)`` advances (False when the grammar refuses it), ``terminated`` after a stop id ended the
    grammar. ``mask_ms``: time spent in ``allowed`` (bitmask fill + unpack); ``report()`` the result's
    ``grammar`` dict."""

    def __init__(self, spec: GrammarSpec, compiled, compile_ms: float, cached: bool, vocab_size: int):
        xg = _xgr()
        self.spec, self.vocab_size = spec, int(vocab_size)
        self._m = xg.GrammarMatcher(compiled)
        self._bm = xg.allocate_token_bitmask(1, self.vocab_size)  # [1, ceil(V/32)] int32 (torch, CPU)
        self._bm_np = self._bm.numpy().view(np.uint8)              # the same memory, as bytes
        self.compile_ms, self.cached = compile_ms, cached
        self.mask_ms, self.masks, self.forced = 0.0, 0, 0

    def allowed(self) -> np.ndarray:
        """Bool [V]: True where the grammar admits the id next (the padding rows never)."""
        t0 = time.perf_counter()
        self._m.fill_next_token_bitmask(self._bm)
        ok = np.unpackbits(self._bm_np[0], count=self.vocab_size, bitorder="little").view(bool)
        ok[FIRST_PADDING_ID:] = False
        self.mask_ms += (time.perf_counter() - t0) * 1e3
        self.masks += 1
        return ok

    def accept(self, tok: int) -> bool:
        return bool(self._m.accept_token(int(tok)))

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def report(self) -> dict:
        return {"kind": self.spec.kind, "param": self.spec.param, "compile_ms": round(self.compile_ms, 3),
                "cached": self.cached, "masks": self.masks, "mask_ms": round(self.mask_ms, 3),
                "mask_ms_per_token": round(self.mask_ms / self.masks, 4) if self.masks else None}
