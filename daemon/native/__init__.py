"""The Python faces of the native CPU kernels (extension ``ftdense``, built from native/dense/):
dense and GGUF block-quantised projections and decode attention. Below the model code and the
expert executors, which both run them; above the block formats (formats/gguf_blocks.py)."""
