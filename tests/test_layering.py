"""The package layering the code relies on (issue 15 item 10), checked on the source.

The manager reaches the server only through ``freetokend.server.parts``, its modules import
each other without a cycle (imports inside functions and under TYPE_CHECKING count too), and
the daemon's configuration lives outside the server package.
"""

from __future__ import annotations

import ast
from pathlib import Path

DAEMON = Path(__file__).resolve().parents[1] / "daemon"
MANAGER = DAEMON / "manager"
SERVER_INTERFACE = "freetokend.server.parts"


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, as absolute ``freetokend.…`` names where relative."""
    package = "freetokend." + ".".join(path.relative_to(DAEMON).parent.parts)
    package = package.rstrip(".")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            # ``from . import x`` names submodules
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def manager_graph() -> dict[str, set[str]]:
    mods = {f"freetokend.manager.{p.stem}": p for p in MANAGER.glob("*.py")}
    return {name: imports(path) & set(mods) - {name} for name, path in mods.items()}


def test_imports_resolve_relative_names() -> None:
    found = imports(MANAGER / "routing.py")
    assert "freetokend.manager.hub" in found
    assert SERVER_INTERFACE in found


def test_manager_imports_only_the_server_interface() -> None:
    bad = {
        path.name: sorted(
            m
            for m in imports(path)
            if m.startswith("freetokend.server")
            and m not in (SERVER_INTERFACE, "freetokend.server")
            and not m.startswith(SERVER_INTERFACE + ".")
        )
        for path in sorted(MANAGER.glob("*.py"))
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_manager_modules_have_no_import_cycle() -> None:
    graph = manager_graph()
    assert graph["freetokend.manager.control"]  # the walk sees the manager's own imports
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycle = path[path.index(node) :] + [node]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if node in done:
            return
        for dep in sorted(graph[node]):
            visit(dep, path + [node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])


def test_config_lives_outside_the_server() -> None:
    assert (DAEMON / "config.py").is_file()
    assert not (DAEMON / "server" / "config.py").exists()
    users = [
        p
        for p in DAEMON.rglob("*.py")
        if any(m.startswith("freetokend.server.config") for m in imports(p))
    ]
    assert users == []


def test_edit_model_does_not_depend_on_the_snapshot_store() -> None:
    """kv/snapshots.py refers to the edit model (kv/edits.py), never the other way (issue 14)."""
    assert "freetokend.kv.edits" in imports(DAEMON / "kv" / "snapshots.py")
    found = imports(DAEMON / "kv" / "edits.py")
    assert found  # the walk sees its imports (``__future__`` at least)
    assert sorted(m for m in found if m.startswith("freetokend.kv")) == []


def _above(found: set[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(m for m in found if any(m == p or m.startswith(p + ".") for p in packages))


def test_format_readers_know_no_model() -> None:
    """daemon/formats/ (safetensors, GGUF readers) sits below the model code, the loaders and
    the FTW format (issue 12 item 7): it imports none of them."""
    readers = sorted((DAEMON / "formats").glob("*.py"))
    assert {p.name for p in readers} >= {"gguf_file.py", "safetensors_io.py", "errors.py"}
    assert "gguf" in imports(DAEMON / "formats" / "gguf_file.py")  # the walk sees lazy imports
    upper = ("freetokend.models", "freetokend.engine", "freetokend.checkpoint")
    bad = {p.name: _above(imports(p), upper) for p in readers}
    assert {k: v for k, v in bad.items() if v} == {}


def test_ftw_reader_imports_no_model_code() -> None:
    """checkpoint/ftw.py reads tensors; models.ftw_loader / ftw_convert compose them with a
    model, never the reverse (no lazy re-export either)."""
    found = imports(DAEMON / "checkpoint" / "ftw.py")
    assert "freetokend.checkpoint.ftw_index" in found
    assert _above(found, ("freetokend.models",)) == []
