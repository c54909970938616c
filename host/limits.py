"""Generation limits the CLI and the API share, in a module without NumPy (the CLI reads them before anything
heavy loads; ``host.sampling`` applies them)."""

DEFAULT_CAPACITY = 4096  # tokens per session slot unless the caller asks otherwise (Engine.load)
DEFAULT_MAX_NEW_TOKENS = 256  # max_new_tokens when not given (API and CLI), lowered to a smaller capacity - 1
SAMPLING_EPS = 1e-5  # a temperature below this is greedy decoding (vLLM's _SAMPLING_EPS): logits / T overflows
EPS_TEXT = f"{SAMPLING_EPS:.0e}".replace("e-0", "e-")  # "1e-5" in messages and help texts
