"""Developer tools that are not part of the engine package (training the small model)."""
