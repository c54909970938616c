"""``qwen-mk serve``: the OpenAI-compatible HTTP server (``host.server``; docs/server.md).

Binds the address first (a port in use fails before the model loads), loads the engine once, then serves with
uvicorn and prints ``qwen-mk serve: ready at http://HOST:PORT/v1`` on stderr. SIGINT / SIGTERM start the drain:
the socket stays open, ``/health`` answers 503 and new requests 503, the requests already queued or running finish
(``--drain-timeout`` seconds at most; past it they are cancelled at their next step); then the socket closes,
the answers in flight finish sending, the engine thread ends and the command exits 0. A second signal stops at
once.
"""
from __future__ import annotations

import math
import socket
import time

import click

from host.commands.generate import check_model_args, handle_errors, model_options
from loader.trained import DEFAULT_MODEL


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one); ClickException (exit 1) when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve_app(app, sock: socket.socket, *, drain_timeout: float | None = 60.0, log_level: str = "warning",
              on_ready=None) -> None:
    """Run ``app`` on the bound ``sock`` under uvicorn until SIGINT / SIGTERM (in the main thread) or until the
    returned server's ``should_exit`` is set (in another thread). ``on_ready(host, port)`` runs once listening."""
    import uvicorn  # deferred: the server's extra

    srv = app.state.server
    budget = math.inf if drain_timeout is None else drain_timeout

    class _Server(uvicorn.Server):
        drain_end: float | None = None  # monotonic deadline once the first signal came

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if on_ready is not None and not self.should_exit:
                h, p = sock.getsockname()[:2]
                on_ready(h, p)

        def handle_exit(self, sig, frame):
            if self.drain_end is None:  # the first signal: refuse new requests, keep listening (/health says 503)
                srv.draining = True
                self.drain_end = time.monotonic() + budget
                self._captured_signals.append(sig)
                return
            super().handle_exit(sig, frame)  # a second one: stop now
            self.force_exit = True

        async def on_tick(self, counter: int) -> bool:
            if self.drain_end is not None and not self.should_exit:
                left = self.drain_end - time.monotonic()
                if (srv.worker.running is None and not srv.worker.waiting) or left <= 0:
                    # the engine is idle (or the time is up): close the socket, let the answers finish sending
                    self.config.timeout_graceful_shutdown = None if left == math.inf else max(left, 0.1)
                    self.should_exit = True
            return await super().on_tick(counter)

        async def shutdown(self, sockets=None):
            await super().shutdown(sockets)
            self._captured_signals.clear()  # drained: exit 0 rather than re-raise the signal (uvicorn's default)

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_timeout, access_log=False)
    server = _Server(config)
    app.state.uvicorn = server
    server.run(sockets=[sock])


@click.command()
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on (0: a free one, printed when ready).")
@click.option("--max-model-len", type=click.IntRange(min=2), default=None,
              help="Tokens per session, prompt and completion together (the engine's --capacity; default 4096, "
                   "or the model's context when smaller).")
@click.option("--served-model-name", default=None,
              help="The model name clients send and /v1/models lists (default: the --model or --preset value).")
@click.option("--api-key", default=None, envvar="QWEN_MK_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/* (also from $QWEN_MK_API_KEY).")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for the engine; one more is answered 429 with Retry-After.")
@click.option("--sessions", type=click.IntRange(min=1), default=4, show_default=True,
              help="Sessions kept resident between requests (engine slots), evicted least recently used.")
@click.option("--park-memory", type=click.FloatRange(min=0), default=None, metavar="GIB",
              help="GiB of host memory evicted sessions may be parked in, when moving them back costs less than "
                   "re-running their tokens (default 1/8 of physical memory; 0: never park).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Seconds SIGINT / SIGTERM wait for requests in flight before cancelling them.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="warning", show_default=True, help="uvicorn's log level (info: one line per request).")
@handle_errors
def command(host, port, max_model_len, served_model_name, api_key, max_queue, sessions, park_memory, drain_timeout,
            log_level, **kw):
    """Serve the model over the OpenAI HTTP API (chat and completions, SSE streaming)."""
    check_model_args(kw)
    if kw["capacity"] is not None and max_model_len is not None and kw["capacity"] != max_model_len:
        raise click.UsageError("give --max-model-len or --capacity, not both")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise click.ClickException(f"the server needs FastAPI and uvicorn ({e}); run scripts/install.sh, or "
                                   "pip install -e '.[serve]'") from None
    from host.engine import Engine  # deferred: the engine side
    from host.server.app import create_app  # lazy: FastAPI

    sock = bind(host, port)
    name = served_model_name or kw["model_dir"] or kw["preset"] or DEFAULT_MODEL
    eng = Engine.load(kw["model_dir"] or kw["preset"], kw["executor"], capacity=max_model_len or kw["capacity"],
                      slots=sessions)
    app = create_app(eng, served_model_name=name, api_key=api_key, max_queue=max_queue,
                     park_memory=None if park_memory is None else int(park_memory * 2**30))

    def ready(h, p):
        shown = f"[{h}]" if ":" in h else h
        click.echo(f"qwen-mk serve: {name} ({eng.executor.name} executor, max model len "
                   f"{app.state.server.capacity}) ready at http://{shown}:{p}/v1", err=True)

    serve_app(app, sock, drain_timeout=drain_timeout, log_level=log_level, on_ready=ready)
    click.echo("qwen-mk serve: stopped", err=True)
