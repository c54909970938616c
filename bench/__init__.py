"""Benchmarks: correctness first, then CUDA-event timing with L2 rotation; JSON under bench/results/."""
