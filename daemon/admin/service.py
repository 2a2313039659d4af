"""The gRPC Admin service: translates RPCs to the control plane's operations (``AdminOps``).

Long operations (resize, load, switch, bench) return a Ticket; the RPC streams its phase
changes as ``Progress`` messages and ends with one ``done`` message that carries the result.
Errors become gRPC status codes with a one-line message (ftctl prints it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc

from ..manager.hub import SwitchSuperseded
from . import admin_pb2 as pb
from . import admin_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

POLL_S = 0.05


class Ops(Protocol):
    """What the service needs from the control plane (``freetokend.manager.ops.AdminOps``)."""

    def status(self) -> dict[str, Any]: ...
    def stats(self) -> list[dict[str, Any]]: ...
    def cache_info(self) -> dict[str, Any]: ...
    def resize(self, moe_slots: int | None, kv_tokens: int | None) -> Any: ...
    def models(self) -> dict[str, Any]: ...
    def load(self, path: str, name: str, moe_backend: str, activate: bool) -> Any: ...
    def unload(self, name: str) -> dict[str, Any]: ...
    def switch(self, name: str) -> Any: ...
    def bench(self) -> Any: ...


def _code_of(e: BaseException) -> grpc.StatusCode:

    if isinstance(e, SwitchSuperseded):
        return grpc.StatusCode.ABORTED
    if isinstance(e, LookupError) or "no resident model" in str(e):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(e, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(e, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc.StatusCode.INTERNAL


def _as_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else dict(obj)  # type: ignore[arg-type]


def _model_list(d: dict[str, Any]) -> pb.ModelList:
    return pb.ModelList(
        models=[pb.ModelInfo(**m) for m in d["models"]],
        host_budget_bytes=d["host_budget_bytes"],
        host_used_bytes=d["host_used_bytes"],
        auto_switch=d["auto_switch"],
    )


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, ops: Ops) -> None:
        self.ops = ops

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[[], Any]) -> Any:
        try:
            return await asyncio.to_thread(fn)
        except Exception as e:
            if _code_of(e) is grpc.StatusCode.INTERNAL:
                log.exception("admin call failed")
            await context.abort(_code_of(e), str(e) or type(e).__name__)

    async def _follow(
        self,
        context: grpc.aio.ServicerContext,
        start: Callable[[], Any],
        final: Callable[[Any], pb.Progress],
    ) -> AsyncIterator[pb.Progress]:
        ticket = await self._call(context, start)
        seen = -1
        while not ticket.done:
            version, phase, message = ticket.snapshot()
            if version != seen:
                seen = version
                yield pb.Progress(phase=phase, message=message)
            await asyncio.sleep(POLL_S)
        try:
            result = ticket.future.result()
        except Exception as e:
            await context.abort(_code_of(e), str(e) or type(e).__name__)
        done = final(result)
        done.phase, done.done = "done", True
        if not done.message:
            done.message = f"{ticket.what}: done"
        yield done

    # ---- unary -------------------------------------------------------------------------------
    async def Status(self, request: Any, context: Any) -> pb.StatusReply:
        return pb.StatusReply(**await self._call(context, self.ops.status))

    async def Stats(self, request: Any, context: Any) -> pb.StatsReply:
        rows = await self._call(context, self.ops.stats)
        return pb.StatsReply(models=[pb.ModelStats(**r) for r in rows])

    async def GetCache(self, request: Any, context: Any) -> pb.CacheInfo:
        return pb.CacheInfo(**await self._call(context, self.ops.cache_info))

    async def ListModels(self, request: Any, context: Any) -> pb.ModelList:
        return _model_list(await self._call(context, self.ops.models))

    async def UnloadModel(self, request: Any, context: Any) -> pb.ModelList:
        return _model_list(await self._call(context, lambda: self.ops.unload(request.name)))

    # ---- streaming ---------------------------------------------------------------------------
    async def ResizeCache(self, request: Any, context: Any) -> AsyncIterator[pb.Progress]:
        moe = request.moe_slots if request.HasField("moe_slots") else None
        kv = request.kv_tokens if request.HasField("kv_tokens") else None
        async for msg in self._follow(
            context,
            lambda: self.ops.resize(moe, kv),
            lambda info: pb.Progress(cache=pb.CacheInfo(**_as_dict(info)), message=info.note),
        ):
            yield msg

    async def LoadModel(self, request: Any, context: Any) -> AsyncIterator[pb.Progress]:
        async for msg in self._follow(
            context,
            lambda: self.ops.load(
                request.path, request.name, request.moe_backend, request.activate
            ),
            lambda info: pb.Progress(model=pb.ModelInfo(**info)),
        ):
            yield msg

    async def SwitchModel(self, request: Any, context: Any) -> AsyncIterator[pb.Progress]:
        async for msg in self._follow(
            context,
            lambda: self.ops.switch(request.name),
            lambda info: pb.Progress(model=pb.ModelInfo(**info)),
        ):
            yield msg

    async def BenchBandwidth(self, request: Any, context: Any) -> AsyncIterator[pb.Progress]:
        async for msg in self._follow(
            context,
            self.ops.bench,
            lambda prof: pb.Progress(bandwidth=pb.BandwidthProfile(**_as_dict(prof))),
        ):
            yield msg
