"""The engine: sessions, prefill, the decode loop, sampling, token hand-off, Python API and CLI."""
