"""``ftctl bench bw``: measure B_D (the disk's reads of the model's weights file, as the disk
tier reads them), B_P (host -> accelerator expert copies) and B_H (CPU expert execution) on the
daemon's machine with its active model, and store the profile (ARCHITECTURE §4.3)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .client import AdminClient, pb, to_dict
from .output import add_common, console, follow, kv_table, print_json


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bw", help="measure and store the bandwidth profile (B_D, B_P, B_H)")
    add_common(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    with AdminClient(args.socket) as client:
        stream = client.stream("BenchBandwidth", pb.BenchBandwidthRequest())
        last = follow(stream, args.json, "measurement")
    prof = to_dict(last.bandwidth)
    if args.json:
        print_json(prof)
        return 0
    b_p, b_h = prof["b_p"], prof["b_h"]
    q_of_4 = 4 if b_h <= b_p else max(1, min(4, round(4 * b_p / b_h)))
    rows = [
        ("B_D (disk reads for the disk tier)", _disk_rate(prof)),
        ("disk file", _disk_file(prof)),
        ("B_P (copies to the accelerator)", f"{b_p / 1e9:.2f} GB/s"),
        ("B_H (CPU expert execution)", f"{b_h / 1e9:.2f} GB/s"),
        ("expert format", f"{prof['expert_format']} ({prof['expert_bytes']} B per expert)"),
        ("accelerator", prof["accelerator"]),
        ("q* for m = 4 misses", f"{q_of_4} filled, {4 - q_of_4} on the CPU"),
    ]
    console().print(kv_table("bandwidth profile (stored)", rows))
    return 0


def _disk_file(prof: dict[str, Any]) -> str:
    """The file B_D read (its name: --json has the path) and what it is to the model."""
    if not prof["disk_path"]:
        return "-"
    return f"{Path(prof['disk_path']).name} ({prof['disk_note']})"


def _disk_rate(prof: dict[str, Any]) -> str:
    """B_D's row: the rate, and whether the page cache served the reads (no O_DIRECT there);
    the reason where it was not measured."""
    if not prof["b_d"]:
        return prof["disk_note"] or "not measured"
    text = f"{prof['b_d'] / 1e9:.2f} GB/s"
    return text if prof["disk_direct"] else f"{text} (page cache, not O_DIRECT)"
