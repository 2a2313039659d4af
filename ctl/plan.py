"""`ftctl plan`: will this model fit my card? A dry run on a simulated GPU (ARCHITECTURE §9.2).

    ftctl plan --model DIR|FILE.gguf [--vram 8GiB] [--ram 32GiB] [--backend auto]
               [--kv-tokens N] [--expert-format FORMAT] [--disk-rate 2GB/s] [--json]

Needs only the model folder's ``config.json`` (plan before downloading the weights), or a GGUF
file's header, and no daemon: the daemon's load, a prompt chunk and decode steps run in this
process on a fake CUDA device of ``--vram`` (the real CUDA code path, no data). Prints where
every part lives, the expert slot count, the KV tokens, the predicted peak VRAM and host RAM,
and the host syncs per decode step. ``--expert-format`` plans the routed experts in a format of
experts/formats.py in place of what config.json's quantization_config says (compressed-tensors
and ModelOpt NVFP4 / INT4 releases are read from it: ``nvfp4`` / ``q4_0``). A GGUF file of
block experts whose files exceed three quarters of ``--ram`` under ``--backend`` cpu, offload or
hybrid is planned
as the daemon runs it, with the disk tier: its RAM cache, the bytes a token reads at uniform
routing and the decode rate the disk's read rate (``--disk-rate``, or measured) bounds. Exit
status: 0 it fits; 1 it does not (the reason on stderr); 2 bad input.
"""

from __future__ import annotations

import argparse
import re
import sys

from .output import console, human_bytes, kv_table, print_json

_UNITS = {
    "": 1 << 20,  # a bare number is MiB
    "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip


def _bytes(text: str, per_second: bool = False) -> int | None:
    """'8GiB' -> bytes ('1.5GB/s' where ``per_second``; a bare number is MiB); None: not one."""
    tail = r"(?:\s*/\s*s)?" if per_second else ""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*?)" + tail + r"\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_size(text: str) -> int:
    """'8GiB', '8G', '24GB', '8192' (MiB) -> MiB. Raises ValueError."""
    n = _bytes(text)
    if n is None:
        raise ValueError(f"not a size: {text!r} (examples: 8GiB, 24GB, 16384 for MiB)")
    if n >> 20 < 1:
        raise ValueError(f"size too small: {text!r}")
    return n >> 20


def parse_rate(text: str) -> float:
    """'2GB/s', '900MB/s', '1.5G' -> bytes/s (a bare number is MiB/s). Raises ValueError."""
    n = _bytes(text, per_second=True)
    if n is None or n < 1:
        raise ValueError(f"not a read rate: {text!r} (examples: 2GB/s, 900MB/s)")
    return float(n)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _rate(text: str) -> float:
    try:
        return parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="dry-run a model on a simulated GPU: placement, peak VRAM and RAM, fits?"
    )
    p.add_argument("--model", required=True, help="model folder (config.json is enough)")
    p.add_argument("--vram", type=_size, default=8192, help="the card's memory (default 8GiB)")
    p.add_argument("--ram", type=_size, help="host RAM (default: this machine's)")
    p.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "fused", "offload", "hybrid", "cpu"),
        help="MoE backend (default auto: what the daemon picks)",
    )
    p.add_argument(
        "--kv-tokens",
        type=int,
        help="KV pool in tokens (default: the daemon's: a quarter of the VRAM the dense weights "
        "leave with an accelerator backend, 131072 on the host)",
    )
    p.add_argument(
        "--expert-format",
        metavar="FORMAT",
        help="plan the routed experts in this format (bf16, fp8_block, mxfp4, nvfp4, a GGUF "
        "block type) whatever config.json's quantization_config says, which is then not read: "
        "(NVFP4 / INT4 releases are read from it as nvfp4 / q4_0)",
    )
    p.add_argument(
        "--disk-rate",
        type=_rate,
        metavar="RATE",
        help="the disk's read rate for a disk tier's predicted decode rate (e.g. 2GB/s; "
        "default: measured on the GGUF file, 256 MiB of 1 MiB reads)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from freetokend.engine.plan import plan_model
    from freetokend.formats.errors import CheckpointError
    from freetokend.models.config import ConfigError

    if args.kv_tokens is not None and args.kv_tokens < 1:
        print("ftctl plan: --kv-tokens must be at least 1", file=sys.stderr)
        return 2
    try:
        plan = plan_model(
            args.model, args.vram, args.ram, args.backend, args.kv_tokens,
            expert_format=args.expert_format, disk_rate=args.disk_rate,
        )  # fmt: skip
    except (ConfigError, CheckpointError, OSError, ValueError) as e:
        print(f"ftctl plan: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if args.json:
        print_json(plan.as_json())
    else:
        _print_table(plan)
    if not plan.fits:
        print(f"ftctl plan: does not fit: {plan.reason}", file=sys.stderr)
        return 1
    return 0


def _print_table(plan) -> None:  # type: ignore[no-untyped-def]
    mib = 1 << 20
    rows = [
        ("model", plan.model),
        ("fits", "yes" if plan.fits else f"NO: {plan.reason}"),
        ("backend", plan.backend),
        ("card", f"{human_bytes(plan.vram_mib * mib)}, peak {human_bytes(plan.vram_peak_mib * mib)}"),
        ("host RAM", f"{human_bytes(plan.ram_mib * mib)}, peak {human_bytes(plan.ram_peak_mib * mib)}"),
        ("expert slots", f"{plan.slots} x {human_bytes(plan.slot_mib * mib)} ({plan.expert_format} pool)"),
        ("KV tokens", plan.kv_tokens),
        ("host syncs / decode step", f"{plan.host_syncs_per_decode_step:g} ("
         + ", ".join(f"{k} {v:g}" for k, v in plan.host_syncs_by_kind.items()) + ")"),
    ]  # fmt: skip
    rows += [(f"  {part}", dev) for part, dev in plan.placement.items()]
    rows += [(f"  {part} size", human_bytes(v * mib)) for part, v in plan.parts_mib.items()]
    rows += _disk_rows(plan.disk_tier)
    console().print(kv_table("plan", rows))


def _disk_rows(t: dict) -> list[tuple[str, str]]:  # type: ignore[type-arg]
    """The disk tier's rows (none when every expert is in RAM)."""
    if not t:
        return []
    rows = [("disk tier", f"RAM cache of {t['cache_experts']} of {t['pool_experts']} experts "
             f"({human_bytes(t['cache_mib'] * (1 << 20))})")]  # fmt: skip
    if "hit_fraction" in t:
        bound = t["decode_tok_s_disk_bound"]
        rows += [
            ("  hit rate (uniform routing)", f"{t['hit_fraction']:.0%}, a lower bound: real "
             "routing repeats experts"),
            ("  read per token", human_bytes(t["missed_mib_per_token"] * (1 << 20))),
            ("  disk read rate", f"{t['disk_read_mb_s']:.0f} MB/s ({t['disk_rate_source']})"),
            ("  decode, disk-bound", "no reads" if bound is None else f"<= {bound:.1f} tok/s"),
        ]  # fmt: skip
    return rows
