"""``qwen-mk serve``: an OpenAI-compatible HTTP server over one batch-1 engine (docs/server.md).

    protocol.py   the request bodies (pydantic, strict types) and the OpenAI error shape
    pool.py       resident and parked sessions: prefix reuse from the longest usable history, least-recently-used
                  eviction, parking in host memory when moving a session back costs less than re-prefill
    worker.py     the one thread that runs the engine: a bounded queue of jobs, cancellation between steps
    output.py     the engine's parsed deltas (host.reply) -> OpenAI chat deltas and message; logprob shapes
    app.py        the FastAPI application: routes, authentication, error handlers, SSE streaming
"""
