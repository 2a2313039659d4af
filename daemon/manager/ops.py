"""AdminOps: the operations behind the admin API, as plain data (the gRPC layer converts).

Blocking work (loading weights, waiting for a switch) runs on a worker thread and reports
through a Ticket, so the admin RPC can stream progress while it waits.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ..config import DaemonConfig
from ..engine.resize import slot_backend
from ..server.parts import EngineBridge, ServerState
from .bench import bench_bandwidth
from .cache import CacheControl
from .hub import EngineHub
from .models import ModelManager, ResidentModel
from .store_api import ControlStore
from .ticket import Ticket

VERSION = "0.1.0"


def _in_thread(ticket: Ticket, work: Callable[[Ticket], Any]) -> Ticket:
    def run() -> None:
        try:
            ticket.finish(work(ticket))
        except BaseException as e:
            ticket.fail(e)

    threading.Thread(target=run, name=f"admin-{ticket.what}", daemon=True).start()
    return ticket


def _follow(outer: Ticket, inner: Ticket) -> Any:
    """Mirror ``inner``'s phases on ``outer`` until it resolves; returns its result."""
    while not inner.done:
        _, phase, message = inner.snapshot()
        outer.update(phase, message)
        time.sleep(0.05)
    return inner.wait()


class Control(Protocol):
    """What the admin operations read from the control plane (``control.ControlPlane``
    implements it); a Protocol so this module does not import control.py, which imports it."""

    cfg: DaemonConfig
    manager: ModelManager
    cache: CacheControl
    store: ControlStore
    started: float  # time.time() at start
    http_url: str
    admin_path: Path | None
    vram_status: str

    @property
    def hub(self) -> EngineHub | None: ...

    @property
    def bridge(self) -> EngineBridge | None: ...  # None before start()

    @property
    def state(self) -> ServerState | None: ...  # None before start()


