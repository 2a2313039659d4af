"""Family name -> its FamilySpec, imported lazily (HF architectures map to families in config.py)."""

from __future__ import annotations

import importlib

from .config import ARCHITECTURES
from .families.spec import FamilySpec

FAMILIES = tuple(sorted(set(ARCHITECTURES.values())))


def family_spec(family: str) -> FamilySpec:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    module = importlib.import_module(f"{__package__}.families.{family}")
    return module.SPEC
