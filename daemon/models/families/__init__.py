"""One small module per model family: how its checkpoint names map onto our layers.

Each module defines ``SPEC: FamilySpec``. `freetokend.models.registry` imports them lazily.
"""
