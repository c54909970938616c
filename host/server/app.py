"""The FastAPI application of ``qwen-mk serve``: OpenAI's chat and completion endpoints over one engine.

``create_app(engine, ...)`` builds it; ``host.commands.serve`` runs it under uvicorn. Requests are checked here,
in the event loop (body, model name, template, lengths, sampling values: every refusal is a 4xx in OpenAI's
shape, never a traceback), then queued for the engine thread (``host.server.worker``). Streaming answers are SSE
``data:`` lines of ``chat.completion.chunk`` / ``text_completion`` objects ending with ``data: [DONE]``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from host.errors import EngineError, PromptTooLong, RequestError
from host.grammar import TOOL_CHOICES
from host.limits import SAMPLING_EPS
from host.server.output import ChatOutput, chat_logprobs, completion_logprobs
from host.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, check_messages, path,
                                  range_error)
from loader.chat_template import ChatTemplateError
from host.server.worker import Job, QueueFull, Worker
from host.session import prepare, render_turn, session_capacity

log = logging.getLogger("qwen-mk.serve")
POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}  # pydantic's names of union members
_RANGE_ERRORS = {"finite_number", "greater_than", "greater_than_equal", "less_than", "less_than_equal"}

# the first word of an engine message ("temperature: ...") -> the request field it is about
_PARAM = {"max_new_tokens": "max_tokens", "chat": "messages", "prompt": "prompt", "logprobs": "top_logprobs",
          "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
          "seed": "seed", "stop": "stop"}


def generation_defaults(model_dir) -> dict:
    """The sampling defaults of the checkpoint's ``generation_config.json`` (temperature, top_k, top_p, min_p), as
    vLLM applies them to requests that leave them out; {} when there is none."""
    try:
        cfg = json.loads((Path(model_dir) / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, TypeError, ValueError):
        return {}
    return {k: cfg[k] for k in ("temperature", "top_k", "top_p", "min_p") if isinstance(cfg.get(k), (int, float))}


def engine_error(e: EngineError, prompt_field: str = "messages") -> APIError:
    """An engine error as an API error: bad input is a 400 naming the field, anything else a 500."""
    msg = str(e)
    if isinstance(e, RequestError):
        return APIError(400, msg, param=e.param)
    if isinstance(e, PromptTooLong):
        return APIError(400, msg, param=prompt_field, code="context_length_exceeded")
    if e.exit_code in (2, 3, 4, 5):  # InvalidArgument, EmptyPrompt, PromptTooLong, InvalidTokenId
        head = msg.split(":", 1)[0].split("[", 1)[0].strip()
        param = _PARAM.get(head, prompt_field if head in ("prompt", "chat") else None)
        return APIError(400, msg, param=param)
    return APIError(500, msg, type="internal_server_error")


def render_error(e: EngineError) -> APIError:
    """A conversation the template refuses as a 400 on ``messages``, its reason without the template's path."""
    cause = e.__cause__
    if isinstance(cause, ChatTemplateError):
        return APIError(400, f"messages: the chat template cannot render the conversation: {cause.reason}",
                        param="messages")
    return engine_error(e, "messages")


def check_tool_choice(choice) -> None:
    """400 for a string ``tool_choice`` other than none / auto / required (a function is named with an object)."""
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise APIError(400, f"tool_choice: invalid value {choice[:80]!r}; expected 'none', 'auto', 'required' or "
                            f"{{'type': 'function', 'function': {{'name': ...}}}}", param="tool_choice")


def _field_path(loc) -> str:
    """The request field of a pydantic error location: the body prefix and union member names dropped."""
    loc = list(loc[1:] if loc[:1] == ("body",) else loc)
    for i, x in enumerate(loc):
        if isinstance(x, str) and ("[" in x or "-" in x or x in _TYPE_TAGS):
            return path(loc[:i])  # pydantic names the member of a union it tried: not a field
    return path(loc)


