"""Cache control: show and resize the active model's expert slots and KV pool (``ftctl cache``).

A resize is one hub operation: it applies at the next safe point. Expert slots change at once
(the slot cache holds no per-request state); KV growth too; a KV shrink that running requests
still occupy pauses admission and applies when they finished. The host pool is never touched.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..engine.resize import (
    ResizeError,
    kv_pages_for,
    resize_expert_slots,
    resize_kv_pages,
    slot_backend,
)
from .hub import NOT_YET
from .models import ModelManager, ResidentModel
from .ticket import Ticket

CPU_NOTE = "the {backend} backend has no expert slots: --moe changes nothing"


@dataclass
class CacheInfo:
    model: str
    moe_backend: str
    moe_slots: int  # 0: the backend has no slots
    moe_slots_max: int  # every expert of every MoE layer
    moe_target: int  # size the VRAM watcher grows back to (0: no slots)
    expert_bytes: int  # one expert, all banks
    resident_experts: int
    kv_pages: int
    kv_page_size: int
    kv_tokens: int
    kv_pages_used: int  # held by requests in flight
    kv_pages_cached: int  # held by the prefix cache only
    kv_bytes: int
    note: str = ""
    host_pool_ptrs: list[int] = field(default_factory=list)  # bank tensors' data_ptr()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class CacheControl:
    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager
        self.moe_target: dict[str, int] = {}  # model -> slots asked for (by ftctl or at load)

    def target(self, model: ResidentModel) -> int:
        be = slot_backend(model.llm.moe)
        if be is None:
            return 0
        return self.moe_target.setdefault(model.name, be.cache.num_slots)

    def info(self, model: ResidentModel | None = None, note: str = "") -> CacheInfo:
        m = model or self.manager.active
        llm = m.llm
        kv = llm.runner.kv
        be = slot_backend(llm.moe)
        st = llm.engine.stats()
        resident = 0
        if be is not None:
            resident = int(
                ((be.cache.state.id_of_slot >= 0) & (be.cache.state.reserved == 0)).sum()
            )
        return CacheInfo(
            model=m.name,
            moe_backend=m.moe_backend if be is None else ("hybrid" if be.hybrid else "offload"),
            moe_slots=be.cache.num_slots if be is not None else 0,
            moe_slots_max=llm.banks.num_flat,
            moe_target=self.target(m),
            expert_bytes=llm.banks.nbytes_per_expert(),
            resident_experts=resident,
            kv_pages=kv.num_pages,
            kv_page_size=kv.page_size,
            kv_tokens=kv.num_pages * kv.page_size,
            kv_pages_used=st.kv_pages_used,
            kv_pages_cached=st.kv_pages_cached,
            kv_bytes=kv.nbytes,
            note=note,
            host_pool_ptrs=[t.data_ptr() for t in llm.banks.tensors().values()],
        )

    def resize(self, moe_slots: int | None, kv_tokens: int | None, source: str = "ftctl") -> Ticket:
        """Queue a resize of the active model's caches; the ticket resolves to its CacheInfo.
        Sizes are checked now (ResizeError); ``source`` = "ftctl" also sets the VRAM target."""
        model = self.manager.active
        llm = model.llm
        be = slot_backend(llm.moe)
        note = ""
        if moe_slots is not None:
            if be is None:
                note = CPU_NOTE.format(backend=model.moe_backend)
                moe_slots = None
            elif not 1 <= moe_slots <= llm.banks.num_flat:
                raise ResizeError(f"--moe must be in [1, {llm.banks.num_flat}], got {moe_slots}")
            elif source == "ftctl":
                self.moe_target[model.name] = moe_slots
        kv_pages = None
        if kv_tokens is not None:
            if kv_tokens < 1:
                raise ResizeError(f"--kv must be at least 1 token, got {kv_tokens}")
            kv_pages = kv_pages_for(llm.runner.kv, kv_tokens)
            if kv_tokens < llm.max_model_len:
                note = " ".join(
                    filter(None, (note, f"the KV pool is now smaller than the context limit "
                                  f"({llm.max_model_len} tokens): longer requests end early"))
                )  # fmt: skip
        assert self.manager.hub is not None

        def attempt() -> Any:
            m = self.manager.active
            if m is not model:
                raise ResizeError(f"{model.name} is no longer the active model")
            if moe_slots is not None and be is not None and be.cache.num_slots != moe_slots:
                resize_expert_slots(be, moe_slots)
            if kv_pages is not None and not resize_kv_pages(
                llm.runner.kv, llm.engine.prefix, kv_pages
            ):
                return NOT_YET
            return self.info(m, note)

        what = "resize " + " ".join(
            f"{k} {v}" for k, v in (("moe", moe_slots), ("kv", kv_tokens)) if v is not None
        )
        return self.manager.hub.run_at_safe_point(what.strip(), attempt, drain=True)