class AdminOps:
    def __init__(self, control: Control) -> None:
        self.c = control

    def _model_info(self, m: ResidentModel) -> dict[str, Any]:
        hub = self.c.manager.hub
        state = "resident"
        if hub is not None and m.lane is hub.active:
            state = "active"
        elif hub is not None and m.lane is hub.desired:
            state = "switching-in"
        return {
            "name": m.name,
            "path": str(m.path),
            "state": state,
            "moe_backend": m.moe_backend,
            "host_bytes": m.host_bytes,
            "weight_loads": m.weight_loads,
            "max_model_len": int(m.llm.max_model_len),
            "family": str(m.llm.config.family),
        }

    # ---- reads ------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        c = self.c
        st = c.manager.active.lane.core.stats()
        state = c.state
        return {
            "version": VERSION,
            "pid": os.getpid(),
            "uptime_s": time.time() - c.started,
            "http_url": c.http_url,
            "active_model": c.manager.active.name,
            "moe_backend": c.cache.info().moe_backend,
            "accelerator": c.cfg.accelerator,
            "running": st.running,
            "waiting": st.waiting,
            "in_flight": c.bridge.in_flight if c.bridge is not None else 0,
            "draining": bool(state and state.draining),
            "admin_socket": str(c.admin_path or ""),
            "vram_watch": c.vram_status,
            "resident_models": len(c.manager.models),
            "auto_switch": c.manager.auto_switch,
            "api_key": next(iter(c.cfg.api_keys), ""),
        }

    def stats(self) -> list[dict[str, Any]]:
        return [self._model_stats(m) for m in list(self.c.manager.models.values())]

    def _model_stats(self, m: ResidentModel) -> dict[str, Any]:
        st = m.lane.core.stats()
        mean, p50, p90 = m.lane.counters.ttft()
        be = slot_backend(m.llm.moe)
        hits = misses = fills = gpu = cpu = 0
        share = 1.0  # the cpu backend computes every route on the CPU
        if be is not None:
            cs = be.cache.stats()
            hits, misses, fills = cs["hits"], cs["misses"], cs["fills"]
            gpu, cpu = be.counters["gpu_routes"], be.counters["cpu_routes"]
            share = cpu / (gpu + cpu) if gpu + cpu else 0.0
        elif m.moe_backend == "fused":
            share = 0.0
        # the disk tier's RAM cache (cpu, offload, hybrid): under offload and hybrid its
        # hits, misses and fills stand in for the device slots' in these rows
        tier = getattr(m.llm.moe, "tier", None)
        disk_bytes, disk_s, ahead = 0, 0.0, (0, 0, 0)
        if tier is not None:
            ts = tier.stats()
            hits, misses, fills = ts["hits"], ts["misses"], ts["fills"]
            disk_bytes, disk_s = ts["bytes_read"], tier.read_seconds
            ahead = (ts["read_ahead"], ts["read_ahead_hits"], ts["read_ahead_wasted"])
        return {
            "name": m.name,
            "active": self.c.hub is not None and m.lane is self.c.hub.active,
            "tokens_per_second": m.lane.counters.tokens_per_second(),
            "ttft_mean_s": mean,
            "ttft_p50_s": p50,
            "ttft_p90_s": p90,
            "requests_finished": m.lane.counters.requests_finished,
            "tokens_generated": m.lane.counters.tokens_generated,
            "expert_hits": hits,
            "expert_misses": misses,
            "expert_fills": fills,
            "expert_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "gpu_routes": gpu,
            "cpu_routes": cpu,
            "cpu_route_share": share,
            "kv_pages_used": st.kv_pages_used,
            "kv_pages_cached": st.kv_pages_cached,
            "kv_pages_total": st.kv_pages_total,
            "kv_page_size": m.llm.runner.kv.page_size,
            "running": st.running,
            "waiting": st.waiting,
            "disk_bytes_read": disk_bytes,
            "disk_read_seconds": disk_s,
            "disk_read_ahead": ahead[0],
            "disk_read_ahead_hits": ahead[1],
            "disk_read_ahead_wasted": ahead[2],
        }

    def cache_info(self) -> dict[str, Any]:
        return self.c.cache.info().as_dict()

    def models(self) -> dict[str, Any]:
        mgr = self.c.manager
        return {
            "models": [self._model_info(m) for m in list(mgr.models.values())],
            "host_budget_bytes": mgr.host_budget,
            "host_used_bytes": mgr.host_used(),
            "auto_switch": mgr.auto_switch,
        }

    # ---- changes ----------------------------------------------------------------------------
    def resize(self, moe_slots: int | None, kv_tokens: int | None) -> Ticket:
        if moe_slots is None and kv_tokens is None:
            raise ValueError("give --moe N and/or --kv N")
        return self.c.cache.resize(moe_slots, kv_tokens)

    def load(self, path: str, name: str, moe_backend: str, activate: bool) -> Ticket:
        mgr = self.c.manager

        def work(t: Ticket) -> dict[str, Any]:
            t.update("loading", f"loading {path}")
            model = mgr.load(path, name or None, moe_backend or None)
            if activate:
                inner = mgr.switch(model.name)
                _follow(t, inner)
                mgr.finish_switch(inner)
            return self._model_info(model)

        return _in_thread(Ticket(f"load {name or path}"), work)

    def unload(self, name: str) -> dict[str, Any]:
        self.c.manager.unload(name)
        return self.models()

    def switch(self, name: str) -> Ticket:
        mgr = self.c.manager

        def work(t: Ticket) -> dict[str, Any]:
            if name not in mgr.models:
                t.update("loading", f"{name} is not resident: loading it")
            inner = mgr.switch(name)
            _follow(t, inner)
            mgr.finish_switch(inner)
            return self._model_info(mgr.active)

        return _in_thread(Ticket(f"switch to {name}"), work)

    def bench(self) -> Ticket:
        c = self.c
        return bench_bandwidth(c.manager, c.store, c.cfg.accelerator)
