"""ModelManager: the models the daemon holds in host RAM, which one is active, switching.

A loaded model keeps its host pool (dense weights and the complete expert pool) resident until
it is unloaded or the host-pool budget needs the room (least recently active first, never the
active model). Switching to a resident model reads no weight file: the hub lets the old model
finish its requests, then ``park`` frees the old model's device caches (expert slots, KV pages,
fused banks, decode graphs) and ``unpark`` restores the new model's to the sizes it had.

Threads: load/unload/switch run in the caller's thread (the admin service calls them from a
worker thread); park/unpark run at a hub safe point (step lock held).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import DISK_TIER_BACKENDS
from ..engine.placement import park_dense, unpark_dense
from ..engine.resize import CacheSizes, current_sizes, resize_expert_slots, resize_kv_pages
from ..engine.resize import slot_backend as _slot_backend
from ..experts.formats import get_format
from ..formats.gguf_file import set_name, split_files
from ..models.loader import model_config, model_kind
from ..runtime import heartbeat
from ..runtime.memlimit import host_pool_budget
from .hub import EngineHub
from .lane import Lane
from .parking import park_fused, park_graphs, unpark_fused, unpark_graphs
from .ticket import Ticket

if TYPE_CHECKING:
    from ..engine.llm import LLM
    from ..server.parts import Service

log = logging.getLogger(__name__)

Loader = Callable[[Path, str, str], "LLM"]  # (model_dir, name, moe_backend)


class ModelError(ValueError):
    """Unknown model, or a request the manager cannot satisfy (the message says which)."""


@dataclass(eq=False)
class ResidentModel:
    name: str
    path: Path
    llm: LLM
    lane: Lane
    host_bytes: int
    moe_backend: str
    weight_loads: int = 1  # times this name's weights were read from disk since the daemon started
    service: Service | None = None  # built by the control plane's factory
    parked: CacheSizes | None = None  # sizes to restore on unpark; None while active
    last_active: float = field(default_factory=time.monotonic)


def host_bytes(llm: LLM) -> int:
    """Bytes of host RAM held by the model's weights: dense parameters plus the expert pool."""
    dense = sum(t.numel() * t.element_size() for t in llm.model.state_dict().values())
    banks = llm.banks.all_tensors().values()
    pool = sum(t.numel() * t.element_size() for t in banks if not t.is_meta)
    tier = getattr(llm.moe, "tier", None)  # the disk tier: its RAM slots, not the file's pool
    if tier is not None:
        pool += sum(t.numel() * t.element_size() for t in tier.slots.all_tensors().values())
    return int(dense + pool)


def default_host_budget(other_bytes: int = 0) -> int:
    """Three quarters of physical RAM, within the process's memory cgroup less what the rest of
    the process needs (``other_bytes`` on top of the runtime's reserve: runtime/memlimit.py)."""
    return host_pool_budget(other_bytes=other_bytes)


def expert_cache_mb(
    path: Path, budget: int, mode: str, cache_gb: float, backend: str, measured: bool = False
) -> float | None:
    """The disk tier's RAM cache (MiB) for the model at ``path`` under ``backend`` (resolved),
    or None when its experts load into RAM: ``mode`` "off"; "auto" when the weight files fit
    ``budget`` (or the tier cannot take the model: logged); "on" always. The cache is
    ``cache_gb`` when given; else, with ``measured`` (the budget is the default one, not set),
    0: sized at load from the memory the dense weights measurably leave (engine/build.py,
    runtime/memlimit.memory_left: the cgroup's limit less what the process holds, not a fixed
    reserve); else what ``budget`` leaves after the other weights."""
    if mode == "off":
        return None
    total = checkpoint_bytes(path)
    if mode == "auto" and total <= budget:
        return None
    cfg = model_config(path)
    fmt = get_format(cfg.expert_format)
    tiered = backend in DISK_TIER_BACKENDS
    if mode == "auto" and (not tiered or model_kind(path) != "gguf" or not fmt.in_blocks):
        log.warning(
            "%s: %d MiB of weights exceed the host-pool budget (%d MiB); the disk tier takes "
            "GGUF experts in a block format under the cpu, offload and hybrid backends only, "
            "so all load into RAM",
            path, total >> 20, budget >> 20,
        )  # fmt: skip
        return None
    if cache_gb > 0:
        return cache_gb * 1024
    if measured:
        return 0.0
    per = fmt.nbytes_per_expert(cfg.hidden_size, cfg.moe_intermediate_size, torch.bfloat16)
    experts = cfg.num_moe_layers * cfg.num_experts * per
    return max(budget - max(total - experts, 0), 0) / 2**20


