"""``ftctl models``: list resident models; ``load``, ``unload``, ``switch``.

Resident models keep their host pool in RAM (within the daemon's host-pool budget), so switching
back to one reads no weight file. A switch returns once the model is active; requests already
running on the previous model finish first.
"""

from __future__ import annotations

import argparse

from rich.table import Table

from .client import AdminClient, pb, to_dict
from .output import add_common, console, follow, human_bytes, print_json


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("models", help="list, load, unload or switch models")
    add_common(p)
    sub = p.add_subparsers(dest="models_command", metavar="ACTION")
    lst = sub.add_parser("list", help="resident models (the default)")
    load = sub.add_parser("load", help="load a model folder or GGUF file into host RAM")
    load.add_argument("path", help="model folder, .gguf file, a registered name, or 'builtin'")
    load.add_argument("--name", help="model id clients send (default: the folder name)")
    load.add_argument("--moe-backend", help="cpu | fused | offload | hybrid | auto")
    load.add_argument("--activate", action="store_true", help="switch to it once loaded")
    unload = sub.add_parser("unload", help="free a resident, inactive model")
    unload.add_argument("name")
    switch = sub.add_parser("switch", help="make a model active (loads it if needed)")
    switch.add_argument("name", help="resident model name, or a folder to load")
    for q in (lst, load, unload, switch):
        add_common(q)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    action = args.models_command or "list"
    with AdminClient(args.socket) as client:
        if action == "list":
            data = to_dict(client.call("ListModels", pb.ListModelsRequest()))
        elif action == "unload":
            data = to_dict(client.call("UnloadModel", pb.UnloadModelRequest(name=args.name)))
        else:
            if action == "load":
                req = pb.LoadModelRequest(
                    path=args.path,
                    name=args.name or "",
                    moe_backend=args.moe_backend or "",
                    activate=args.activate,
                )
                stream = client.stream("LoadModel", req)
            else:
                stream = client.stream("SwitchModel", pb.SwitchModelRequest(name=args.name))
            last = follow(stream, args.json, action)
            model = to_dict(last.model)
            if args.json:
                print_json(model)
            else:
                verb = "loaded" if action == "load" else "active"
                console().print(f"{model['name']}: {verb} ({model['state']})")
            return 0
    if args.json:
        print_json(data)
        return 0
    show(data)
    return 0


def show(data: dict) -> None:
    table = Table(
        title=f"models (host RAM {human_bytes(data['host_used_bytes'])} of "
        f"{human_bytes(data['host_budget_bytes'])}; auto switch "
        f"{'on' if data['auto_switch'] else 'off'})",
        title_justify="left",
    )
    for col in ("name", "state", "backend", "host RAM", "loads", "context", "path"):
        table.add_column(col)
    for m in data["models"]:
        table.add_row(
            m["name"],
            m["state"],
            m["moe_backend"],
            human_bytes(m["host_bytes"]),
            str(m["weight_loads"]),
            str(m["max_model_len"]),
            m["path"],
        )
    console().print(table)
