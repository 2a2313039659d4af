"""The package layering the code relies on (issue 15 item 10, issue 41), checked on the source.

The daemon's packages form one order, bottom to top (``LAYERS``); a module imports only from its
own package and the ones below it, at top level, under TYPE_CHECKING or inside a function alike
(``KNOWN_UPWARD`` names the few that still do not). Modules import each other without a cycle
(top-level imports; those under TYPE_CHECKING and inside functions do not run at import and do
not count there). The manager reaches the server only through ``freetokend.server.parts``, and
the daemon's configuration lives outside the server package.
"""

from __future__ import annotations

import ast
from pathlib import Path

DAEMON = Path(__file__).resolve().parents[1] / "daemon"
MANAGER = DAEMON / "manager"
SERVER_INTERFACE = "freetokend.server.parts"

# Bottom to top, with why each sits where it does. The root modules are their own entries
# ("config", "cli"); "freetokend" is the package's __init__ (the lazy ``LLM`` of the offline API).
LAYERS: tuple[str, ...] = (
    "runtime",  # leaf facts every layer uses: heartbeat, staging, sd_notify, pinning, cpu_isa
    "config",  # the daemon's settings (config.py): plain data, imports nothing of ours
    "formats",  # checkpoint readers and the GGUF block formats: tensors and bytes, no model
    "native",  # the native CPU kernels' Python faces (ftdense): read the block formats
    "store",  # the sqlite state store: bandwidth profiles, model registry, request log
    "kv",  # the paged KV pool and its snapshots (spills to the store)
    "checkpoint",  # the FTW checkpoint format (pins its tensors through runtime.pinning)
    "experts",  # expert banks, their formats, executors and the MoE backends
    "models",  # the model code: layers, loaders (build expert banks), ForwardBatch
    "engine",  # scheduler, runner, sampler, tokenizers: runs a model over the KV pool
    "server",  # the HTTP API over an engine; its interface to the manager is server.parts
    "admin",  # the admin socket (gRPC), driven by the manager
    "manager",  # owns engines, the HTTP server and the admin socket
    "cli",  # the freetokend command
    "freetokend",  # the package's __init__: ``from freetokend import LLM``
)

# Upward imports that remain, each named with why; the test fails on any other, and on an
# entry here that no longer occurs (then delete it).
KNOWN_UPWARD: dict[tuple[str, str], str] = {
    ("freetokend.models.ftw_convert", "freetokend.engine.gguf_tokenizer"): (
        "ftw_convert writes a GGUF checkpoint's tokenizer into the FTW folder; the GGUF tokenizer "
        "(and its transformers import) lives in engine/ with the other tokenizers"
    ),
    ("freetokend.server.run", "freetokend.manager.control"): (
        "server/run.py is the daemon's launcher (cli -> run_daemon), which sits above the "
        "manager; it belongs beside cli.py rather than in server/"
    ),
    ("freetokend.admin.service", "freetokend.manager.hub"): (
        "the admin service maps the hub's SwitchSuperseded to a gRPC status; the exception "
        "belongs below the admin socket (or the manager passes the mapping in)"
    ),
}


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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(DAEMON).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["freetokend", *parts])


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in DAEMON.rglob("*.py")}


def test_every_package_has_a_layer() -> None:
    """A new package (or root module) must be placed in the order."""
    found = {_layer(m) for m in _modules()}
    assert found - set(LAYERS) == set()
    assert len(set(LAYERS)) == len(LAYERS)


def test_no_package_imports_one_above_it() -> None:
    """At top level, under TYPE_CHECKING and inside functions alike."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    mods = _modules()
    found = {
        (name, target)
        for name, path in mods.items()
        for target in imports(path)
        if target.startswith("freetokend.") and rank[_layer(target)] > rank[_layer(name)]
    }
    # ``from pkg import name`` adds ``pkg.name`` too: keep only what names a module
    found = {(a, b) for a, b in found if b in mods or b.rsplit(".", 1)[0] not in mods}
    assert sorted(found - set(KNOWN_UPWARD)) == []
    assert sorted(set(KNOWN_UPWARD) - found) == []  # a fixed one: delete its entry
    assert ("freetokend.models.batch", "freetokend.kv.pool") not in found  # the walk sees them


def _runs_at_import(path: Path) -> set[str]:
    """The modules ``path`` imports when it is imported: module-level statements (in ``if`` and
    ``try`` blocks too), not those inside functions or classes' methods, nor under TYPE_CHECKING."""
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                found.add(module)
                found.update(f"{module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.ClassDef):
                visit([n for n in node.body if not isinstance(n, ast.FunctionDef)])

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return found


def test_daemon_modules_have_no_import_cycle() -> None:
    mods = _modules()
    # a module's own packages are initialised before it (``from . import x`` is not an edge back)
    graph = {
        name: {m for m in _runs_at_import(path) & set(mods) if not name.startswith(m + ".")}
        - {name}
        for name, path in mods.items()
    }
    assert "freetokend.runtime.staging" in graph["freetokend.engine.runner"]
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 1:
            cycle = path[path.index(node) :] + [node]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if state.get(node) == 2:
            return
        state[node] = 1
        for dep in sorted(graph[node]):
            visit(dep, path + [node])
        state[node] = 2

    for name in sorted(graph):
        visit(name, [])


# What an import inside a function may defer (issue 41): the comment's reason starts with one
# of these. Breaking an import cycle is not among them: move what both modules need below them.
DEFERRABLE: tuple[str, ...] = (
    "torch",  # the CLI and ``import freetokend`` start without it
    "transformers",
    "tokenizers",
    "triton",  # the ftkernels GPU kernels
    "gguf",
    "grpc_tools",
    "pynvml",
    "xgrammar",
    "ftdense",  # the native extensions
    "ftnative",
    "optional native/store module",  # a module of ours over them, its ImportError handled
)


def _deferred_reason(here: str, above: str) -> str | None:
    """The reason of a ``# deferred: …`` comment on the import's line or the line above."""
    for line in (here, above):
        if "deferred:" in line:
            return line.split("deferred:", 1)[1].strip()
    return None


def test_deferred_reason_must_name_a_dependency() -> None:
    assert _deferred_reason("    import torch  # deferred: torch (heavy)", "") == "torch (heavy)"
    assert _deferred_reason("    from .x import y", "    # deferred: gguf (the reader)") == (
        "gguf (the reader)"
    )
    assert _deferred_reason("    from .x import y", "") is None
    cycle = "import cycle (the imported module imports this one at top level)"
    assert not cycle.startswith(DEFERRABLE)


def test_every_import_inside_a_function_says_what_it_defers() -> None:
    """An import inside a function remains only to defer a heavy optional dependency, with a
    ``# deferred: …`` comment on its line or the line above naming which (``DEFERRABLE``, issue
    41); every other import, one that would break an import cycle included, sits at the
    module's top level."""
    bare: list[str] = []
    for path in sorted(DAEMON.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    here = lines[node.lineno - 1]
                    above = lines[node.lineno - 2] if node.lineno > 1 else ""
                    reason = _deferred_reason(here, above)
                    if reason is None or not reason.startswith(DEFERRABLE):
                        bare.append(f"{path.relative_to(DAEMON)}:{node.lineno}: {reason}")
    assert sorted(set(bare)) == []
