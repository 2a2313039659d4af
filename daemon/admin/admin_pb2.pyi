from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("version", "pid", "uptime_s", "http_url", "active_model", "moe_backend", "accelerator", "running", "waiting", "in_flight", "draining", "admin_socket", "vram_watch", "resident_models", "auto_switch", "api_key")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    HTTP_URL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_MODEL_FIELD_NUMBER: _ClassVar[int]
    MOE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ADMIN_SOCKET_FIELD_NUMBER: _ClassVar[int]
    VRAM_WATCH_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_MODELS_FIELD_NUMBER: _ClassVar[int]
    AUTO_SWITCH_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    version: str
    pid: int
    uptime_s: float
    http_url: str
    active_model: str
    moe_backend: str
    accelerator: str
    running: int
    waiting: int
    in_flight: int
    draining: bool
    admin_socket: str
    vram_watch: str
    resident_models: int
    auto_switch: bool
    api_key: str
    def __init__(self, version: _Optional[str] = ..., pid: _Optional[int] = ..., uptime_s: _Optional[float] = ..., http_url: _Optional[str] = ..., active_model: _Optional[str] = ..., moe_backend: _Optional[str] = ..., accelerator: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., in_flight: _Optional[int] = ..., draining: _Optional[bool] = ..., admin_socket: _Optional[str] = ..., vram_watch: _Optional[str] = ..., resident_models: _Optional[int] = ..., auto_switch: _Optional[bool] = ..., api_key: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelStats(_message.Message):
    __slots__ = ("name", "active", "tokens_per_second", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "requests_finished", "tokens_generated", "expert_hits", "expert_misses", "expert_fills", "expert_hit_rate", "gpu_routes", "cpu_routes", "cpu_route_share", "kv_pages_used", "kv_pages_cached", "kv_pages_total", "kv_page_size", "running", "waiting", "disk_bytes_read", "disk_read_seconds", "disk_read_ahead", "disk_read_ahead_hits", "disk_read_ahead_wasted")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TTFT_MEAN_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_P90_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    EXPERT_HITS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_MISSES_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FILLS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    GPU_ROUTES_FIELD_NUMBER: _ClassVar[int]
    CPU_ROUTES_FIELD_NUMBER: _ClassVar[int]
    CPU_ROUTE_SHARE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_AHEAD_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_AHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_AHEAD_WASTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    active: bool
    tokens_per_second: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    requests_finished: int
    tokens_generated: int
    expert_hits: int
    expert_misses: int
    expert_fills: int
    expert_hit_rate: float
    gpu_routes: int
    cpu_routes: int
    cpu_route_share: float
    kv_pages_used: int
    kv_pages_cached: int
    kv_pages_total: int
    kv_page_size: int
    running: int
    waiting: int
    disk_bytes_read: int
    disk_read_seconds: float
    disk_read_ahead: int
    disk_read_ahead_hits: int
    disk_read_ahead_wasted: int
    def __init__(self, name: _Optional[str] = ..., active: _Optional[bool] = ..., tokens_per_second: _Optional[float] = ..., ttft_mean_s: _Optional[float] = ..., ttft_p50_s: _Optional[float] = ..., ttft_p90_s: _Optional[float] = ..., requests_finished: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., expert_hits: _Optional[int] = ..., expert_misses: _Optional[int] = ..., expert_fills: _Optional[int] = ..., expert_hit_rate: _Optional[float] = ..., gpu_routes: _Optional[int] = ..., cpu_routes: _Optional[int] = ..., cpu_route_share: _Optional[float] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_cached: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., kv_page_size: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., disk_bytes_read: _Optional[int] = ..., disk_read_seconds: _Optional[float] = ..., disk_read_ahead: _Optional[int] = ..., disk_read_ahead_hits: _Optional[int] = ..., disk_read_ahead_wasted: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelStats]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelStats, _Mapping]]] = ...) -> None: ...

class CacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheInfo(_message.Message):
    __slots__ = ("model", "moe_backend", "moe_slots", "moe_slots_max", "moe_target", "expert_bytes", "resident_experts", "kv_pages", "kv_page_size", "kv_tokens", "kv_pages_used", "kv_pages_cached", "kv_bytes", "note", "host_pool_ptrs")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MOE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MOE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MOE_SLOTS_MAX_FIELD_NUMBER: _ClassVar[int]
    MOE_TARGET_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    HOST_POOL_PTRS_FIELD_NUMBER: _ClassVar[int]
    model: str
    moe_backend: str
    moe_slots: int
    moe_slots_max: int
    moe_target: int
    expert_bytes: int
    resident_experts: int
    kv_pages: int
    kv_page_size: int
    kv_tokens: int
    kv_pages_used: int
    kv_pages_cached: int
    kv_bytes: int
    note: str
    host_pool_ptrs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., moe_backend: _Optional[str] = ..., moe_slots: _Optional[int] = ..., moe_slots_max: _Optional[int] = ..., moe_target: _Optional[int] = ..., expert_bytes: _Optional[int] = ..., resident_experts: _Optional[int] = ..., kv_pages: _Optional[int] = ..., kv_page_size: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_cached: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., note: _Optional[str] = ..., host_pool_ptrs: _Optional[_Iterable[int]] = ...) -> None: ...

class ResizeRequest(_message.Message):
    __slots__ = ("moe_slots", "kv_tokens")
    MOE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    moe_slots: int
    kv_tokens: int
    def __init__(self, moe_slots: _Optional[int] = ..., kv_tokens: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("phase", "message", "done", "cache", "model", "bandwidth")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    phase: str
    message: str
    done: bool
    cache: CacheInfo
    model: ModelInfo
    bandwidth: BandwidthProfile
    def __init__(self, phase: _Optional[str] = ..., message: _Optional[str] = ..., done: _Optional[bool] = ..., cache: _Optional[_Union[CacheInfo, _Mapping]] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., bandwidth: _Optional[_Union[BandwidthProfile, _Mapping]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "path", "state", "moe_backend", "host_bytes", "weight_loads", "max_model_len", "family")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MOE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_LOADS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    state: str
    moe_backend: str
    host_bytes: int
    weight_loads: int
    max_model_len: int
    family: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., state: _Optional[str] = ..., moe_backend: _Optional[str] = ..., host_bytes: _Optional[int] = ..., weight_loads: _Optional[int] = ..., max_model_len: _Optional[int] = ..., family: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelList(_message.Message):
    __slots__ = ("models", "host_budget_bytes", "host_used_bytes", "auto_switch")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    HOST_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    AUTO_SWITCH_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    host_budget_bytes: int
    host_used_bytes: int
    auto_switch: bool
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., host_budget_bytes: _Optional[int] = ..., host_used_bytes: _Optional[int] = ..., auto_switch: _Optional[bool] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("path", "name", "moe_backend", "activate")
    PATH_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MOE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    ACTIVATE_FIELD_NUMBER: _ClassVar[int]
    path: str
    name: str
    moe_backend: str
    activate: bool
    def __init__(self, path: _Optional[str] = ..., name: _Optional[str] = ..., moe_backend: _Optional[str] = ..., activate: _Optional[bool] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class SwitchModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class BenchBandwidthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BandwidthProfile(_message.Message):
    __slots__ = ("b_p", "b_h", "expert_format", "accelerator", "expert_bytes", "b_d", "disk_direct", "disk_path", "disk_note")
    B_P_FIELD_NUMBER: _ClassVar[int]
    B_H_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    B_D_FIELD_NUMBER: _ClassVar[int]
    DISK_DIRECT_FIELD_NUMBER: _ClassVar[int]
    DISK_PATH_FIELD_NUMBER: _ClassVar[int]
    DISK_NOTE_FIELD_NUMBER: _ClassVar[int]
    b_p: float
    b_h: float
    expert_format: str
    accelerator: str
    expert_bytes: int
    b_d: float
    disk_direct: bool
    disk_path: str
    disk_note: str
    def __init__(self, b_p: _Optional[float] = ..., b_h: _Optional[float] = ..., expert_format: _Optional[str] = ..., accelerator: _Optional[str] = ..., expert_bytes: _Optional[int] = ..., b_d: _Optional[float] = ..., disk_direct: _Optional[bool] = ..., disk_path: _Optional[str] = ..., disk_note: _Optional[str] = ...) -> None: ...
