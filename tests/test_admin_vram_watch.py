"""The VRAM watcher's policy, and the control plane in process: watcher-driven shrink/grow
through the safe-point path, auto-switch routing between two resident models."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from freetokend.config import DaemonConfig
from freetokend.experts.vram_watch import (
    SlotSizes,
    VramReading,
    VramWatcher,
    nvml_reader,
    torch_unallocated,
)
from freetokend.experts.vram_watch import plan_resize as plan
from freetokend.manager.control import ControlPlane
from freetokend.server.errors import NotFound

MB = 2**20


def test_plan_resize() -> None:
    s = SlotSizes(current=100, target=100, slot_bytes=MB, min_slots=8)
    assert plan(500 * MB, s, low=100 * MB, high=300 * MB) is None  # plenty free, at target
    assert plan(90 * MB, s, 100 * MB, 300 * MB) == 90  # 10 MiB short: 10 slots go
    assert plan(0, s, 100 * MB, 300 * MB) == 8  # never below the floor
    small = s._replace(current=20)
    assert plan(200 * MB, small, 100 * MB, 300 * MB) is None  # between the marks: hold
    assert plan(350 * MB, small, 100 * MB, 300 * MB) == 70  # grow by what leaves 300 free
    assert plan(900 * MB, small, 100 * MB, 300 * MB) == 100  # up to the target, not beyond
    assert plan(50 * MB, s._replace(current=8), 100 * MB, 300 * MB) is None


def test_our_allocator_cache_counts_as_free() -> None:
    """NVML counts what torch's caching allocator keeps reserved as used: the activations a
    long prefill freed into the cache must not shrink the slots (then empty_cache, grow, and
    shrink again at the next prefill). The same bytes held by live tensors, and another
    process's, still shrink them."""
    cap, slot = 1024 * MB, 8 * MB
    mem = {"reserved": 512 * MB, "allocated": 512 * MB, "other": 0}  # 64 slots of 8 MiB
    slots = {"now": 64}

    def read() -> VramReading:  # NVML: reserved blocks are used, whatever they hold
        return VramReading(cap - mem["other"] - mem["reserved"], cap)

    def resize(n: int) -> None:
        slots["now"] = n

    watcher = VramWatcher(
        read, lambda: SlotSizes(slots["now"], 64, slot, 8), resize, 128 * MB, 256 * MB,
        unallocated=lambda: mem["reserved"] - mem["allocated"],
    )  # fmt: skip
    assert watcher.check_once() is None  # 512 MiB free, at the target
    mem["reserved"] += 400 * MB  # a long prefill's activations, freed into the cache
    assert read().free < watcher.low and watcher.check_once() is None
    mem["allocated"] += 400 * MB  # the same bytes in live tensors: 16 MiB short of low
    assert watcher.check_once() == 62 and watcher.resizes == 1
    mem["allocated"] = mem["reserved"] = 496 * MB  # 62 slots; the cache handed back
    mem["other"] = 416 * MB  # another process: 16 MiB short again
    assert watcher.check_once() == 60


def test_unallocated_bytes_come_from_torchs_allocator(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Reserved minus allocated of the device current when the watcher was made (its own
    thread's current device may be another); 0 without CUDA."""
    import torch

    asked: list[int] = []

    def stat(value: int) -> Callable[[int], int]:
        def read(device: int) -> int:
            asked.append(device)
            return value

        return read

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert torch_unallocated()() == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "memory_reserved", stat(900 * MB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", stat(500 * MB))
    read = torch_unallocated()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert read() == 400 * MB and asked == [1, 1]
    assert torch_unallocated(2)() == 400 * MB and asked[2:] == [2, 2]


def test_without_nvml_the_watcher_says_why() -> None:
    pytest.importorskip("pynvml")
    read, status = nvml_reader()
    if read is not None:
        pytest.skip("this machine has NVML")
    assert status.startswith("off: NVML unavailable")


@pytest.fixture()
def control(builtin_model_dir: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    cfg = DaemonConfig(
        model=str(builtin_model_dir), moe_backend="offload", accelerator="standin",
        moe_slots=40, kv_tokens=512, admin_socket="off", vram_watch=False,
        state_dir=str(tmp_path), auto_switch=True,
    )  # fmt: skip
    c = ControlPlane(cfg)
    c.start()
    yield c
    c.stop()


def test_watcher_shrinks_and_grows_through_safe_points(control: ControlPlane) -> None:
    """A simulated 256 MiB device: free = capacity - other processes - our slots."""
    sizes = control.slot_sizes()
    assert sizes is not None and (sizes.current, sizes.target) == (40, 40)
    assert sizes.min_slots == 32  # one layer's experts stay
    slot, cap = sizes.slot_bytes, 256 * MB
    other = {"bytes": 0}

    def read() -> VramReading:
        return VramReading(cap - other["bytes"] - control.cache.info().moe_slots * slot, cap)

    watcher = VramWatcher(
        read,
        control.slot_sizes,
        lambda n: control.cache.resize(n, None, source="vram").wait(60),
        low_bytes=64 * MB,
        high_bytes=128 * MB,
    )
    ptrs = control.cache.info().host_pool_ptrs
    assert watcher.check_once() is None  # plenty free, at the target
    other["bytes"] = cap - 64 * MB - 35 * slot  # another process takes VRAM: 5 slots short
    assert watcher.check_once() == 35 and control.cache.info().moe_slots == 35
    assert watcher.check_once() is None  # back at the low mark: stable
    other["bytes"] = cap - 128 * MB - 39 * slot - slot // 2  # it frees some: room for 4
    assert watcher.check_once() == 39
    assert watcher.check_once() is None  # a grow never triggers the next resize
    other["bytes"] = 0
    assert watcher.check_once() == 40  # back to the target, not beyond
    assert control.cache.info().host_pool_ptrs == ptrs and watcher.resizes == 3
    control.cache.resize(36, None).wait(60)  # ftctl sets a new target
    assert control.slot_sizes() == sizes._replace(current=36, target=36)


def test_auto_switch_routes_to_a_resident_model(
    control: ControlPlane, builtin_model_dir: Path, tmp_path: Path
) -> None:
    other = Path(shutil.copytree(builtin_model_dir, tmp_path / "other"))
    control.manager.load(str(other))
    assert control.state is not None
    router = control.state.service
    first = control.manager.active.name
    assert router.name == first

    async def request(name: str) -> str:
        router.check_model(name)
        svc = await router._service()
        return str(svc.name)

    assert asyncio.run(request("other")) == "other"
    assert control.manager.active.name == "other" and router.name == "other"
    assert asyncio.run(request(first)) == first
    # a name no model has is served by the active model, without a switch
    assert asyncio.run(request("claude-sonnet-4-5")) == first
    assert control.manager.active.name == first
    control.names.aliases["o"] = "other"  # an alias switches like the name it stands for
    assert asyncio.run(request("o")) == "other"
    assert asyncio.run(request(first)) == first
    control.names.strict = True
    with pytest.raises(NotFound, match="does not exist"):
        router.check_model("missing")
    control.manager.auto_switch = False
    with pytest.raises(NotFound, match="not active.*ftctl models switch other"):
        router.check_model("other")
    assert control.manager.models["other"].weight_loads == 1
