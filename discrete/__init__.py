"""One CUDA kernel per op (thin __global__ wrappers over shared device functions), launch code, and the
CUDA-graph capture of a decode step."""
