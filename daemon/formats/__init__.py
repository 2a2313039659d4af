"""Checkpoint file formats, below the model code: readers that know tensors, metadata and
quantization types, and nothing of any model (the loader composes them into one)."""