def validation_message(model, errs: list[dict]) -> str:
    """One line for pydantic's errors (the first five, each once): ``field.path: what is wrong``."""
    lines: list[str] = []
    for er in errs[:5]:
        line = (range_error(model, er) if er.get("type") in _RANGE_ERRORS else None) or \
            f"{_field_path(er.get('loc', ())) or 'body'}: {er.get('msg')}"
        if line not in lines:
            lines.append(line)
    return "; ".join(lines)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Server:
    """What the routes share: the engine, its worker, the served name and the checkpoint's defaults."""

    def __init__(self, engine, served_model_name: str, api_key: str | None, max_queue: int,
                 park_memory: int | None = None):
        self.engine, self.name, self.api_key = engine, served_model_name, api_key
        self.worker = Worker(engine, max_queue, park_memory)
        self.defaults = generation_defaults(engine.model_dir)
        self.capacity = session_capacity(engine)
        self.draining = False
        self.created = int(time.time())

    # ------------------------------------------------------------------ request checks
    def check_model(self, model: str | None) -> None:
        """404 for a ``model`` other than the served name (None: any)."""
        if model is not None and model != self.name:
            raise APIError(404, f"The model `{model}` does not exist.", type="NotFoundError", param="model",
                           code="model_not_found")

    def check_unsupported(self, req) -> None:
        """400 for what a batch-1 engine without penalties cannot do: n > 1, presence / frequency / repetition
        penalties."""
        if req.n != 1:
            raise APIError(400, "n: only n=1 is supported (a batch-1 engine)", param="n")
        for f in ("presence_penalty", "frequency_penalty"):
            if getattr(req, f) not in (None, 0, 0.0):
                raise APIError(400, f"{f}: not supported (only 0)", param=f)
        if req.repetition_penalty not in (None, 1, 1.0):
            raise APIError(400, "repetition_penalty: not supported (only 1.0)", param="repetition_penalty")

    def gen_kwargs(self, req, n_prompt: int, max_tokens: int | None, logprobs: int | None) -> dict:
        """``Session.generate`` keyword arguments: the request's values, else the checkpoint's defaults."""
        if n_prompt >= self.capacity:
            raise APIError(400, f"This model's maximum context length is {self.capacity} tokens. However, your "
                                f"prompt has {n_prompt} tokens, which leaves no room for a completion.",
                           param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = self.capacity - n_prompt  # vLLM: the rest of max_model_len
        elif n_prompt + max_tokens > self.capacity:
            raise APIError(400, f"This model's maximum context length is {self.capacity} tokens. However, you "
                                f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} "
                                f"in the completion). Reduce the length of the prompt or completion.",
                           param="max_tokens", code="context_length_exceeded")
        d = self.defaults
        t = req.temperature if req.temperature is not None else d.get("temperature", 1.0)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop):
            raise APIError(400, "stop: expected non-empty strings", param="stop")
        kw = dict(max_new_tokens=max_tokens, temperature=t, stop=stop, logprobs=logprobs)
        if t >= SAMPLING_EPS:  # the rest acts only when sampling
            top_k = req.top_k if req.top_k is not None else d.get("top_k")
            kw.update(top_k=None if top_k in (None, -1, 0) else top_k,
                      top_p=req.top_p if req.top_p is not None else d.get("top_p"),
                      min_p=req.min_p if req.min_p is not None else d.get("min_p"), seed=req.seed)
        return kw

    async def submit(self, prompt: list[int], kw: dict, prompt_field: str) -> Job:
        """Check the arguments as the engine will (``host.session.prepare``, in a worker thread: it may compile a
        grammar), then queue the job."""
        if self.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable", code=503)
        try:
            await run_in_threadpool(lambda: prepare(self.engine, prompt, **kw))
        except EngineError as e:
            raise engine_error(e, prompt_field) from None
        job = Job(prompt, kw, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFull as e:
            raise APIError(429, f"{e} ({self.worker.max_queue} requests are waiting for the engine)",
                           type="rate_limit_error", code=429, headers={"Retry-After": str(e.retry_after)}) from None
        return job

    # ------------------------------------------------------------------ answers
    async def collect(self, job: Job, request: Request, on_delta) -> object:
        """Drain ``job`` (``on_delta(delta)`` for each); the GenerationResult. Cancels it when the client leaves."""
        try:
            checked = time.monotonic()
            while True:
                try:
                    kind, item = await asyncio.wait_for(job.events.get(), POLL_S)
                except asyncio.TimeoutError:
                    kind = item = None
                if time.monotonic() - checked >= POLL_S or kind is None:  # also while deltas keep coming:
                    checked = time.monotonic()                            # a fast decode never times out
                    if await request.is_disconnected():
                        job.cancel()
                        raise APIError(499, "client closed the request") from None
                if kind is None:
                    continue
                if kind == "delta":
                    on_delta(item)
                elif kind == "done":
                    return item
                elif kind == "error":
                    raise engine_error(item) if isinstance(item, EngineError) else APIError(
                        500, f"internal error: {type(item).__name__}", type="internal_server_error")
                else:
                    raise APIError(503, "the generation was cancelled (the server is shutting down)",
                                   type="service_unavailable", code=503)
        finally:
            job.cancel()  # a no-op once done; stops the engine work when this coroutine is cancelled

    def usage(self, n_prompt: int, r) -> dict:
        """OpenAI ``usage`` of a GenerationResult, with the reused prompt tokens as ``cached_tokens``."""
        return {"prompt_tokens": n_prompt, "completion_tokens": len(r.ids),
                "total_tokens": n_prompt + len(r.ids),
                "prompt_tokens_details": {"cached_tokens": r.timings.reused_tokens}}


def _lp_entries(d, stop_ids: set[int]) -> list:
    """Delta.logprobs without the stop token that ended the generation (its text is not in the output)."""
    if not d.logprobs:
        return []
    return [e for e in d.logprobs if not (d.finish_reason in ("stop", "tool_calls") and e[0] in stop_ids)]


def create_app(engine, served_model_name: str = "qwen3.5-tiny-trained", api_key: str | None = None,
               max_queue: int = 64, park_memory: int | None = None) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (docs/server.md). ``api_key``: required as ``Authorization:
    Bearer KEY`` on ``/v1/*`` when given; ``max_queue``: requests that may wait for the engine (then 429);
    ``park_memory``: host bytes evicted sessions may be parked in (None: 1/8 of physical memory; 0: never park;
    ``host.server.pool.SessionPool``)."""
    srv = Server(engine, served_model_name, api_key, max_queue, park_memory)

    @asynccontextmanager
    async def lifespan(app):
        srv.worker.start()
        yield
        srv.draining = True
        await run_in_threadpool(srv.worker.stop, 30.0)

    app = FastAPI(title="qwen-mk", lifespan=lifespan)
    app.state.server = srv

    @app.exception_handler(APIError)
    async def _api_error(_req, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(req: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        param = _field_path(first.get("loc", ())) or None
        if first.get("type") == "json_invalid":
            msg, param = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
        else:
            model = ChatCompletionRequest if req.url.path.endswith("/chat/completions") else CompletionRequest
            msg = validation_message(model, errs)
        return JSONResponse(APIError(400, msg, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req, e: StarletteHTTPException):
        typ = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type=typ).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _bug(_req, e: Exception):
        log.exception("unhandled error")
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}", type="internal_server_error")
                            .body(), status_code=500)

    async def auth(request: Request) -> None:
        if srv.api_key is None:
            return
        h = request.headers.get("authorization", "")
        if h != f"Bearer {srv.api_key}":
            raise APIError(401, "Incorrect API key provided" if h else "Missing API key (Authorization: Bearer ...)",
                           type="authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health():
        """200 while serving, 503 once draining."""
        if srv.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok", "running": srv.worker.running is not None, "waiting": srv.worker.waiting}

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models():
        """The one served model."""
        return {"object": "list", "data": [{"id": srv.name, "object": "model", "created": srv.created,
                                            "owned_by": "qwen-mk", "root": str(engine.model_dir),
                                            "max_model_len": srv.capacity}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        """OpenAI chat completions, streamed (SSE) or whole."""
        srv.check_model(req.model)
        srv.check_unsupported(req)
        kwargs = req.chat_template_kwargs or {}
        thinking = kwargs.get("enable_thinking", True)
        if not isinstance(thinking, bool):
            raise APIError(400, "chat_template_kwargs.enable_thinking: expected a boolean",
                           param="chat_template_kwargs.enable_thinking")
        check_tool_choice(req.tool_choice)
        check_messages(req.messages)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools is not None else None
        try:
            ids, marks = await run_in_threadpool(render_turn, engine, req.messages, tools, thinking)
        except EngineError as e:
            raise render_error(e) from None
        if req.top_logprobs is not None and not req.logprobs:  # OpenAI and vLLM refuse it too
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        n_lp = (req.top_logprobs or 0) if req.logprobs else None
        kw = srv.gen_kwargs(req, len(ids), req.max_completion_tokens or req.max_tokens, n_lp)
        kw.update(checkpoint_at=[*marks, len(ids)], tools=tools, tool_choice=req.tool_choice,
                  response_format=req.response_format, reasoning=thinking)
        job = await srv.submit(ids, kw, "messages")
        out = ChatOutput(thinking)
        stop_ids = set(engine.cfg.eos_token_ids)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        named = isinstance(req.tool_choice, dict)

        def finish_reason(r) -> str:
            """The engine's grammar_dead_end (the grammar admits nothing more) is a stop; so is the call a named
            tool_choice forced (vLLM answers ``stop`` there: the call was asked for, not chosen)."""
            if r.finish_reason == "grammar_dead_end" or (named and r.finish_reason == "tool_calls"):
                return "stop"
            return r.finish_reason

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_chat_stream(srv, job, out, rid, created, len(ids), stop_ids, n_lp,
                                                  finish_reason, include_usage), media_type="text/event-stream")
        lps: list = []
        r = await srv.collect(job, request, lambda d: (out.feed(d), lps.extend(_lp_entries(d, stop_ids))))
        out.finish()
        choice_obj = {"index": 0, "message": out.message(),
                      "logprobs": {"content": chat_logprobs(engine.tokenizer, lps)} if n_lp is not None else None,
                      "finish_reason": finish_reason(r)}
        return {"id": rid, "object": "chat.completion", "created": created, "model": srv.name,
                "choices": [choice_obj], "usage": srv.usage(len(ids), r)}

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(req: CompletionRequest, request: Request):
        """OpenAI (legacy) completions of raw text or token ids, no chat template."""
        srv.check_model(req.model)
        srv.check_unsupported(req)
        if req.suffix:
            raise APIError(400, "suffix: not supported", param="suffix")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs: not supported; the prompt tokens' logprobs are not available "
                                "(prefill computes the logits of the last prompt token only). Send echo or "
                                "logprobs, not both", param="echo")
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "prompt: one prompt per request (a batch-1 engine)", param="prompt")
            p = p[0]
        try:
            ids = await run_in_threadpool(engine.encode, p) if isinstance(p, str) else list(p)
        except EngineError as e:
            raise engine_error(e, "prompt") from None
        if not ids:
            raise APIError(400, "prompt: empty (nothing to condition on)", param="prompt")
        kw = srv.gen_kwargs(req, len(ids), req.max_tokens, req.logprobs)
        job = await srv.submit(ids, dict(kw, checkpoint_at=[len(ids)]), "prompt")
        echo = (p if isinstance(p, str) else engine.tokenizer.decode(ids)) if req.echo else ""
        stop_ids = set(engine.cfg.eos_token_ids)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_completion_stream(srv, job, rid, created, len(ids), stop_ids, req.logprobs,
                                                        echo, include_usage), media_type="text/event-stream")
        text, lps = [echo], []
        r = await srv.collect(job, request, lambda d: (text.append(d.text), lps.extend(_lp_entries(d, stop_ids))))
        lp = completion_logprobs(engine.tokenizer, lps, len(echo)) if req.logprobs is not None else None
        return {"id": rid, "object": "text_completion", "created": created, "model": srv.name,
                "choices": [{"index": 0, "text": "".join(text), "logprobs": lp, "finish_reason": r.finish_reason}],
                "usage": srv.usage(len(ids), r)}

    return app


async def _events(job: Job):
    """The job's (kind, item) pairs until it ends; cancels it if the consumer stops early (a disconnect)."""
    try:
        while True:
            kind, item = await job.events.get()
            yield kind, item
            if kind != "delta":
                return
    finally:
        job.cancel()


def _error_event(item) -> str:
    e = item if isinstance(item, APIError) else engine_error(item) if isinstance(item, EngineError) else APIError(
        500, f"internal error: {type(item).__name__}", type="internal_server_error")
    return _sse(e.body())


async def _chat_stream(srv: Server, job: Job, out: ChatOutput, rid: str, created: int, n_prompt: int,
                       stop_ids: set, n_lp, finish_reason, include_usage: bool):
    def chunk(delta: dict, finish=None, lps=None) -> str:
        c = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish}
        return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": srv.name,
                     "choices": [c]})

    yield chunk({"role": "assistant", "content": ""})
    tok = srv.engine.tokenizer
    async for kind, item in _events(job):
        if kind == "delta":
            delta, lps = out.feed(item), _lp_entries(item, stop_ids)
            if delta or lps:
                yield chunk(delta, lps={"content": chat_logprobs(tok, lps)} if n_lp is not None else None)
        elif kind == "done":
            tail = out.finish()
            if tail:
                yield chunk(tail)
            yield chunk({}, finish_reason(item))
            if include_usage:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": srv.name,
                            "choices": [], "usage": srv.usage(n_prompt, item)})
            yield "data: [DONE]\n\n"
        elif kind == "error":
            yield _error_event(item)
            yield "data: [DONE]\n\n"


async def _completion_stream(srv: Server, job: Job, rid: str, created: int, n_prompt: int, stop_ids: set, n_lp,
                             echo: str, include_usage: bool):
    def chunk(text: str, finish=None, lps=None) -> str:
        return _sse({"id": rid, "object": "text_completion", "created": created, "model": srv.name,
                     "choices": [{"index": 0, "text": text, "logprobs": lps, "finish_reason": finish}]})

    tok, offset = srv.engine.tokenizer, len(echo)
    if echo:
        yield chunk(echo)
    async for kind, item in _events(job):
        if kind == "delta":
            lps = _lp_entries(item, stop_ids)
            if item.text or lps:
                yield chunk(item.text, lps=completion_logprobs(tok, lps, offset) if n_lp is not None else None)
            offset += len(item.text)
        elif kind == "done":
            yield chunk("", item.finish_reason)
            if include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": srv.name,
                            "choices": [], "usage": srv.usage(n_prompt, item)})
            yield "data: [DONE]\n\n"
        elif kind == "error":
            yield _error_event(item)
            yield "data: [DONE]\n\n"
