"""Training the small Qwen3.5 model that ships as qwen-mk's default (``qwen3.5-tiny-trained``).

``corpus``: the reproducible corpus (CPython stdlib source + CPython docs + seeded tool-use conversations);
``conversations``: the conversation generator; ``train``: the PyTorch training run (one H200, minutes);
``export``: the committed artefact and its expansion into a real-format checkpoint live in ``loader/trained.py``.
"""