def checkpoint_bytes(path: Path) -> int:
    """Size on disk of the weight files of a model folder or GGUF file / split set (an
    estimate of its host pool)."""
    if path.is_file():
        return sum(p.stat().st_size for p in split_files(path))
    return sum(
        p.stat().st_size for p in path.iterdir() if p.suffix in (".safetensors", ".ftw", ".bin")
    )


class ModelManager:
    def __init__(
        self,
        loader: Loader,
        default_backend: str,
        host_budget: int,
        auto_switch: bool = False,
        resolve_path: Callable[[str], Path] | None = None,
    ) -> None:
        self.loader = loader
        self.default_backend = default_backend
        self.host_budget = host_budget
        self.auto_switch = auto_switch
        self.resolve_path = resolve_path or (lambda spec: Path(spec).expanduser())
        self.models: dict[str, ResidentModel] = {}
        self.hub: EngineHub | None = None
        self.service_factory: Callable[[ResidentModel], Service] | None = None
        self.on_loaded: Callable[[ResidentModel], None] | None = None
        self._load_counts: dict[str, int] = {}
        self._lock = threading.RLock()  # load / unload / switch bookkeeping

    # ---- queries ------------------------------------------------------------------------------
    @property
    def active(self) -> ResidentModel:
        assert self.hub is not None
        return self._by_lane(self.hub.active)

    @property
    def desired(self) -> ResidentModel:
        assert self.hub is not None
        return self._by_lane(self.hub.desired)

    def _by_lane(self, lane: Lane) -> ResidentModel:
        return self.models[lane.name]

    def get(self, name: str) -> ResidentModel:
        model = self.models.get(name)
        if model is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise ModelError(f"no resident model named {name!r} (resident: {known})")
        return model

    def host_used(self) -> int:
        return sum(m.host_bytes for m in self.models.values())

    # ---- load / unload ------------------------------------------------------------------------
    def load(
        self, spec: str, name: str | None = None, moe_backend: str | None = None
    ) -> ResidentModel:
        """Load a model folder (or return the resident model of that name). The first model
        becomes active; later ones are parked until switched to."""
        path = self.resolve_path(spec)
        if name is None and path.is_file():
            name = set_name(path)
        name = name or path.name
        with self._lock:
            if name in self.models:
                return self.models[name]
            gguf = path.is_file() and path.suffix == ".gguf"
            if not gguf and not (path / "config.json").is_file():
                raise ModelError(f"{path} is not a model folder (no config.json) nor a .gguf file")
            self._make_room(checkpoint_bytes(path), keep=())
            backend = moe_backend or self.default_backend
            started = time.monotonic()
            llm = self.loader(path, name, backend)
            self._load_counts[name] = self._load_counts.get(name, 0) + 1
            model = ResidentModel(
                name, path, llm, Lane(name, llm.engine), host_bytes(llm), backend,
                weight_loads=self._load_counts[name],
            )  # fmt: skip
            log.info("model loaded: %s (%.2f s)", name, time.monotonic() - started)
            if self.service_factory is not None:
                model.service = self.service_factory(model)
            if self.hub is not None:  # not the first model: park its device caches now
                park(model)
            self.models[name] = model
            if self.on_loaded is not None:
                self.on_loaded(model)
            return model

    def unload(self, name: str) -> None:
        with self._lock:
            model = self.get(name)
            if self.hub is not None and model.lane in (self.hub.active, self.hub.desired):
                raise ModelError(f"{name!r} is the active model; switch to another one first")
            del self.models[name]
            model.llm.close()  # inactive, so no step in flight: spill its session snapshots
            release_device(model.llm)
            log.info("model unloaded: %s (%d MiB of host RAM freed)", name, model.host_bytes >> 20)

    def _make_room(self, need: int, keep: tuple[str, ...]) -> None:
        """Unload inactive models, least recently active first, until ``need`` more bytes fit."""
        hub = self.hub
        pinned = {
            m.name for m in self.models.values() if hub and m.lane in (hub.active, hub.desired)
        }
        for model in sorted(self.models.values(), key=lambda m: m.last_active):
            if self.host_used() + need <= self.host_budget:
                return
            if model.name in pinned or model.name in keep:
                continue
            log.info("host-pool budget: unloading %s to make room", model.name)
            del self.models[model.name]
            release_device(model.llm)
        if self.host_used() + need > self.host_budget:
            log.warning(
                "host-pool budget exceeded: %d MiB resident + %d MiB needed > %d MiB",
                self.host_used() >> 20,
                need >> 20,
                self.host_budget >> 20,
            )

    # ---- switching ----------------------------------------------------------------------------
    def switch(self, name_or_path: str, load_if_missing: bool = True) -> Ticket:
        """Start switching; the ticket resolves once the model is active."""
        assert self.hub is not None
        with self._lock:
            model = self.models.get(name_or_path)
            if model is None:
                if not load_if_missing:
                    raise ModelError(f"no resident model named {name_or_path!r}")
                model = self.load(name_or_path)
        # Outside the manager lock: the hub's safe point calls on_swap under its step lock.
        return self.hub.switch_to(model.lane)

    def finish_switch(self, ticket: Ticket, timeout: float | None = None) -> str:
        """Wait for a switch; then unload what no longer fits the host-pool budget."""
        name = str(ticket.wait(timeout))
        with self._lock:
            self._make_room(0, keep=(name,))
        return name

    def on_swap(self, old: Lane, new: Lane) -> None:
        """Hub safe point: the old model finished its requests; hand the device to the new one."""
        old_model, new_model = self.models.get(old.name), self.models[new.name]
        if old_model is not None:
            park(old_model)
            old_model.last_active = time.monotonic()
        unpark(new_model)
        new_model.last_active = time.monotonic()
        log.info("switched model: %s -> %s", old.name, new.name)


