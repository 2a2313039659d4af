"""How the HTTP server reaches the managed models without knowing there are several.

``ServiceRouter`` stands where the server expects its ModelService (``ServerState.service``):
it implements the server's ``Service`` protocol, each attribute the active model's service's, and ``check_model`` / ``start_*`` add
auto-switch: a request naming a resident, inactive model switches to it first when
``auto_switch`` is on (the old model's requests finish first), else it is a 404 that names the
active model. Aliases map to model names first; a name no resident or registered model has is
served by the active model unless ``strict_model_names`` (server/model_names.py). The model a request named is carried from ``check_model`` to ``start_*`` in a
context variable (each HTTP request runs in its own task).

``LaneBridge`` is the bridge a model's ModelService submits through (the server's
``SubmitBridge`` protocol): it tells the engine hub which model's engine the next request
belongs to, then hands over to the shared bridge.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

from ..server.parts import (
    ChatRequest,
    EngineBridge,
    Generation,
    ModelNames,
    NotFound,
    Rendered,
    RequestHandle,
    Sampling,
    Service,
    Submission,
)
from .hub import EngineHub
from .lane import Lane
from .models import ModelManager, ResidentModel

_target: contextvars.ContextVar[str | None] = contextvars.ContextVar("ft_model", default=None)


class LaneBridge:
    def __init__(self, bridge: EngineBridge, hub: EngineHub, lane: Lane) -> None:
        self._bridge, self._hub, self._lane = bridge, hub, lane

    def submit(self, sub: Submission) -> RequestHandle:
        self._hub.route(sub.request_id, self._lane)
        try:
            return self._bridge.submit(sub)
        finally:
            self._hub.unroute(sub.request_id)  # no-op once the hub took it

    # the rest is the shared bridge's
    def check_capacity(self, pending: int = 0) -> None:
        self._bridge.check_capacity(pending)

    def abort(self, request_id: str) -> None:
        self._bridge.abort(request_id)

    def release(self, request_id: str) -> None:
        self._bridge.release(request_id)


def _service_of(model: ResidentModel) -> Service:
    """The model's service; every resident model has one once the control plane started."""
    if model.service is None:
        raise RuntimeError(f"model {model.name!r} has no service yet (the daemon is starting)")
    return model.service


class ServiceRouter:
    def __init__(
        self,
        manager: ModelManager,
        switch_timeout: float = 600.0,
        names: ModelNames | None = None,
        registered: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        self._manager = manager
        self._switch_timeout = switch_timeout
        self._names = names or ModelNames()
        self._registered = registered  # names of models known to the store (maybe unloaded)

    def _active(self) -> Service:
        return _service_of(self._manager.desired)

    # ---- the active model's --------------------------------------------------------------------
    @property
    def name(self) -> str:
        return str(self._active().name)

    @property
    def max_model_len(self) -> int:
        return self._active().max_model_len

    @property
    def max_token_chars(self) -> int:
        return self._active().max_token_chars

    @property
    def tokenizer(self) -> Any:
        return self._active().tokenizer

    def admitted(self) -> AbstractContextManager[None]:
        return self._active().admitted()

    # ---- the requested model's (auto-switch) -------------------------------------------------

    def check_model(self, name: str, serve_unknown: bool = True) -> None:
        _target.set(None)
        current = self._manager.desired.name
        asked, name = name, self._names.canonical(name)
        if name == current:
            return
        resident = self._manager.models.get(name)
        if resident is not None and self._manager.auto_switch:
            _target.set(name)
            return
        if resident is not None:
            msg = (
                f"The model {name!r} is not active; this daemon serves {current!r}; it is "
                f"resident: switch with `ftctl models switch {name}`."
            )
        elif self._names.is_alias(asked) or name in set(self._registered()):
            msg = (
                f"The model {name!r} is not loaded; this daemon serves {current!r} "
                f"(load it with `ftctl models load DIR`)."
            )
        elif serve_unknown and self._names.fallback(name, current):
            return  # no model has this name: the active model answers, and says so
        else:
            msg = (
                f"The model {name!r} does not exist; this daemon serves {current!r} "
                f"(load another with `ftctl models load DIR`)."
            )
        raise NotFound(msg, param="model")

    async def _service(self) -> Service:
        name = _target.get()
        if name is None or name == self._manager.desired.name:
            return self._active()
        manager = self._manager

        def switch() -> None:
            manager.finish_switch(manager.switch(name, load_if_missing=False), self._switch_timeout)

        await asyncio.to_thread(switch)
        return _service_of(manager.get(name))

    async def start_chat(self, req: ChatRequest) -> tuple[Generation, Rendered]:
        return await (await self._service()).start_chat(req)

    async def start_ids(self, ids: list[int], sampling: Sampling) -> Generation:
        return await (await self._service()).start_ids(ids, sampling)

    async def count_tokens(self, req: ChatRequest) -> int:
        name = _target.get()
        svc = _service_of(self._manager.get(name)) if name else self._active()
        return await svc.count_tokens(req)
