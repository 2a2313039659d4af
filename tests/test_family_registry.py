"""A family in one place (issue 41 item 3): the registry finds every module under
``models/families/``, each family's declared architectures lead back to it, and the generic code
that reads the families (config_hf, gguf_config, gguf_arch, gguf_loader, the parser registry)
names none of them: a per-family branch or table there fails this test."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import FAMILIES as TINY_FAMILIES

from freetokend.models.config import ModelConfig
from freetokend.models.families.spec import FamilySpec
from freetokend.models.model import CausalLM
from freetokend.models.registry import (
    ARCHITECTURES,
    FAMILIES,
    GGUF_ARCHITECTURES,
    SPECS,
    family_spec,
)
from freetokend.server.parsers.registry import (
    OutputSyntax,
    ReasoningSyntax,
    ToolSyntax,
    detect_syntax,
    family_default,
)

DAEMON = Path(__file__).resolve().parents[1] / "daemon"
FAMILY_DIR = DAEMON / "models" / "families"
# the generic code: it reads the family specs and must name no family
MODELS_GENERIC = (
    "config_hf.py",
    "config_read.py",
    "gguf_config.py",
    "gguf_arch.py",
    "gguf_read.py",
    "gguf_loader.py",
    "registry.py",
    "model.py",
)
PARSER_REGISTRY = DAEMON / "server" / "parsers" / "registry.py"


def _defines_spec(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(
        isinstance(node, (ast.Assign, ast.AnnAssign))
        and any(
            isinstance(t, ast.Name) and t.id == "SPEC"
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
        for node in tree.body
    )


def test_registry_finds_every_family_module() -> None:
    """A module of the package that assigns ``SPEC`` is a family; the others are helpers."""
    modules = {p.stem for p in FAMILY_DIR.glob("*.py") if _defines_spec(p)}
    assert set(FAMILIES) == modules
    assert not _defines_spec(FAMILY_DIR / "spec.py")
    assert len(FAMILIES) >= 11
    for name in FAMILIES:
        spec = family_spec(name)
        assert isinstance(spec, FamilySpec) and spec.name == name
    with pytest.raises(ValueError, match="unknown model family"):
        family_spec("nope")


def test_every_family_is_enrolled_in_the_tiny_model_tests() -> None:
    """tests/tiny_models.py builds a checkpoint of each, which enrols it in the parametrized
    engine, backend, placement and FTW tests."""
    assert set(TINY_FAMILIES) == set(FAMILIES)


def test_declared_architectures_map_back_to_their_family() -> None:
    declared = {a: name for name, spec in SPECS.items() for a in spec.architectures}
    assert declared == ARCHITECTURES
    for name, spec in SPECS.items():
        assert spec.architectures, name
        for arch in spec.architectures:
            assert ARCHITECTURES[arch] == name
        if spec.gguf is not None:
            assert GGUF_ARCHITECTURES[spec.gguf.arch] is spec
            # a GGUF file of the family reads as its first HF architecture
            assert ARCHITECTURES[spec.architectures[0]] == name
    assert {s.gguf.arch for s in GGUF_ARCHITECTURES.values() if s.gguf} == set(GGUF_ARCHITECTURES)


def test_fixed_fields_are_model_config_fields() -> None:
    fields = set(ModelConfig.__dataclass_fields__)
    for name, spec in SPECS.items():
        assert set(spec.hf.fixed) <= fields, name
        assert spec.hf.shared_expert in ("none", "gated", "plain"), name


def test_own_top_levels_resolve() -> None:
    for name, spec in SPECS.items():
        if spec.model:
            module, _, cls = spec.model.partition(":")
            found = getattr(importlib.import_module(f"freetokend.models.{module}"), cls)
            assert issubclass(found, CausalLM), name


def test_output_syntax_names_are_the_server_s() -> None:
    for name, spec in SPECS.items():
        syntax = family_default(name)
        assert syntax == OutputSyntax(
            ToolSyntax(spec.tool_syntax), ReasoningSyntax(spec.reasoning_syntax)
        )
        if syntax.reasoning is not ReasoningSyntax.HARMONY:
            assert detect_syntax(name, "") == syntax
    assert family_default("nope") == OutputSyntax(ToolSyntax.NONE, ReasoningSyntax.NONE)


def _names() -> tuple[set[str], set[str]]:
    """(family names, and the HF and llama.cpp architecture names)"""
    archs = set(ARCHITECTURES) | set(GGUF_ARCHITECTURES)
    return set(FAMILIES), archs


def _docstrings(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _keyed_strings(tree: ast.AST) -> list[str]:
    """String constants used as a key or compared: dict keys, comparison operands, and the
    elements of a tuple, list or set (what a per-family table or branch is made of)."""
    found: list[ast.expr | None] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            found.extend(node.keys)
        elif isinstance(node, ast.Compare):
            found.extend([node.left, *node.comparators])
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            found.extend(node.elts)
    out = []
    for expr in found:
        for sub in ast.walk(expr) if expr is not None else ():
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                out.append(sub.value)
    return out


def _flat(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def _generic_offences(path: Path, identifiers: bool) -> list[str]:
    families, archs = _names()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bad: list[str] = []
    for value in _keyed_strings(tree):
        if value in families or value in archs:
            bad.append(f"table key or comparison {value!r}")
    if not identifiers:
        return bad
    docs = _docstrings(tree)
    word = re.compile(
        r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, families)) + r")(?![A-Za-z0-9_])"
    )
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in archs or word.search(node.value):
                bad.append(f"string {node.value!r}")
    flat = {_flat(n) for n in families | set(GGUF_ARCHITECTURES)}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.alias):
            names = [node.asname or node.name.rpartition(".")[2]]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        bad.extend(f"name {n!r}" for n in names if any(f in _flat(n) for f in flat))
    return bad


@pytest.mark.parametrize("module", MODELS_GENERIC)
def test_generic_model_code_names_no_family(module: str) -> None:
    """No family's name, HF or llama.cpp architecture in a string, a table or an identifier:
    what differs by family is in its module under ``families/``."""
    assert _generic_offences(DAEMON / "models" / module, identifiers=True) == []


def test_parser_registry_keeps_no_family_table() -> None:
    """The defaults come from the family specs; the syntax names (one is also a family's, as
    ``gemma4``) may appear, a table or comparison keyed by a family may not."""
    assert _generic_offences(PARSER_REGISTRY, identifiers=False) == []


def test_the_check_sees_a_family_branch(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        'def f(family, arch):\n    if family == "olmoe":\n        return {"llama": 1}\n'
        "    return _gemma4_text(arch)\n"
    )
    found = _generic_offences(src, identifiers=True)
    assert "table key or comparison 'olmoe'" in found
    assert "table key or comparison 'llama'" in found
    assert "name '_gemma4_text'" in found


def test_family_modules_and_the_config_reader_import_no_torch() -> None:
    """config_hf imports every family module; the CLI-side config readers run without torch."""
    code = (
        "import sys, freetokend.models.config_hf, freetokend.server.parsers.registry; "
        "heavy = [m for m in ('torch', 'transformers', 'triton', 'ftnative', 'ftdense') "
        "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ)
    )
    assert run.returncode == 0, run.stdout + run.stderr
