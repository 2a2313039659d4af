"""The daemon's settings: defaults < TOML file < environment < command line.

Keys are the long flag names with ``_`` (``--max-queue`` -> ``max_queue``; a TOML file may
also spell them with ``-``). Environment variables are ``FREETOKEN_`` + the key in capitals
(``FREETOKEN_PORT``, ``FREETOKEN_STATE_DIR``). An unknown key in the file is an error naming it.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec

MOE_BACKENDS = ("cpu", "fused", "offload", "hybrid", "auto")  # experts/backend.create_backend
ACCELERATORS = ("auto", "cuda", "standin", "fake-cuda")
ATTENTION_KERNELS = ("torch", "triton")  # models/layers/attention.DECODE_KERNELS (tested)
# experts/formats.FORMATS less bf16 and the mixed block formats (tested)
QUANTIZE_FORMATS = ("fp8_block", "mxfp4", "nvfp4", "q8_0", "q6_k", "q5_k", "q4_k", "q5_0", "q4_0")
QUANTIZE_PRESETS = ("q4_k_m", "q8_0", "mxfp4")  # models/dense_quant.PRESETS (tested)
ENV_PREFIX = "FREETOKEN_"
SNAPSHOT_POLICY = re.compile(r"anchors|anchors:all|interval:[1-9][0-9]*|none")


class ConfigError(ValueError):
    """A setting we cannot use; the message names the key and where it came from."""


class DaemonConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every knob; config/freetokend.toml documents each one with its default."""

    model: str | None = None  # model folder; None = the built-in tiny model
    served_model_name: str | None = None  # the id clients send; default: the folder name
    host: str = "127.0.0.1"
    port: int = 1919
    state_dir: str | None = None  # default: $STATE_DIRECTORY (systemd), else XDG state home
    # admin gRPC socket; default: $RUNTIME_DIRECTORY/admin.sock (systemd), else a per-user
    # runtime path; "off" = no admin socket
    admin_socket: str | None = None
    moe_backend: str = "auto"
    # quantize float checkpoints' experts at load: mxfp4 | nvfp4 | fp8_block (quantized
    # checkpoints load as stored); None = every checkpoint as stored
    quantize_experts: str | None = None
    # quantize float checkpoints' dense layers and experts at load by a preset: q4_k_m | q8_0 |
    # mxfp4 (the mix per tensor class: models/dense_quant.py); excludes quantize_experts
    quantize: str | None = None
    max_batch: int = 32  # requests decoded together (the continuous batch)
    max_queue: int = 64  # requests waiting beyond the batch before 429/529
    max_model_len: int | None = None  # context limit; default: the model's (capped)
    drain_timeout: float = 30.0  # seconds SIGTERM waits for in-flight requests
    # ---- HTTP access (server/access.py) ----
    # API keys clients must send (Authorization: Bearer KEY or x-api-key: KEY): one key, a
    # comma-separated string of keys, or a list; None = no key needed
    api_key: str | list[str] | None = None
    allowed_hosts: list[str] = []  # Host names accepted besides loopback ones; "*" = any
    allowed_origins: list[str] = []  # browser Origins accepted besides loopback; "*" = any
    # ---- control plane (models, elastic caches, VRAM watcher) ----
    # auto | cuda | standin (CPU stand-in, for tests) | fake-cuda (the CUDA code path on a
    # simulated card, no data: placement, device bytes and host syncs; tokens are meaningless)
    accelerator: str = "auto"
    vram_mib: int | None = None  # the simulated card of accelerator fake-cuda, MiB (required)
    # decode attention with the KV pool on a GPU: torch (pages gathered, torch ops) | triton
    # (the paged decode kernel, kernels/paged_attention.py, and the Gated DeltaNet decode step
    # and chunked prefill, kernels/deltanet.py); torch until a GPU run of tests/gpu/check.sh
    # verifies the kernels (process-wide: models/layers/attention.py)
    attention_kernel: str = "torch"
    # decode steps as CUDA graphs, one per batch-size bucket (1, 2, 4, 8) and page-table width,
    # captured at load (engine/graphs.py): a real GPU with the fused or offload backend only;
    # elsewhere (hybrid, a model without a static decode form, a failed capture) decode runs
    # without graphs and one log line says why
    cuda_graphs: bool = False
    # bf16 weights on the CPU on vdpbf16ps where it has AVX512-BF16 (activations rounded to
    # bf16, as llama.cpp's BF16 path); elsewhere logged and off. Off: fp32-activation kernels
    cpu_bf16_dot: bool = True
    # with the cpu backend, weights collapsed into 2 MiB transparent huge pages after load
    # (models/hugepages.py: fewer TLB misses per token; about 0.5 s a GB of load time)
    huge_pages: bool = True
    moe_slots: int | None = None  # accelerator expert slots; default: what fits free VRAM
    kv_tokens: int | None = None  # KV pool size in tokens; default: the engine's (131072)
    auto_switch: bool = False  # a request naming a resident, inactive model switches to it
    # a request naming no resident or registered model is answered by the active model
    # (the response names it); true = such a request is a 404
    strict_model_names: bool = False
    model_aliases: dict[str, str] = msgspec.field(default_factory=dict)  # name -> model name
    host_pool_budget_gb: float = 0.0  # host RAM for resident models' weights; 0 = 3/4 of RAM
    vram_watch: bool = True  # shrink the expert cache under VRAM pressure (NVML), grow it back
    vram_low_mb: int = 1024  # free VRAM below this: shrink the expert cache at a safe point
    vram_high_mb: int = 3072  # free VRAM above this: grow it back towards its target size
    vram_poll_s: float = 2.0  # seconds between NVML readings
    # ---- agent state reuse (ARCHITECTURE §5) ----
    prefix_cache: bool = True  # reuse KV and recurrent-state snapshots across requests
    snapshot_policy: str = "anchors"  # anchors | anchors:all | interval:N | none
    snapshot_budget_mb: float = 256.0  # RAM for recurrent-state snapshots (own LRU)
    # disk for session snapshots (with their prefix KV) in the state folder, so a restarted
    # daemon resumes agent sessions; 0 = keep none on disk
    spill_budget_mb: float = 2048.0
    spill_idle_s: float = 2.0  # write new session snapshots after this many idle seconds

    def check(self) -> DaemonConfig:
        if self.moe_backend not in MOE_BACKENDS:
            raise ConfigError(
                f"moe_backend: {self.moe_backend!r} is not one of {', '.join(MOE_BACKENDS)}"
            )
        if self.quantize_experts is not None and self.quantize_experts not in QUANTIZE_FORMATS:
            raise ConfigError(
                f"quantize_experts: {self.quantize_experts!r} is not one of "
                f"{', '.join(QUANTIZE_FORMATS)}"
            )
        if self.quantize is not None and self.quantize not in QUANTIZE_PRESETS:
            raise ConfigError(
                f"quantize: {self.quantize!r} is not one of {', '.join(QUANTIZE_PRESETS)}"
            )
        if self.quantize is not None and self.quantize_experts is not None:
            raise ConfigError("quantize (a preset) and quantize_experts exclude each other")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: {self.port} is not a TCP port")
        for name in ("max_batch",):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ConfigError(f"max_queue: must be >= 0, got {self.max_queue}")
        if self.drain_timeout < 0:
            raise ConfigError(f"drain_timeout: must be >= 0, got {self.drain_timeout}")
        if any(not k or not v for k, v in self.model_aliases.items()):
            raise ConfigError("model_aliases: names and models must be non-empty strings")
        check_control(self)
        check_access(self)
        return self

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The configured keys (a string may hold several, comma-separated)."""
        raw = self.api_key
        items = raw.split(",") if isinstance(raw, str) else (raw or [])
        return tuple(k.strip() for k in items)


FIELDS: tuple[str, ...] = DaemonConfig.__struct_fields__


def check_control(cfg: DaemonConfig) -> None:
    """Range checks of the control-plane knobs (ConfigError names the key)."""
    if cfg.accelerator not in ACCELERATORS:
        raise ConfigError(
            f"accelerator: {cfg.accelerator!r} is not one of {', '.join(ACCELERATORS)}"
        )
    if cfg.attention_kernel not in ATTENTION_KERNELS:
        raise ConfigError(
            f"attention_kernel: {cfg.attention_kernel!r} is not one of "
            f"{', '.join(ATTENTION_KERNELS)}"
        )
    if (cfg.accelerator == "fake-cuda") != (cfg.vram_mib is not None):
        raise ConfigError("vram_mib: the simulated card, set with accelerator fake-cuda only")
    for name in ("moe_slots", "kv_tokens", "vram_mib"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name}: must be at least 1, got {value}")
    if cfg.host_pool_budget_gb < 0:
        raise ConfigError(f"host_pool_budget_gb: must be >= 0, got {cfg.host_pool_budget_gb}")
    if not 0 <= cfg.vram_low_mb <= cfg.vram_high_mb:
        raise ConfigError(
            f"vram_low_mb ({cfg.vram_low_mb}) must be >= 0 and <= vram_high_mb ({cfg.vram_high_mb})"
        )
    if cfg.vram_poll_s <= 0:
        raise ConfigError(f"vram_poll_s: must be > 0, got {cfg.vram_poll_s}")
    if not SNAPSHOT_POLICY.fullmatch(cfg.snapshot_policy):
        raise ConfigError(
            f"snapshot_policy: {cfg.snapshot_policy!r} is not one of anchors, anchors:all, "
            "interval:N (N >= 1), none"
        )
    for name in ("snapshot_budget_mb", "spill_budget_mb", "spill_idle_s"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name}: must be >= 0, got {getattr(cfg, name)}")


def check_access(cfg: DaemonConfig) -> None:
    """API keys are printable ASCII without spaces (they travel in HTTP headers); the error
    never repeats a key."""
    for i, key in enumerate(cfg.api_keys):
        if not key:
            raise ConfigError(f"api_key: key {i + 1} is empty")
        if not all("!" <= c <= "~" for c in key):
            raise ConfigError(
                f"api_key: key {i + 1} has a space or a character outside printable ASCII"
            )


def default_state_dir(env: dict[str, str]) -> Path:
    if env.get("FREETOKEN_STATE_DIR"):
        return Path(env["FREETOKEN_STATE_DIR"]).expanduser()
    if env.get("STATE_DIRECTORY"):  # systemd's StateDirectory= (first entry)
        return Path(env["STATE_DIRECTORY"].split(":")[0])
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base).expanduser() / "freetoken"


def _convert(values: dict[str, Any], source: str) -> dict[str, Any]:
    """Type-check a partial config; errors name the key and the source."""
    try:
        msgspec.convert(values, DaemonConfig, strict=False)
    except msgspec.ValidationError as e:
        text = str(e).replace("Object contains unknown field", "unknown key")
        raise ConfigError(f"{source}: {text}") from None
    return values


def from_file(path: Path) -> dict[str, Any]:
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    values = {k.replace("-", "_"): v for k, v in raw.items()}
    return _convert(values, str(path))


def from_env(env: dict[str, str]) -> dict[str, Any]:
    values = {
        name: env[ENV_PREFIX + name.upper()]
        for name in FIELDS
        if env.get(ENV_PREFIX + name.upper())
    }
    return _convert(values, "environment")


def resolve(
    cli: dict[str, Any], config_file: str | None, env: dict[str, str] | None = None
) -> DaemonConfig:
    """Merge the layers; ``cli`` holds only the flags given on the command line."""
    env = dict(os.environ if env is None else env)
    merged: dict[str, Any] = {}
    if config_file:
        merged.update(from_file(Path(config_file)))
    merged.update(from_env(env))
    merged.update({k: v for k, v in cli.items() if v is not None})
    try:
        cfg = msgspec.convert(merged, DaemonConfig, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(str(e)) from None
    if cfg.state_dir is None:
        cfg.state_dir = str(default_state_dir(env))
    return cfg.check()
