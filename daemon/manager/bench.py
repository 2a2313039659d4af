"""``ftctl bench bw`` in the daemon: measure B_P and B_H on the active model's expert pool with
the real copy path and the real CPU executor, store the profile, and give the running hybrid
backend the new q* ratio.

It runs at a safe point with admission paused and no request running, so serving traffic does
not distort the measurement (and the measurement does not slow requests down).
"""

from __future__ import annotations

from typing import Any

from ..engine.resize import slot_backend
from ..experts.backend import CpuBackend
from ..experts.bandwidth import measure
from ..experts.devices import create_accelerator
from ..runtime.bandwidth import BandwidthProfile
from .hub import NOT_YET
from .models import ModelManager
from .store_api import ControlStore
from .ticket import Ticket


def _cpu_backend(moe: Any, banks: Any, num_experts: int) -> Any:
    inner = getattr(moe, "inner", moe)
    if isinstance(inner, CpuBackend):
        return inner
    be = slot_backend(inner)
    if be is not None and isinstance(be.cpu, CpuBackend):
        return be.cpu
    return CpuBackend(banks, num_experts, inner.act)


def bench_bandwidth(manager: ModelManager, store: ControlStore, accelerator: str) -> Ticket:
    """Queue the measurement; the ticket resolves to the stored BandwidthProfile."""
    assert manager.hub is not None

    def attempt() -> BandwidthProfile | object:
        model = manager.active
        if model.lane.core.stats().running:
            return NOT_YET
        llm = model.llm
        be = slot_backend(llm.moe)
        acc = be.acc if be is not None else create_accelerator(accelerator)
        cpu = _cpu_backend(llm.moe, llm.banks, llm.config.num_experts)
        profile = measure(llm.banks, acc, cpu, top_k=llm.config.top_k)
        store.save_bandwidth(profile)
        if be is not None and be.hybrid:
            be.cache.set_fill_policy(profile.b_p, profile.b_h)
        return profile

    return manager.hub.run_at_safe_point("bench bw", attempt, drain=True)
