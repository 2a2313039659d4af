"""What the routes share: the model service, the bridge, metrics, the drain flag."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from litestar import Request

from .bridge import EngineBridge
from .errors import Unavailable
from .metrics import Metrics
from .protocols import Service


@dataclass
class ServerState:
    service: Service
    bridge: EngineBridge
    metrics: Metrics
    draining: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def check_intake(self) -> None:
        """New inference requests are refused while draining for shutdown."""
        if self.draining:
            raise Unavailable(
                "The server is shutting down and takes no new requests.",
                headers={"Retry-After": "5"},
            )


def server_state(request: Request[Any, Any, Any]) -> ServerState:
    state: ServerState = request.app.state.server
    return state
