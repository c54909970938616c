"""Recorded oracle goldens (transformers on the tiny synthetic checkpoint) and the script that records them."""
