"""Quantized weights and activations (blockwise FP8: :mod:`.fp8`)."""
