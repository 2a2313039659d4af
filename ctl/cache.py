"""``ftctl cache``: show the active model's expert slots and KV pool; ``--moe N --kv N`` resize.

A resize is queued in the daemon and applied at the next safe point (between engine steps;
a KV shrink waits for running requests), without reloading the host pool; the command returns
once it is applied. ``--kv`` takes tokens, with an optional k/m suffix (16k = 16384).
"""

from __future__ import annotations

import argparse

from .client import AdminClient, pb, to_dict
from .output import add_common, console, follow, human_bytes, kv_table, print_json


def tokens(text: str) -> int:
    t = text.strip().lower()
    scale = {"k": 1024, "m": 1024 * 1024}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("cache", help="show or resize the expert slots and KV pool")
    p.add_argument("--moe", type=int, metavar="N", help="expert slots on the accelerator")
    p.add_argument("--kv", type=tokens, metavar="N", help="KV pool size in tokens (16k, 1m)")
    add_common(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    with AdminClient(args.socket) as client:
        if args.moe is None and args.kv is None:
            info = to_dict(client.call("GetCache", pb.CacheRequest()))
        else:
            req = pb.ResizeRequest()
            if args.moe is not None:
                req.moe_slots = args.moe
            if args.kv is not None:
                req.kv_tokens = args.kv
            last = follow(client.stream("ResizeCache", req), args.json, "resize")
            info = to_dict(last.cache)
    if args.json:
        print_json(info)
        return 0
    show(info)
    return 0


def show(info: dict) -> None:
    slots = info["moe_slots"]
    moe = (
        f"{slots} / {info['moe_slots_max']} slots ({info['resident_experts']} resident, "
        f"{human_bytes(slots * info['expert_bytes'])}; target {info['moe_target']})"
        if slots
        else "no slots (experts stay in host RAM)"
    )
    rows = [
        ("model", info["model"]),
        ("MoE backend", info["moe_backend"]),
        ("expert cache", moe),
        (
            "KV pool",
            f"{info['kv_tokens']} tokens = {info['kv_pages']} pages x {info['kv_page_size']} "
            f"({human_bytes(info['kv_bytes'])})",
        ),
        ("KV in use", f"{info['kv_pages_used']} pages, {info['kv_pages_cached']} prefix-cached"),
    ]
    if info["note"]:
        rows.append(("note", info["note"]))
    console().print(kv_table("caches", rows))
