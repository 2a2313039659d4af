"""The server's one interface to the control plane (``freetokend.manager``).

The manager builds the serving state around its managed models from these parts and
imports nothing else from the server; the server reaches the manager only through
``manager.control.ControlPlane`` (server/run.py). Keep this list to what the manager uses.
"""

from __future__ import annotations

from .bridge import IDLE_WAIT_S, EngineBridge, RequestHandle, Submission
from .chat import ChatRequest, Sampling
from .errors import NotFound
from .generation import Generation
from .metrics import Metrics
from .model_names import ModelNames
from .protocols import Service, SubmitBridge
from .scripted import Script
from .scripted import from_env as scripted_replies
from .service import ModelService, Rendered
from .state import ServerState
from .watchdog import Watchdog, watchdog_seconds

__all__ = [
    "IDLE_WAIT_S",
    "ChatRequest",
    "EngineBridge",
    "Generation",
    "Metrics",
    "ModelNames",
    "ModelService",
    "NotFound",
    "Rendered",
    "RequestHandle",
    "Sampling",
    "Script",
    "ServerState",
    "Service",
    "Submission",
    "SubmitBridge",
    "Watchdog",
    "scripted_replies",
    "watchdog_seconds",
]
