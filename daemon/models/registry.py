"""The model families, found by scanning the ``families`` package: one module each, named as the
family, defining ``SPEC: FamilySpec`` (a module without one is a helper). The HF architecture
table and the GGUF architecture table are derived from the specs; nothing else lists the
families.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from . import families
from .families.spec import FamilySpec


def _discover() -> dict[str, FamilySpec]:
    """Every module of the package that defines ``SPEC``; the others (``spec``, shared markup
    such as anchors for families to come) are helpers."""
    found: dict[str, FamilySpec] = {}
    for info in sorted(pkgutil.iter_modules(families.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{families.__name__}.{info.name}")
        spec = getattr(module, "SPEC", None)
        if spec is None:
            continue
        if not isinstance(spec, FamilySpec):
            raise TypeError(f"{module.__name__}.SPEC is not a FamilySpec")
        found[info.name] = dataclasses.replace(spec, name=info.name)
    return found


def _index(specs: dict[str, FamilySpec]) -> tuple[dict[str, str], dict[str, FamilySpec]]:
    archs: dict[str, str] = {}
    gguf: dict[str, FamilySpec] = {}
    for name, spec in specs.items():
        if not spec.architectures:
            raise TypeError(f"family {name!r} serves no HF architecture")
        for arch in spec.architectures:
            if arch in archs:
                raise TypeError(f"HF architecture {arch!r} claimed by {archs[arch]} and {name}")
            archs[arch] = name
        if spec.gguf is not None:
            if spec.gguf.arch in gguf:
                other = gguf[spec.gguf.arch].name
                raise TypeError(
                    f"GGUF architecture {spec.gguf.arch!r} claimed by {other} and {name}"
                )
            gguf[spec.gguf.arch] = spec
    return archs, gguf


SPECS: dict[str, FamilySpec] = _discover()
FAMILIES = tuple(sorted(SPECS))
# HF ``architectures[0]`` -> family name; llama.cpp ``general.architecture`` -> family spec
ARCHITECTURES, GGUF_ARCHITECTURES = _index(SPECS)


def family_spec(family: str) -> FamilySpec:
    if family not in SPECS:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    return SPECS[family]
