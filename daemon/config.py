"""The daemon's settings: defaults < TOML file < environment < command line.

Keys are the long flag names with ``_`` (``--max-queue`` -> ``max_queue``; a TOML file may
also spell them with ``-``). Environment variables are ``FREETOKEN_`` + the key in capitals
(``FREETOKEN_PORT``, ``FREETOKEN_STATE_DIR``). An unknown key in the file is an error naming it.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec

MOE_BACKENDS = ("cpu", "fused", "offload", "hybrid", "auto")  # experts/backend.create_backend
# the backends the disk tier runs under (experts/disk_tier.py, device_tier.py): fused keeps every
# expert in device memory
DISK_TIER_BACKENDS = ("cpu", "offload", "hybrid")
DISK_TIER = ("auto", "on", "off")  # manager/models.expert_cache_mb
ACCELERATORS = ("auto", "cuda", "standin", "fake-cuda")
ATTENTION_KERNELS = ("torch", "triton")  # models/layers/attention.DECODE_KERNELS (tested)
# experts/formats.FORMATS less bf16 and the mixed block formats (tested)
QUANTIZE_FORMATS = ("fp8_block", "mxfp4", "nvfp4", "q8_0", "q6_k", "q5_k", "q4_k", "q5_0", "q4_0")
QUANTIZE_PRESETS = ("q4_k_m", "q8_0", "mxfp4")  # models/dense_quant.PRESETS (tested)
ENV_PREFIX = "FREETOKEN_"
SNAPSHOT_POLICY = re.compile(r"anchors|anchors:all|interval:[1-9][0-9]*|none")


class ConfigError(ValueError):
    """A setting we cannot use; the message names the key and where it came from."""


def about(
    help: str,
    *,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    flag: str | None = None,
) -> msgspec.Meta:
    """A setting's help text, beside its field: the ``--help`` line of its flag (which adds the
    default where the field has a plain one) and the description in its JSON schema.
    ``metavar`` names the value in ``--help``; ``choices`` are the values the flag takes;
    ``flag`` is the flag's name where it is not the key's (``--model-alias``)."""
    extra = {"metavar": metavar, "choices": choices, "flag": flag}
    return msgspec.Meta(description=help, extra={k: v for k, v in extra.items() if v})


# The first key of each group of settings after the first group, with the group's title.
SECTIONS: dict[str, str] = {
    "api_key": "HTTP access",
    "accelerator": "control plane (devices, models, caches; ftctl changes models and cache sizes "
    "at run time)",
    "prefix_cache": "agent state reuse",
}


class DaemonConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every knob, each with its help text (its ``freetokend`` flag, made by ``settings()``);
    config/freetokend.toml documents each one with its default."""

    model: Annotated[
        str | None,
        about(
            "HF or FTW model folder, or a .gguf file (default: the built-in tiny model, "
            "generated on first use)",
            metavar="PATH",
        ),
    ] = None
    served_model_name: Annotated[
        str | None, about("model id clients send (default: the folder name)", metavar="NAME")
    ] = None
    host: Annotated[str, about("address to listen on")] = "127.0.0.1"
    port: Annotated[int, about("TCP port; 0 picks a free one")] = 1919
    state_dir: Annotated[
        str | None,
        about(
            "state folder: built-in model, databases (default: $STATE_DIRECTORY under "
            "systemd, else $XDG_STATE_HOME/freetoken, else ~/.local/state/freetoken)",
            metavar="DIR",
        ),
    ] = None
    admin_socket: Annotated[
        str | None,
        about(
            "admin gRPC unix socket for ftctl (default: $RUNTIME_DIRECTORY/admin.sock under "
            "systemd, else a per-user runtime path; off = none)",
            metavar="PATH",
        ),
    ] = None
    moe_backend: Annotated[
        str,
        about(
            "where experts run; auto: cpu without a GPU, else offload, or hybrid where the "
            "stored bandwidth profile says the CPU pays",
            choices=MOE_BACKENDS,
        ),
    ] = "auto"
    quantize_experts: Annotated[
        str | None,
        about(
            "quantize float checkpoints' routed experts at load (mxfp4: 4.25 bits a weight, "
            "about 1/4 of the RAM and of the bytes read per token; checkpoints already "
            "quantized load as stored); default: as stored",
            choices=QUANTIZE_FORMATS,
        ),
    ] = None
    quantize: Annotated[
        str | None,
        about(
            "quantize float checkpoints' dense layers (GGUF block formats, native integer dot "
            "products on the CPU) and experts at load, by a named mix per tensor class "
            "(models/dense_quant.py); --quantize-experts is the experts-only form (the two "
            "exclude each other)",
            choices=QUANTIZE_PRESETS,
        ),
    ] = None
    max_batch: Annotated[
        int, about("requests decoded together, the continuous batch", metavar="N")
    ] = 32
    max_queue: Annotated[
        int, about("requests waiting beyond the batch before 429/529", metavar="N")
    ] = 64
    mixed_step_budget: Annotated[
        float | None,
        about(
            "while streams decode, a long prompt's prefill chunk beside them is sized so the "
            "step takes at most about this many times a decode-only step (measured as it "
            "runs), bounding their inter-token latency; a prompt alone keeps full chunks. "
            "0 = chunks of a fixed 512 tokens (the prompt prefills faster, the streams stall "
            "meanwhile, for minutes on a long prompt). Default: 3 on the cpu backend, 0 on "
            "the device backends (pacing not measured on a GPU yet)",
            metavar="X",
        ),
    ] = None
    # the cap: engine/build.context_limit
    max_model_len: Annotated[
        int | None,
        about(
            "context limit in tokens, never above the model's own (default: the model's, "
            "at most the KV pool's size in tokens)",
            metavar="N",
        ),
    ] = None
    drain_timeout: Annotated[
        float, about("seconds SIGTERM waits for requests in flight", metavar="S")
    ] = 30.0
    # ---- HTTP access (server/access.py) ----
    # a config file or the environment may also give one key or a comma-separated string
    api_key: Annotated[
        str | list[str] | None,
        about(
            "require this API key (Authorization: Bearer KEY or x-api-key: KEY); repeat for "
            "several keys. Prefer FREETOKEN_API_KEY or the config file: a flag shows in ps "
            "(default: no key)",
            metavar="KEY",
        ),
    ] = None
    allowed_hosts: Annotated[
        list[str],
        about(
            "a Host name accepted besides the loopback ones (the rest are refused: DNS "
            "rebinding); * = any; repeat for several (default: loopback names only)",
            metavar="NAME",
        ),
    ] = []
    allowed_origins: Annotated[
        list[str],
        about(
            "a browser Origin accepted besides loopback ones; * = any; repeat for several "
            "(default: loopback origins only)",
            metavar="ORIGIN",
        ),
    ] = []
    # ---- control plane (models, elastic caches, VRAM watcher) ----
    accelerator: Annotated[
        str,
        about(
            "expert device; fake-cuda: the CUDA code path on a simulated card of --vram-mib "
            "without data (placement, device bytes and host syncs; tokens are meaningless); "
            "standin: a CPU stand-in, for tests",
            choices=ACCELERATORS,
        ),
    ] = "auto"
    vram_mib: Annotated[
        int | None,
        about(
            "the fake-cuda card's memory in MiB, required with it and refused otherwise",
            metavar="N",
        ),
    ] = None
    # process-wide (models/layers/attention.py); triton runs kernels/paged_attention.py and the
    # Gated DeltaNet decode step and chunked prefill of kernels/deltanet.py
    attention_kernel: Annotated[
        str,
        about(
            "decode attention with the KV pool on a GPU: torch (pages gathered, torch ops) or "
            "triton (the paged decode and Gated DeltaNet kernels); torch until a GPU run of "
            "tests/gpu/check.sh verifies the kernels",
            choices=ATTENTION_KERNELS,
        ),
    ] = "torch"
    cuda_graphs: Annotated[
        bool,
        about(
            "capture decode steps as CUDA graphs at load, one per batch-size bucket (1, 2, 4, "
            "8) and page-table width (engine/graphs.py): a real GPU with the fused or offload "
            "backend only; elsewhere (hybrid, a model without a static decode form, a failed "
            "capture) decode runs without graphs and one log line says why"
        ),
    ] = False
    cpu_bf16_dot: Annotated[
        bool,
        about(
            "bf16 weights on the CPU on vdpbf16ps where it has AVX512-BF16 (activations rounded "
            "to bf16, as llama.cpp's BF16 path); elsewhere logged and off. Off: fp32 kernels"
        ),
    ] = True
    cpu_bf16_attention: Annotated[
        bool,
        about(
            "with cpu_bf16_dot on such a CPU, the attention over a bf16 KV pool on vdpbf16ps "
            "too (queries and softmax weights rounded to bf16: the prefill about 1.8x the fp32 "
            "kernel at 8k keys, long prompts' first token sooner; decode rows on the same "
            "kernel, so results do not depend on how a prompt is chunked); off: fp32 kernels"
        ),
    ] = True
    huge_pages: Annotated[
        bool,
        about(
            "with the cpu backend, collapse the weights into 2 MiB transparent huge pages on a "
            "thread of its own once they are filled (models/hugepages.py): fewer TLB misses per "
            "token, about 0.5-1.5 s of CPU a GB beside the start-up, none on the path to ready"
        ),
    ] = True
    moe_slots: Annotated[
        int | None,
        about("expert slots on the accelerator (default: what fits its free memory)", metavar="N"),
    ] = None
    kv_tokens: Annotated[
        int | None,
        about(
            "KV pool size in tokens (default: 131072 with the cpu backend; on an accelerator, "
            "a quarter of the memory its dense weights leave)",
            metavar="N",
        ),
    ] = None
    auto_switch: Annotated[
        bool, about("a request naming a resident, inactive model switches to it")
    ] = False
    strict_model_names: Annotated[
        bool,
        about(
            "a request naming no loaded or registered model is a 404; false: the active model "
            "answers and the response names it"
        ),
    ] = False
    model_aliases: Annotated[
        dict[str, str],
        about(
            "requests naming NAME go to MODEL (repeatable; TOML: [model_aliases] table)",
            metavar="NAME=MODEL",
            flag="model-alias",
        ),
    ] = msgspec.field(default_factory=dict)
    host_pool_budget_gb: Annotated[
        float,
        about(
            "host RAM for resident models' weights; 0 = 3/4 of RAM, within the memory cgroup's "
            "limit less the runtime's reserve and the snapshots' budget",
            metavar="GB",
        ),
    ] = 0.0
    disk_tier: Annotated[
        str,
        about(
            "routed experts left in the model file and read on demand into a RAM cache (cpu, "
            "offload or hybrid backend, GGUF experts in a block format): auto when the file "
            "exceeds host_pool_budget_gb, on always, off never",
            choices=DISK_TIER,
        ),
    ] = "auto"
    expert_cache_gb: Annotated[
        float,
        about(
            "RAM for the disk tier's expert cache; 0 = what host_pool_budget_gb leaves after "
            "the model's other weights",
            metavar="GB",
        ),
    ] = 0.0
    expert_read_ahead: Annotated[
        bool,
        about(
            "with the disk tier, each MoE layer starts reading the next layer's likely experts "
            "(its router on this layer's input) while it computes; it pauses itself while "
            "fewer than half its guesses are used (cpu backend; offload and hybrid read on "
            "demand)"
        ),
    ] = True
    vram_watch: Annotated[
        bool, about("shrink the expert cache under VRAM pressure (NVML), grow it back")
    ] = True
    vram_low_mb: Annotated[
        int, about("free VRAM below this: shrink the expert cache at a safe point", metavar="MB")
    ] = 1024
    vram_high_mb: Annotated[
        int,
        about(
            "free VRAM above this: grow the expert cache back towards its target size",
            metavar="MB",
        ),
    ] = 3072
    vram_poll_s: Annotated[float, about("seconds between NVML readings", metavar="S")] = 2.0
    # ---- agent state reuse (ARCHITECTURE §5) ----
    prefix_cache: Annotated[
        bool, about("reuse KV and recurrent-state snapshots across requests")
    ] = True
    snapshot_policy: Annotated[
        str,
        about(
            "where hybrid models save recurrent state: anchors (agent turn and tool "
            "boundaries), anchors:all, interval:N, none",
            metavar="P",
        ),
    ] = "anchors"
    snapshot_budget_mb: Annotated[
        float, about("RAM for recurrent-state snapshots, their own LRU", metavar="MB")
    ] = 256.0
    spill_budget_mb: Annotated[
        float,
        about(
            "disk for session snapshots (with their prefix KV) in the state folder, so a "
            "restart resumes agent sessions without re-prefilling them; 0 = none",
            metavar="MB",
        ),
    ] = 2048.0
    spill_idle_s: Annotated[
        float, about("write new session snapshots after this many idle seconds", metavar="S")
    ] = 2.0

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
        budget = self.mixed_step_budget
        if budget is not None and budget != 0 and not budget >= 1:
            raise ConfigError(
                f"mixed_step_budget: must be 0 (off) or at least 1, got {self.mixed_step_budget}"
            )
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


