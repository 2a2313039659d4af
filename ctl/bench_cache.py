"""`ftctl bench cache`: replay a routing trace through expert-cache policies.

    ftctl bench cache --trace FILE --budgets-mib 250,500,1000,2000,4000,8000 [--json]

Prints the decode hit % of each policy per budget (see `freetokend.experts.replay`); `--json`
prints `{"trace", ..., "results": [{"budget_mib", "num_slots", "ours", "lru", "static_hot",
"static_layers", "belady"}, ...]}`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .output import add_json

DEFAULT_BUDGETS = "250,500,1000,2000,4000,8000"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("cache", help="replay a routing trace through cache policies")
    p.add_argument("--trace", required=True, help="trace file (.csv, .json or .jsonl)")
    p.add_argument("--budgets-mib", default=DEFAULT_BUDGETS, help="comma-separated budgets")
    p.add_argument(
        "--expert-mib", type=float, default=None, help="expert size for traces that lack one"
    )
    p.add_argument(
        "--slot-lru", action="store_true", help="also replay the SlotCache with LRU eviction"
    )
    add_json(p, "print JSON instead of a table")
    p.set_defaults(run=run)
    return p


def _budgets(text: str) -> list[float]:
    try:
        out = [float(b) for b in text.split(",") if b.strip()]
    except ValueError as e:
        raise SystemExit(f"ftctl bench cache: bad --budgets-mib {text!r}") from e
    if not out or min(out) <= 0:
        raise SystemExit("ftctl bench cache: --budgets-mib needs positive numbers")
    return out


def run(args: argparse.Namespace) -> int:
    from freetokend.experts import replay

    tr = replay.read_trace(args.trace)
    if args.expert_mib is not None:
        tr = tr.with_expert_bytes(int(args.expert_mib * replay.MIB))
    if tr.expert_bytes is None:
        raise SystemExit(f"ftctl bench cache: {args.trace} has no expert sizes; pass --expert-mib")
    rows: list[dict[str, Any]] = []
    for mib in _budgets(args.budgets_mib):
        budget = int(mib * replay.MIB)
        hit = replay.run_policies(tr, budget, slot_lru=args.slot_lru)
        rows.append({"budget_mib": mib, "num_slots": replay.num_slots_for(tr, budget), **hit})
    if args.json:
        print(json.dumps({"trace": tr.name, **_shape(tr), "results": rows}, indent=1))
    else:
        _print_table(tr, rows)
    return 0


def _shape(tr: Any) -> dict[str, Any]:
    sizes = tr.expert_bytes
    cycle = sum(sizes) * tr.top_k / (1 << 20)  # MiB one token touches across all layers
    return {
        "num_layers": tr.num_layers,
        "num_experts": tr.num_experts,
        "top_k": tr.top_k,
        "token_cycle_mib": round(cycle, 1),
    }


def _print_table(tr: Any, rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    shape = _shape(tr)
    title = (
        f"{tr.name}: {shape['num_layers']} x {shape['num_experts']} experts, "
        f"top-{shape['top_k']}, {shape['token_cycle_mib']} MiB per token cycle — decode hit %"
    )
    table = Table(title=title)
    cols = [k for k in rows[0] if k not in ("budget_mib", "num_slots")]
    for c in ("budget MiB", "slots", *cols):
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(f"{r['budget_mib']:g}", str(r["num_slots"]), *(f"{r[c]:.1f}" for c in cols))
    Console().print(table)
