"""`ftctl`: the admin CLI. Subcommands live in their own modules, registered in COMMANDS.

Each module exposes `add_parser(subparsers)` (adds its parser and sets `run` as the default
`run` attribute) and `run(args) -> int`. A group ("bench") collects related subcommands
(`ftctl bench cache`, later `ftctl bench bw`). Modules are imported when the parser is built,
so they keep heavy imports (torch) inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

# (group or None for a top-level command, module path)
COMMANDS: tuple[tuple[str | None, str], ...] = (
    ("bench", "ftctl.bench_cache"),
    (None, "ftctl.checkpoint"),
)

GROUP_HELP = {"bench": "measure the deployment machine and replay cache policies"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ftctl", description="freetoken admin CLI")
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for group, module in COMMANDS:
        target = top
        if group is not None:
            if group not in groups:
                gp = top.add_parser(group, help=GROUP_HELP.get(group))
                groups[group] = gp.add_subparsers(dest=f"{group}_command", required=True)
            target = groups[group]
        importlib.import_module(module).add_parser(target)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
