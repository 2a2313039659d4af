"""``freetokend`` command-line flags of the control plane (models, elastic caches, VRAM)."""

from __future__ import annotations

import argparse


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _alias(text: str) -> tuple[str, str]:
    name, sep, model = text.partition("=")
    if not sep or not name.strip() or not model.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=MODEL, got {text!r}")
    return name.strip(), model.strip()


def add_control_flags(p: argparse.ArgumentParser) -> None:
    """Flags mirror DaemonConfig fields (None = not given, so lower layers can fill them)."""
    g = p.add_argument_group("control plane (also settable at run time with ftctl)")
    g.add_argument(
        "--accelerator",
        choices=("auto", "cuda", "standin", "fake-cuda"),
        help="expert device (default: auto; fake-cuda: a simulated card of --vram-mib, no data)",
    )
    g.add_argument("--vram-mib", type=int, metavar="N", help="the fake-cuda card's memory, MiB")
    g.add_argument("--moe-slots", type=int, metavar="N", help="expert slots on the accelerator")
    g.add_argument("--kv-tokens", type=int, metavar="N", help="KV pool size in tokens")
    g.add_argument(
        "--auto-switch",
        type=_bool,
        metavar="BOOL",
        help="a request naming a resident, inactive model switches to it (default: false)",
    )
    g.add_argument(
        "--strict-model-names",
        type=_bool,
        metavar="BOOL",
        help="a request naming no loaded or registered model is a 404 (default: false: the "
        "active model answers and the response names it)",
    )
    g.add_argument(
        "--model-alias",
        dest="model_aliases",
        type=_alias,
        action="append",
        metavar="NAME=MODEL",
        help="requests naming NAME go to MODEL (repeatable; TOML: [model_aliases] table)",
    )
    g.add_argument(
        "--host-pool-budget-gb",
        type=float,
        metavar="GB",
        help="host RAM for resident models' weights (default: 0 = 3/4 of RAM)",
    )
    g.add_argument(
        "--vram-watch",
        type=_bool,
        metavar="BOOL",
        help="shrink the expert cache under VRAM pressure, grow it back (default: true)",
    )
    g.add_argument("--vram-low-mb", type=int, metavar="MB", help="shrink below this (1024)")
    g.add_argument("--vram-high-mb", type=int, metavar="MB", help="grow above this (3072)")
    g.add_argument("--vram-poll-s", type=float, metavar="S", help="NVML polling period (2)")
    r = p.add_argument_group("agent state reuse")
    r.add_argument(
        "--prefix-cache",
        type=_bool,
        metavar="BOOL",
        help="reuse KV and recurrent-state snapshots across requests (default: true)",
    )
    r.add_argument(
        "--snapshot-policy",
        metavar="P",
        help="where hybrid models save recurrent state: anchors (agent turn and tool "
        "boundaries), anchors:all, interval:N, none (default: anchors)",
    )
    r.add_argument("--snapshot-budget-mb", type=float, metavar="MB", help="RAM for snapshots (256)")
    r.add_argument(
        "--spill-budget-mb",
        type=float,
        metavar="MB",
        help="disk for session snapshots in the state folder, so a restart resumes agent "
        "sessions without re-prefilling them; 0 = none (2048)",
    )
    r.add_argument(
        "--spill-idle-s",
        type=float,
        metavar="S",
        help="write new session snapshots after this many idle seconds (2)",
    )
