"""systemd watchdog: ``WATCHDOG=1`` only while the event loop AND the engine thread are alive.

With ``WatchdogSec=`` in the unit, systemd starts the daemon with ``WATCHDOG_USEC`` (and
``WATCHDOG_PID``) and kills and restarts it (``Restart=on-failure``) when no ``WATCHDOG=1``
arrives for that long. A daemon can hang in two places: the event loop (a deadlock like the
logger one fixed earlier: no HTTP answers) or the engine thread (a step that never returns:
requests wait forever while /health still answers). So the pings come from a task on the event
loop (a blocked loop sends none) and that task sends one only when the engine thread's
heartbeat (``EngineBridge.beat``, refreshed around every step and at least every second while
idle) is younger than ``stale_s``: a stuck engine stops the pings although the loop runs.

Timing (``WatchdogSec=W``): a ping every W/4; the engine counts as stuck after W/2 without a
heartbeat, far above a legitimate step (one step is at most ``max_step_tokens`` of prefill or a
cache resize); a hang is therefore noticed within 1.5 W. systemd arms the watchdog only in the
running state (after READY=1, until STOPPING=1), so loading a model and the drain are not
timed by it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

from ..runtime import sdnotify

log = structlog.get_logger("freetokend.watchdog")


def watchdog_seconds(env: Mapping[str, str] | None = None) -> float | None:
    """systemd's watchdog timeout for this process (``WATCHDOG_USEC``), None when off or when
    it is meant for another process (``WATCHDOG_PID``)."""
    env = os.environ if env is None else env
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return None
    return usec / 1e6 if usec > 0 else None


@dataclass
class Watchdog:
    """Pings systemd every ``interval_s`` while ``beat()`` (the engine thread's last
    heartbeat, time.monotonic) is younger than ``stale_s``."""

    interval_s: float
    stale_s: float
    beat: Callable[[], float]
    notify: Callable[..., bool] = sdnotify.notify
    clock: Callable[[], float] = time.monotonic
    pings: int = 0
    _stuck: bool = False

    @classmethod
    def for_timeout(
        cls, timeout_s: float, beat: Callable[[], float], min_stale_s: float = 0.0
    ) -> Watchdog:
        """Pings every timeout/4; stuck after timeout/2 without a heartbeat, or after
        ``min_stale_s`` (a few of the idle engine's wake-ups) if that is longer."""
        return cls(interval_s=timeout_s / 4, stale_s=max(timeout_s / 2, min_stale_s), beat=beat)

    def engine_alive(self) -> bool:
        return self.clock() - self.beat() < self.stale_s

    def tick(self) -> bool:
        """One ping if the engine is alive; True when sent. Logs once per stuck period."""
        age = self.clock() - self.beat()
        if age >= self.stale_s:
            if not self._stuck:
                log.error(
                    "engine thread stuck: no heartbeat; withholding the systemd watchdog ping",
                    seconds=round(age, 1),
                )
            self._stuck = True
            return False
        if self._stuck:
            log.info("engine thread alive again; watchdog pings resume")
            self._stuck = False
        try:
            self.notify("WATCHDOG=1")
        except OSError as e:  # a full or vanished notify socket costs this ping, not the task
            log.warning("watchdog ping not sent", error=str(e))
            return False
        self.pings += 1
        return True

    async def run(self) -> None:
        """Runs until cancelled (the event loop's shutdown)."""
        while True:
            self.tick()
            await asyncio.sleep(self.interval_s)
