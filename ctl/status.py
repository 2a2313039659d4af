"""``ftctl status``: is the daemon up, which model it serves, where, how busy."""

from __future__ import annotations

import argparse

from .client import AdminClient, pb, to_dict
from .output import add_common, console, kv_table, print_json


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("status", help="daemon status: model, API address, load")
    add_common(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    with AdminClient(args.socket) as client:
        reply = to_dict(client.call("Status", pb.StatusRequest()))
    # the key is for `ftctl launch`; status output gets pasted into bug reports
    reply["api_key_required"] = bool(reply.pop("api_key", ""))
    if args.json:
        print_json(reply)
        return 0
    up = reply["uptime_s"]
    rows = [
        ("model", reply["active_model"]),
        ("API", reply["http_url"] or "(starting)"),
        ("MoE backend", f"{reply['moe_backend']} on {reply['accelerator']}"),
        ("requests", f"{reply['running']} running, {reply['waiting']} waiting"),
        ("resident models", reply["resident_models"]),
        ("auto switch", "on" if reply["auto_switch"] else "off"),
        ("API key", "required" if reply["api_key_required"] else "none"),
        ("VRAM watcher", reply["vram_watch"]),
        ("admin socket", reply["admin_socket"]),
        ("uptime", f"{int(up // 3600)}h {int(up % 3600 // 60)}m {int(up % 60)}s"),
        ("pid / version", f"{reply['pid']} / {reply['version']}"),
    ]
    if reply["draining"]:
        rows.insert(0, ("state", "DRAINING"))
    console().print(kv_table("freetokend", rows))
    return 0
