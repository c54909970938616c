"""Reads the model's files: ModelConfig, checkpoint (safetensors, fp8 block scales), tokenizer, chat
template, synthetic checkpoints. Pure Python + NumPy; never imports CuPy."""