@dataclass(frozen=True)
class Setting:
    """One DaemonConfig field as a command line shows it."""

    key: str
    kind: str  # str | int | float | bool | list (a repeatable flag) | dict (NAME=VALUE pairs)
    default: Any  # the field's default (None: unset, computed at run time)
    help: str
    metavar: str | None
    choices: tuple[str, ...] | None
    flag: str  # --key with - for _, unless about(flag=...) names another
    section: str | None  # the title of its group (SECTIONS); None: the first group

    @property
    def default_text(self) -> str | None:
        """The default as --help writes it; None where there is no plain one to write (unset,
        empty: the help text says what happens then)."""
        value = self.default
        if value is None or value == [] or value == {}:
            return None
        if isinstance(value, bool):
            return "true" if value else "false"
        return f"{value:g}" if isinstance(value, float) else str(value)


_KINDS = {
    msgspec.inspect.StrType: "str",
    msgspec.inspect.IntType: "int",
    msgspec.inspect.FloatType: "float",
    msgspec.inspect.BoolType: "bool",
    msgspec.inspect.ListType: "list",
    msgspec.inspect.DictType: "dict",
}


def _kind(t: msgspec.inspect.Type) -> str:
    """The field's value kind; ``str | list[str]`` (api_key) is a list on a command line."""
    types = t.types if isinstance(t, msgspec.inspect.UnionType) else (t,)
    kinds = [_KINDS[type(x)] for x in types if not isinstance(x, msgspec.inspect.NoneType)]
    return "list" if "list" in kinds else kinds[0]


