"""systemd limits that follow from the daemon's settings: the unit's defaults and a drop-in.

systemd/freetokend.service carries the values for the default settings; ``ftctl systemd-dropin
--config FILE`` prints a drop-in with the values for a given config file (install it as
/etc/systemd/system/freetokend.service.d/50-freetoken-limits.conf). tests/test_systemd.py
checks that the unit's values are these functions' for the defaults.

- TimeoutStopSec: SIGTERM drains for up to ``drain_timeout``, then the daemon writes its
  session snapshots (at most ``spill_budget_mb``, at ``SPILL_MB_PER_S`` or faster), then
  exits; ``STOP_MARGIN_S`` covers the server's own shutdown. Past it systemd SIGKILLs, and
  the snapshots not yet written are lost (the files on disk stay whole: they are renamed
  into place).
- MemoryHigh: the host pool (``host_pool_budget_gb``; 0 = 3/4 of RAM) is most of the daemon's
  memory, plus recurrent-state snapshots (``snapshot_budget_mb``) and the runtime. Above
  MemoryHigh the kernel reclaims and throttles the daemon instead of letting it crowd out the
  desktop; no MemoryMax: a hard limit would OOM-kill it, and pinned pages cannot be reclaimed.
- WatchdogSec: see server/watchdog.py.
"""

from __future__ import annotations

import math
from typing import Any

SPILL_MB_PER_S = 100.0  # a slow disk (an old SATA SSD under load, a hard disk)
STOP_MARGIN_S = 15.0
WATCHDOG_S = 120
DEFAULT_MEMORY_HIGH = "90%"  # the default pool is 75% of RAM: 15 points for everything else
RUNTIME_OVERHEAD_MB = 4096  # Python, torch, CUDA context, tokenizers, KV on the CPU backend
POOL_SLACK = 1.15  # allocator slack and bookkeeping around the pool


def stop_timeout_s(cfg: Any) -> int:
    """Seconds systemd waits after SIGTERM: drain, shutdown spill, margin."""
    return math.ceil(cfg.drain_timeout + cfg.spill_budget_mb / SPILL_MB_PER_S + STOP_MARGIN_S)


def memory_high(cfg: Any) -> str:
    """MemoryHigh= for the configured host pool budget (a share of RAM for the default)."""
    if cfg.host_pool_budget_gb <= 0:
        return DEFAULT_MEMORY_HIGH
    pool_mb = cfg.host_pool_budget_gb * 1024 * POOL_SLACK
    return f"{math.ceil(pool_mb + cfg.snapshot_budget_mb + RUNTIME_OVERHEAD_MB)}M"


def dropin(cfg: Any, source: str = "the defaults") -> str:
    """A [Service] drop-in with the limits for ``cfg``."""
    return (
        f"# freetokend limits for {source}, written by `ftctl systemd-dropin`.\n"
        "# Install: /etc/systemd/system/freetokend.service.d/50-freetoken-limits.conf, then\n"
        "# `systemctl daemon-reload`. Rewrite it when drain_timeout, spill_budget_mb,\n"
        "# host_pool_budget_gb or snapshot_budget_mb change.\n"
        "[Service]\n"
        f"# drain_timeout {cfg.drain_timeout:g} s + spill of up to {cfg.spill_budget_mb:g} MB "
        f"at {SPILL_MB_PER_S:g} MB/s + {STOP_MARGIN_S:g} s\n"
        f"TimeoutStopSec={stop_timeout_s(cfg)}\n"
        f"# host pool budget {cfg.host_pool_budget_gb:g} GB (0 = 3/4 of RAM) + snapshots + runtime\n"
        f"MemoryHigh={memory_high(cfg)}\n"
    )
