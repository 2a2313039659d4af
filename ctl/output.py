"""Shared ftctl plumbing: --json/--socket options, JSON output, rich tables and progress."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

# Options every command takes, before or after its name (``ftctl --json status`` and
# ``ftctl status --json``), with the value a command sees when none was given.
GLOBAL_DEFAULTS: dict[str, Any] = {"json": False, "socket": None}


def add_common(p: argparse.ArgumentParser) -> None:
    """Adds --json and --socket. They are declared on the top-level parser and on every
    (sub)command with SUPPRESS as the default: argparse copies a subparser's defaults over the
    values parsed before the command name, so only an option actually given may set a value;
    ``fill_globals`` supplies the defaults afterwards."""
    add_json(p)
    p.add_argument(
        "--socket",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="admin socket (default: $FREETOKEN_ADMIN_SOCKET, the per-user path, or "
        "/run/freetokend/admin.sock)",
    )


def add_json(p: argparse.ArgumentParser, help: str = "print JSON instead of tables") -> None:
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=help)


def fill_globals(args: argparse.Namespace) -> argparse.Namespace:
    """The defaults of the global options that were given nowhere on the command line."""
    for name, value in GLOBAL_DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=1))


def console() -> Console:
    return Console(highlight=False)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def kv_table(title: str, rows: Iterable[tuple[str, Any]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, str(value))
    return table


def follow(messages: Iterator[Any], quiet: bool, what: str) -> Any:
    """Consume a Progress stream, showing a spinner with the latest message on a terminal
    (nothing when ``quiet`` or not a terminal); returns the final (done) message. A stream that
    ends without one is a CtlError naming ``what`` (the operation)."""
    last = None
    if quiet or not sys.stderr.isatty():
        for msg in messages:
            last = msg
    else:
        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        ) as bar:
            task = bar.add_task("waiting for the daemon", total=None)
            for last in messages:
                bar.update(task, description=last.message)
    if last is None or not last.done:
        from .client import CtlError

        raise CtlError(f"the daemon ended the {what} without an answer")
    return last
