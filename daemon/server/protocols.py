"""What the server needs of the model service, of the bridge a service submits through, and of
the engine the bridge drives, as Protocols.

The routes reach the served model through :class:`Service` (``ServerState.service``);
``ModelService`` implements it, and so does the manager's ``ServiceRouter`` over several
resident models. A service submits through a :class:`SubmitBridge` (``EngineBridge``, or the
manager's ``LaneBridge`` in front of it), and the bridge's thread steps a :class:`BridgeEngine`
(an ``EngineCore``, or the manager's ``EngineHub``). The manager names these through
``server.parts``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from ..engine.protocols import StepEngine

if TYPE_CHECKING:  # annotations only: no import cycle with the modules that use these
    from .bridge import RequestHandle, Submission
    from .chat import ChatRequest, Sampling
    from .generation import Generation
    from .service import Rendered


class Service(Protocol):
    """The served model as the routes use it."""

    @property
    def name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_token_chars(self) -> int: ...

    @property
    def tokenizer(self) -> Any: ...

    def check_model(self, name: str, serve_unknown: bool = True) -> None: ...

    def admitted(self) -> AbstractContextManager[None]: ...

    async def start_chat(self, req: ChatRequest) -> tuple[Generation, Rendered]: ...

    async def start_ids(self, ids: list[int], sampling: Sampling) -> Generation: ...

    async def count_tokens(self, req: ChatRequest) -> int: ...


class SubmitBridge(Protocol):
    """The bridge as a service and its generations use it: admission, submit, abort, release."""

    def check_capacity(self, pending: int = 0) -> None: ...

    def submit(self, sub: Submission) -> RequestHandle: ...

    def abort(self, request_id: str) -> None: ...

    def release(self, request_id: str) -> None: ...


# The engine the bridge's thread steps (the loop side adds and aborts requests): the engine
# package's StepEngine, named here for the server's own modules.
BridgeEngine = StepEngine


if TYPE_CHECKING:  # mypy checks here that the server's own classes implement the protocols
    from ..engine.core import EngineCore
    from .bridge import EngineBridge
    from .service import ModelService

    def _model_service(service: ModelService) -> Service:
        return service

    def _engine_bridge(bridge: EngineBridge) -> SubmitBridge:
        return bridge

    def _engine_core(core: EngineCore) -> BridgeEngine:
        return core
