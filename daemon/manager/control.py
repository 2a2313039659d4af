"""ControlPlane: builds the daemon's serving state around managed models and runs the admin side.

``serve()`` (server/run.py) asks it for the ServerState: the first model is loaded through the
ModelManager, the bridge drives an EngineHub instead of the model's EngineCore, and the state's
``service`` is a ServiceRouter over the resident models. Then the admin gRPC server (unless
``admin_socket = "off"``) and the VRAM watcher start; readiness goes to systemd once the HTTP
API listens (``state.extra["on_listening"]``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import torch

from ..admin.gate import SocketBusy
from ..admin.paths import daemon_socket
from ..admin.server import AdminServer
from ..config import DaemonConfig
from ..engine.engine_config import EngineConfig
from ..engine.llm import LLM
from ..engine.resize import slot_backend
from ..experts.backend import resolve_backend
from ..experts.bandwidth import profile_format
from ..experts.vram_watch import SlotSizes, VramWatcher, nvml_reader
from ..models.builtin import ensure_builtin_model
from ..models.dense_quant import expert_format
from ..models.expert_quant import stored_expert_format
from ..models.layers.attention import set_decode_kernel
from ..models.loader import model_config
from ..runtime import sdnotify
from ..server.parts import (
    IDLE_WAIT_S,
    EngineBridge,
    Metrics,
    ModelNames,
    ModelService,
    Script,
    ServerState,
    Watchdog,
    scripted_replies,
    watchdog_seconds,
)
from .cache import CacheControl
from .hub import EngineHub
from .models import ModelManager, ResidentModel, default_host_budget, expert_cache_mb
from .ops import AdminOps
from .routing import LaneBridge, ServiceRouter
from .store_api import ControlStore, open_store

log = logging.getLogger(__name__)


class ControlPlane:
    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self.started = time.time()
        # test-only scripted replies (server/scripted.py), from the environment; refused
        # (ScriptError: the daemon does not start) unless the test mode is enabled too
        self.script: Script | None = scripted_replies()
        self.state_dir = Path(cfg.state_dir or ".")
        self.store: ControlStore = open_store(self.state_dir)
        budget = int(cfg.host_pool_budget_gb * 2**30) or default_host_budget(
            int(cfg.snapshot_budget_mb * 2**20)
        )
        self.manager = ModelManager(
            self._load_llm, cfg.moe_backend, budget, cfg.auto_switch, self._resolve
        )
        self.manager.on_loaded = lambda m: self.store.register_model(m.name, str(m.path))
        self.cache = CacheControl(self.manager)
        self.names = ModelNames(cfg.model_aliases, cfg.strict_model_names)
        self.metrics = Metrics()
        self.http_url = ""
        self.admin_path: Path | None = None
        self.admin: AdminServer | None = None
        self.watcher: VramWatcher | None = None
        self.vram_status = "off: disabled in the config" if not cfg.vram_watch else "off"
        self.hub: EngineHub | None = None
        self.bridge: EngineBridge | None = None
        self.state: ServerState | None = None
        self.watchdog: Watchdog | None = None  # under systemd's WatchdogSec=
        self._watchdog_task: asyncio.Task[None] | None = None

    # ---- models -----------------------------------------------------------------------------
    def _resolve(self, spec: str) -> Path:
        if spec in ("", "builtin"):
            return ensure_builtin_model(self.state_dir)
        registered = self.store.registered_models().get(spec)
        return Path(registered) if registered else Path(spec).expanduser()

    def _bandwidth(self, path: Path, quantize: str | None) -> tuple[float, float] | None:

        acc = self.cfg.accelerator
        kind = "cuda" if acc == "cuda" or (acc == "auto" and torch.cuda.is_available()) else acc
        experts = quantize or stored_expert_format(path)
        prof = self.store.bandwidth(profile_format(experts, model_config(path).torch_dtype), kind)
        return None if prof is None else (prof.b_p, prof.b_h)

    def _quantize(self, path: Path) -> str | None:
        """``quantize_experts`` applies to float checkpoints; quantized ones (also FTW folders
        quantized at conversion) load as stored."""

        q = self.cfg.quantize_experts
        return q if q and stored_expert_format(path) == "bf16" else None

    def _preset(self, path: Path) -> str | None:
        """``quantize`` (a preset) applies to float checkpoints only, like quantize_experts."""
        q = self.cfg.quantize
        return q if q and stored_expert_format(path) == "bf16" else None

    def _load_llm(self, path: Path, name: str, backend: str) -> LLM:
        cfg = self.cfg
        set_decode_kernel(cfg.attention_kernel)  # process-wide, the same for every model
        quantize = self._quantize(path)
        preset = self._preset(path)
        if preset is not None:
            mc = model_config(path)  # the bandwidth profile's expert format
            quantize = expert_format(preset, mc.hidden_size, mc.moe_intermediate_size)
        bandwidth = self._bandwidth(path, quantize)
        resolved = resolve_backend(backend, cfg.accelerator, bandwidth)
        cache_mb = expert_cache_mb(
            path, self.manager.host_budget, cfg.disk_tier, cfg.expert_cache_gb, resolved,
            measured=cfg.host_pool_budget_gb == 0,
        )  # fmt: skip
        if cache_mb is not None and (quantize or preset):
            log.warning("%s: the disk tier reads experts as stored: no quantize at load", path)
            quantize = preset = None
        config = EngineConfig.from_daemon(
            cfg,
            name=name,
            state_dir=self.state_dir,
            bandwidth=bandwidth,
            quantize=preset,
            quantize_experts=None if preset else quantize,
            expert_cache_mb=cache_mb,
        )
        return LLM(path, moe_backend=backend, config=config)

    def _registered_names(self) -> list[str]:
        try:
            return list(self.store.registered_models())
        except Exception:  # a store problem must not turn a request into a 500
            log.warning("cannot read the model registry", exc_info=True)
            return []

    def _service(self, model: ResidentModel) -> ModelService:
        assert self.hub is not None and self.bridge is not None
        # the service's bridge: submit() routed to the model's lane, the rest the shared bridge's
        bridge = LaneBridge(self.bridge, self.hub, model.lane)
        service = ModelService(model.llm, bridge, self.metrics, self.names)
        service.script = self.script
        return service

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> ServerState:
        cfg = self.cfg
        first = self.manager.load(cfg.model or "builtin", cfg.served_model_name)
        self.hub = EngineHub(first.lane, on_swap=self.manager.on_swap)
        self.manager.hub = self.hub
        self.bridge = EngineBridge(self.hub, cfg.max_batch, cfg.max_queue, self.metrics)
        self.manager.service_factory = self._service
        first.service = self._service(first)
        self.state = ServerState(
            service=ServiceRouter(
                self.manager, names=self.names, registered=self._registered_names
            ),
            bridge=self.bridge,
            metrics=self.metrics,
        )
        self.state.extra["on_listening"] = self.on_listening
        self.state.extra["on_draining"] = self.on_draining
        self.state.extra["control"] = self
        self._start_admin()
        self._start_watcher()
        return self.state

    def _start_admin(self) -> None:

        path = daemon_socket(self.cfg.admin_socket)
        if path is None:
            log.info("admin socket: off")
            return
        server = AdminServer(AdminOps(self), path)
        try:
            server.start()
        except SocketBusy as e:
            if self.cfg.admin_socket is not None:  # configured explicitly: a real conflict
                raise
            log.warning("admin socket: %s; this daemon runs without an admin API", e)
            return
        self.admin, self.admin_path = server, path

    def _start_watcher(self) -> None:
        if not self.cfg.vram_watch:
            return
        read, self.vram_status = nvml_reader(_cuda_uuid())
        if read is None:
            log.info("VRAM watcher %s", self.vram_status)
            return
        mb = 2**20
        self.watcher = VramWatcher(
            read,
            self.slot_sizes,
            lambda n: self.cache.resize(n, None, source="vram").wait(),
            self.cfg.vram_low_mb * mb,
            self.cfg.vram_high_mb * mb,
            self.cfg.vram_poll_s,
        )
        self.watcher.start()

    def slot_sizes(self) -> SlotSizes | None:
        """The active model's slot cache for the VRAM watcher (None: no slots)."""

        model = self.manager.active
        be = slot_backend(model.llm.moe)
        if be is None:
            return None
        slot = be.slot_bytes  # device format: bf16 slots of an mxfp4 pool are 3.5x its bytes
        target = self.cache.target(model)
        return SlotSizes(be.cache.num_slots, target, slot, min(target, be.num_experts))

    def on_listening(self, host: str, port: int) -> None:
        """Called on the event loop once the API listens: readiness, then watchdog pings."""
        self.http_url = f"http://{host}:{port}"
        sdnotify.notify("READY=1", f"STATUS=serving {self.manager.active.name} on {self.http_url}")
        self._start_watchdog()

    def _start_watchdog(self) -> None:

        timeout = watchdog_seconds()
        if timeout is None or self.bridge is None or self.watchdog is not None:
            return
        bridge = self.bridge
        self.watchdog = Watchdog.for_timeout(timeout, lambda: bridge.beat, 3 * IDLE_WAIT_S)
        self._watchdog_task = asyncio.get_running_loop().create_task(self.watchdog.run())
        log.info("systemd watchdog: a ping every %.1f s while the engine is alive", timeout / 4)

    def on_draining(self) -> None:
        sdnotify.notify("STOPPING=1", "STATUS=draining")

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        if self.admin is not None:
            self.admin.stop()
        self.close_models()

    def close_models(self) -> None:
        """Spills each resident model's session snapshots to the state folder (between steps:
        a step still running after the drain timeout finishes first)."""
        for model in list(self.manager.models.values()):
            try:
                if self.hub is not None:
                    report = self.hub.exclusive(model.llm.close)
                else:
                    report = model.llm.close()
            except Exception:  # shutting down: report and go on with the other models
                log.exception("closing %s failed", model.name)
                continue
            if report is not None and report.files:
                log.info(
                    "%s: %d session snapshot(s) written (%d MiB, %.2f s)",
                    model.name,
                    report.files,
                    report.bytes >> 20,
                    report.seconds,
                )


def _cuda_uuid() -> str | None:
    """The NVML UUID of the CUDA device torch uses, so NVML watches the same GPU."""
    try:
        if not torch.cuda.is_available():
            return None
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    except Exception:
        return None