def park(model: ResidentModel) -> None:
    """Free the device caches of an idle model (decode graphs, expert slots, KV pages, fused
    banks) and move its dense weights to the host; its host pool stays. The sizes are kept for
    ``unpark``."""
    if model.parked is not None:
        return
    llm = model.llm
    sizes = current_sizes(llm.moe, llm.runner.kv)
    park_graphs(llm.runner)  # first: their scratch KV page must go before the pool shrinks
    be = _slot_backend(llm.moe)
    if be is not None:
        resize_expert_slots(be, 1)
    heartbeat.beat()  # each phase of parking is progress for the watchdog
    prefix = llm.engine.prefix
    if not resize_kv_pages(llm.runner.kv, prefix, 1):
        raise RuntimeError(f"cannot park {model.name}: KV pages still in use")
    park_fused(llm.moe)
    heartbeat.beat()
    park_dense(llm.model, llm.runner.placement)
    model.parked = sizes


def unpark(model: ResidentModel) -> None:
    """Restore a parked model's device caches (copies from its host pool, no disk reads)."""
    sizes = model.parked
    if sizes is None:
        return
    llm = model.llm
    unpark_dense(llm.model, llm.runner.placement)  # first, as at load: the caches fit around it
    unpark_fused(llm.moe, llm.banks)
    heartbeat.beat()
    be = _slot_backend(llm.moe)
    if be is not None and sizes.moe_slots is not None:
        resize_expert_slots(be, sizes.moe_slots)
    heartbeat.beat()
    resize_kv_pages(llm.runner.kv, llm.engine.prefix, sizes.kv_pages)
    heartbeat.beat()
    unpark_graphs(llm.runner)  # last: a graph reads the weights, experts and pool where they are
    model.parked = None


def release_device(llm: object) -> None:
    """Unregister the host pool an unloaded model's accelerator pinned, so a reload (often at
    the same address) registers afresh instead of failing as already registered."""
    acc = getattr(getattr(llm, "moe", None), "acc", None)
    if acc is not None:
        acc.close()
