"""``ftctl stats``: tokens/s, time to first token, expert hit rate, disk-tier reads, q split, KV
use, per model."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from .client import AdminClient, pb, to_dict
from .output import add_common, console, print_json


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("stats", help="serving statistics per resident model")
    add_common(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    with AdminClient(args.socket) as client:
        rows = to_dict(client.call("Stats", pb.StatsRequest()))["models"]
    if args.json:
        print_json(rows)
        return 0
    table = Table(title="serving statistics", title_justify="left")
    for col in (
        "model",
        "tok/s",
        "TTFT p50 / p90",
        "expert hits",
        "disk reads",
        "CPU routes",
        "KV pages",
        "reqs",
    ):
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        kv_total = r["kv_pages_total"]
        kv_used = r["kv_pages_used"] + r["kv_pages_cached"]
        table.add_row(
            ("* " if r["active"] else "  ") + r["name"],
            f"{r['tokens_per_second']:.1f}",
            f"{r['ttft_p50_s'] * 1e3:.0f} / {r['ttft_p90_s'] * 1e3:.0f} ms",
            f"{r['expert_hit_rate']:.1%}" if r["expert_hits"] + r["expert_misses"] else "-",
            _disk(r),
            f"{r['cpu_route_share']:.1%}",
            f"{kv_used}/{kv_total} ({r['kv_pages_cached']} cached)",
            f"{r['running']} run, {r['requests_finished']} done",
        )
    console().print(table)
    return 0


def _disk(r: dict[str, Any]) -> str:
    """The disk tier's reads: MiB read, the rate the steps saw (bytes over the time they waited
    for reads) and the share of the experts read ahead that were used ("-" without the tier)."""
    n, s = r.get("disk_bytes_read", 0), r.get("disk_read_seconds", 0.0)
    if not n:
        return "-"
    rate = f", {n / s / 2**20:.0f} MiB/s" if s > 0 else ""
    ahead, used = r.get("disk_read_ahead", 0), r.get("disk_read_ahead_hits", 0)
    pre = f", ahead {used / ahead:.0%} used" if ahead else ""
    return f"{n / 2**20:.0f} MiB{rate}{pre}"