def settings() -> tuple[Setting, ...]:
    """Every DaemonConfig field in declaration order, with its help text and flag."""
    info = msgspec.inspect.type_info(DaemonConfig)
    assert isinstance(info, msgspec.inspect.StructType)
    out: list[Setting] = []
    section: str | None = None
    for field in info.fields:
        meta = field.type
        assert isinstance(meta, msgspec.inspect.Metadata), f"{field.name}: no about(...)"
        extra = meta.extra or {}
        section = SECTIONS.get(field.name, section)
        default = field.default
        if default is msgspec.NODEFAULT:
            default = field.default_factory()
        out.append(
            Setting(
                key=field.name,
                kind=_kind(meta.type),
                default=default,
                help=(meta.extra_json_schema or {})["description"],
                metavar=extra.get("metavar"),
                choices=extra.get("choices"),
                flag="--" + extra.get("flag", field.name.replace("_", "-")),
                section=section,
            )
        )
    return tuple(out)


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
    if cfg.disk_tier not in DISK_TIER:
        raise ConfigError(f"disk_tier: {cfg.disk_tier!r} is not one of {', '.join(DISK_TIER)}")
    if cfg.expert_cache_gb < 0:
        raise ConfigError(f"expert_cache_gb: must be >= 0, got {cfg.expert_cache_gb}")
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
