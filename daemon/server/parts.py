"""The server's one interface to the control plane (``freetokend.manager``).

The manager builds the serving state around its managed models from these parts and
imports nothing else from the server; the server reaches the manager only through
``manager.control.ControlPlane`` (server/run.py). Keep this list to what the manager uses.
"""

from __future__ import annotations

from .bridge import IDLE_WAIT_S, EngineBridge
from .errors import NotFound
from .metrics import Metrics
from .model_names import ModelNames
from .service import ModelService
from .state import ServerState
from .watchdog import Watchdog, watchdog_seconds

__all__ = [
    "IDLE_WAIT_S",
    "EngineBridge",
    "Metrics",
    "ModelNames",
    "ModelService",
    "NotFound",
    "ServerState",
    "Watchdog",
    "watchdog_seconds",
]
