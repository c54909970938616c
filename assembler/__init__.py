"""The decode step as a graph of ops, the instruction set, per-SM scheduling into an instruction program
with counter dependencies, the NumPy reference of every op (``assembler.ref``) and the CPU VM.
Never imports CuPy."""
