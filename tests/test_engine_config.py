"""EngineConfig (engine/engine_config.py): built from LLM's keyword arguments with LLM's defaults
and errors, and from the daemon's settings with every engine setting of DaemonConfig mapped."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from freetokend.config import DaemonConfig
from freetokend.engine.engine_config import EngineConfig

# DaemonConfig fields that reach the engine under the same name
FROM_DAEMON = {
    "max_batch": 7,
    "mixed_step_budget": 3.0,
    "max_model_len": 4096,
    "kv_tokens": 1234,
    "moe_slots": 40,
    "accelerator": "fake-cuda",
    "vram_mib": 8192,
    "prefix_cache": False,
    "snapshot_policy": "interval:64",
    "snapshot_budget_mb": 12.5,
    "spill_budget_mb": 99.0,
    "spill_idle_s": 7.5,
    "cuda_graphs": True,
    "cpu_bf16_dot": False,
    "cpu_bf16_attention": True,
    "huge_pages": False,
    "expert_read_ahead": False,
}
# per model: given to from_daemon by the model manager (quantize*: only for float checkpoints)
PER_MODEL = {
    "name": "served",
    "state_dir": Path("/tmp/state"),
    "bandwidth": (1e10, 2e10),
    "quantize": "q8_0",
    "quantize_experts": "mxfp4",
    "expert_cache_mb": 512.0,
}
# engine settings the daemon does not set (LLM's defaults)
ENGINE_ONLY = {"page_size", "max_step_tokens", "threads", "record_routing", "dtype"}


def test_every_field_is_accounted_for() -> None:
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert fields == set(FROM_DAEMON) | set(PER_MODEL) | ENGINE_ONLY
    daemon = set(DaemonConfig.__struct_fields__)
    assert set(FROM_DAEMON) <= daemon


def test_from_daemon_maps_every_engine_field() -> None:
    cfg = DaemonConfig(**FROM_DAEMON)  # type: ignore[arg-type]
    ec = EngineConfig.from_daemon(cfg, **PER_MODEL)  # type: ignore[arg-type]
    for key, value in {**FROM_DAEMON, **PER_MODEL}.items():
        assert getattr(ec, key) == value, key
    defaults = EngineConfig()
    for key in ENGINE_ONLY:
        assert getattr(ec, key) == getattr(defaults, key), key


def test_from_daemon_spills_only_with_a_spill_budget() -> None:
    cfg = DaemonConfig(spill_budget_mb=0)
    ec = EngineConfig.from_daemon(cfg, name=None, state_dir="/tmp/state")
    assert ec.state_dir is None and ec.quantize is None and ec.bandwidth is None


def test_defaults_are_llms_and_daemons() -> None:
    """Unset, the daemon builds the engine LLM builds with no arguments (but spilling), except
    that the daemon leaves the pacing of prompt chunks beside decoding streams to the backend
    (build.step_budget: by time on the cpu backend, its streams' inter-token latency bounded)
    where the offline LLM keeps fixed chunks (plans that do not depend on timing, an offline
    batch's prefill at full speed)."""
    ec = EngineConfig.from_daemon(DaemonConfig(), name=None, state_dir=None)
    assert ec == dataclasses.replace(EngineConfig(), mixed_step_budget=None)
    assert EngineConfig().mixed_step_budget == 0
    ec = EngineConfig.from_daemon(DaemonConfig(mixed_step_budget=0), name=None, state_dir=None)
    assert ec == EngineConfig()
    ec = EngineConfig.from_daemon(DaemonConfig(mixed_step_budget=2), name=None, state_dir=None)
    assert ec.mixed_step_budget == 2


def test_the_daemons_pacing_by_backend() -> None:
    from freetokend.engine.build import CPU_STEP_BUDGET, step_budget

    assert CPU_STEP_BUDGET == 3
    assert step_budget(None, "cpu") == CPU_STEP_BUDGET
    for device in ("offload", "hybrid", "fused"):
        assert step_budget(None, device) == 0
        assert step_budget(2.0, device) == 2.0
    assert step_budget(0.0, "cpu") == 0
    assert step_budget(1.5, "cpu") == 1.5


def test_from_kwargs() -> None:
    assert EngineConfig.from_kwargs({"moe_slots": 40}) == EngineConfig(moe_slots=40)
    with pytest.raises(TypeError, match="unexpected keyword argument 'moe_slot'"):
        EngineConfig.from_kwargs({"moe_slot": 40})
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().moe_slots = 3  # type: ignore[misc]


def test_llm_refuses_before_loading() -> None:
    from freetokend.engine.llm import LLM

    with pytest.raises(TypeError, match="unexpected keyword argument 'moe_slot'"):
        LLM("nowhere", "offload", moe_slot=40)
    with pytest.raises(TypeError, match="not both"):
        LLM("nowhere", "offload", config=EngineConfig(), moe_slots=40)
    with pytest.raises(ValueError, match="unknown moe_backend"):
        LLM("nowhere", "gpu", config=EngineConfig())


def test_an_unset_budget_paces_the_cpu_backend(builtin_model_dir: Path) -> None:
    """The daemon's unset ``mixed_step_budget`` reaches the engine's pacer, resolved by the
    backend the model was built for."""
    from freetokend import LLM

    llm = LLM(builtin_model_dir, max_model_len=64, kv_tokens=256, mixed_step_budget=None)
    assert llm.engine.scheduler.pacer is not None
    assert llm.engine.scheduler.pacer.budget == 3
    fixed = LLM(builtin_model_dir, max_model_len=64, kv_tokens=256)
    assert fixed.engine.scheduler.pacer is None
