"""`ftctl`: the admin CLI. Subcommands live in their own modules, registered in COMMANDS.

Each module exposes `add_parser(subparsers)` (adds its parser and sets `run` as the default
`run` attribute) and `run(args) -> int`. A group ("bench") collects related subcommands
(`ftctl bench cache`, later `ftctl bench bw`). Modules are imported when the parser is built,
so they keep heavy imports (torch) inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# (group or None for a top-level command, module path)
COMMANDS: tuple[tuple[str | None, str], ...] = (
    (None, "ftctl.status"),
    (None, "ftctl.stats"),
    (None, "ftctl.cache"),
    (None, "ftctl.models"),
    ("bench", "ftctl.bench_bw"),
    ("bench", "ftctl.bench_cache"),
    (None, "ftctl.checkpoint"),
    (None, "ftctl.plan"),
    (None, "ftctl.launch"),
    (None, "ftctl.systemd_dropin"),
)

GROUP_HELP = {"bench": "measure the deployment machine and replay cache policies"}


def build_parser() -> argparse.ArgumentParser:
    from .output import add_common

    parser = argparse.ArgumentParser(prog="ftctl", description="freetoken admin CLI")
    add_common(parser)  # global options: also accepted before the command name
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
    """Runs one command; an error prints ``ftctl: <reason>`` (one line) and exits non-zero."""
    from .client import CtlError
    from .output import fill_globals

    argv = list(sys.argv[1:] if argv is None else argv)
    # Arguments after "--" belong to the program a command starts (ftctl launch AGENT -- ...).
    cut = argv.index("--") if "--" in argv else len(argv)
    rest = argv[cut + 1 :]
    args = fill_globals(build_parser().parse_args(argv[:cut]))
    args.passthrough = rest
    if rest and args.command != "launch":
        print(f"ftctl: unexpected arguments after --: {' '.join(rest)}", file=sys.stderr)
        return 2
    try:
        return int(args.run(args) or 0)
    except CtlError as e:
        print(f"ftctl: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
