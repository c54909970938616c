"""NumPy reference of every op the engine runs (ops), the model built from them (model), and the tolerance
envelope against the transformers oracle (envelope). docs/INTERFACES.md §3."""
