"""One module per model family, each declaring everything family-specific in ``SPEC: FamilySpec``
(``spec.py``): the HF architectures it serves, how its config.json and GGUF metadata map onto
ModelConfig, its GGUF tensor names, its checkpoint renames and converters, its anchors and its
output syntax. `freetokend.models.registry` finds them by scanning this package; a module
without ``SPEC`` (``spec.py``, shared markup) is a helper the family modules import."""
