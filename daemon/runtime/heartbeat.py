"""The engine side's sign of progress inside long operations, for the systemd watchdog.

The bridge's engine thread refreshes its own heartbeat around every step and idle wake-up
(``EngineBridge.beat``); the watchdog withholds its ping once that is older than half of
``WatchdogSec`` (60 s under the shipped unit). Some engine-side work legitimately takes longer
than that in one call: the idle snapshot spill (one file per session snapshot, gigabytes on a
slow disk), the bandwidth bench, parking or restoring a model's device caches and dense weights.
Each calls :func:`beat` once per unit of progress (a file written, a bench iteration, a module
moved), so a busy engine is not taken for a stuck one, while a unit that itself never returns
still stops the pings.

Process-wide on purpose: these operations run on the engine thread, or on a control thread that
holds the engine's step lock (a control call made while the engine is idle), and either way
the engine thread waits on them.
"""

from __future__ import annotations

import time

_last = 0.0  # time.monotonic() of the last beat; 0.0: none yet


def beat() -> None:
    """One unit of a long engine-side operation is done."""
    global _last
    _last = time.monotonic()


def last() -> float:
    """time.monotonic() of the last :func:`beat` (0.0 before the first)."""
    return _last
