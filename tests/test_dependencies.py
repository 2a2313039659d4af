"""The runtime dependencies of pyproject.toml cover every third-party module the shipped code
imports (issue 12: ``transformers`` was imported by the GGUF tokenizer but only listed in the
``test`` extra, so a plain ``pip install .`` failed on the first GGUF with a tokenizer).

Every ``import`` in ``daemon/``, ``ctl/`` and ``kernels/`` counts, at module level or inside a
function (a lazy import still runs for the user who reaches it).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("daemon", "ctl", "kernels")
# Our own import names: the packages of setup.py and the extensions native/build.py makes.
FIRST_PARTY = {"freetokend", "ftctl", "ftkernels", "ftnative", "ftdense"}
# Third-party modules deliberately not in [project].dependencies, each imported only where the
# code can do without it (under try, or by a developer tool):
ALLOWED_UNDECLARED = {
    # Triton comes with torch's CUDA builds; only the accelerator paths (ftkernels) import it,
    # and the CPU build, which lacks it, never reaches them.
    "triton",
    # daemon/admin/codegen.py regenerates admin_pb2*.py for developers (grpcio-tools, test
    # extra); the daemon itself imports the generated files.
    "grpc_tools",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def third_party_imports(folders: tuple[str, ...] = SHIPPED) -> dict[str, set[str]]:
    """Top-level module name -> the files importing it, for every absolute import that is
    neither the standard library nor ours."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in FIRST_PARTY:
                        continue
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def declared_dependencies() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    names = set()
    for req in project["dependencies"]:
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
        assert match, req
        names.add(_norm(match.group(1)))
    return names


def test_scan_sees_lazy_and_top_level_imports() -> None:
    found = third_party_imports()
    assert "daemon/engine/gguf_tokenizer.py" in found["transformers"]  # inside a function
    assert "torch" in found and "gguf" in found  # at module level
    assert not FIRST_PARTY & set(found)


def test_runtime_dependencies_cover_every_import() -> None:
    dists = importlib.metadata.packages_distributions()
    declared = declared_dependencies()
    missing = {}
    for module, files in sorted(third_party_imports().items()):
        if module in ALLOWED_UNDECLARED:
            continue
        providers = {_norm(d) for d in dists.get(module, [])}
        if not providers & declared:
            missing[module] = (sorted(providers) or ["<not installed>"], sorted(files))
    assert missing == {}, (
        "third-party modules imported by the shipped code whose distribution is not in "
        f"[project].dependencies (module: (distributions, files)): {missing}"
    )


def test_allowlist_is_still_needed() -> None:
    """An allowlisted module nobody imports any more, or one now declared, leaves the list."""
    found = third_party_imports()
    dists = importlib.metadata.packages_distributions()
    declared = declared_dependencies()
    for module in ALLOWED_UNDECLARED:
        assert module in found, f"{module} is allowlisted but no longer imported"
        assert not {_norm(d) for d in dists.get(module, [])} & declared, module
