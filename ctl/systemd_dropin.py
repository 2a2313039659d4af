"""``ftctl systemd-dropin --config FILE``: the systemd limits that follow from a config file.

Prints a drop-in for freetokend.service (TimeoutStopSec from the drain timeout and the shutdown
spill, MemoryHigh from the host pool budget; see ``freetokend.admin.unit_limits``). No daemon
needed:

    ftctl systemd-dropin --config /etc/freetoken/freetokend.toml \\
      | sudo tee /etc/systemd/system/freetokend.service.d/50-freetoken-limits.conf
"""

from __future__ import annotations

import argparse

from .client import CtlError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "systemd-dropin", help="print systemd limits (stop timeout, MemoryHigh) for a config"
    )
    p.add_argument("--config", metavar="FILE", help="the daemon's TOML file (default: defaults)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from freetokend.admin.unit_limits import dropin
    from freetokend.config import ConfigError, resolve

    try:
        # the file alone: the unit's environment and flags are not this shell's
        cfg = resolve({}, args.config, env={"FREETOKEN_STATE_DIR": "/var/lib/freetokend"})
    except ConfigError as e:
        raise CtlError(str(e)) from None
    print(dropin(cfg, args.config or "the defaults"), end="")
    return 0
