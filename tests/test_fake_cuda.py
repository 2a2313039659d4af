"""The fake-CUDA tier (DESIGN §7): the real CUDA code path on FakeTensorMode with device cuda.

Placement (a host/device mix raises as on a GPU), device bytes against simulated 8 and 24 GiB
cards, and host syncs per decode step, for fused / offload / hybrid on a tiny geometry and on
Qwen3-30B-A3B's layer geometry (few layers, data-less banks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fake_cuda_support import GIB, MIB, QWEN3_30B, TINY, fake_banks, routes, run_cycle
from torch._subclasses.fake_tensor import DataDependentOutputException

from freetokend.experts.backend import create_backend
from freetokend.experts.banks import ActivationSpec
from freetokend.experts.fakecuda import FakeCudaAccelerator


def test_shim_placement_syncs_and_oom() -> None:
    acc = FakeCudaAccelerator(vram_mib=1024)
    with acc:
        tr = acc.tracker
        a = torch.zeros(4, 8, device="cuda")  # the bare string works
        assert a.device == torch.device("cuda", 0)
        a[1:3] = torch.ones(2, 8).to("cuda")  # slicing, setitem, .to("cuda")
        a[torch.tensor([0, 3])].copy_(a[0:2])
        host = torch.arange(5)
        assert host.tolist() == [0, 1, 2, 3, 4]  # host tensors keep their values
        with pytest.raises(RuntimeError, match="same device|device"):
            _ = a + torch.zeros(4, 8)  # a host/device mix raises as on a GPU
        before = tr.syncs.total
        a.cpu()
        assert tr.syncs.by_kind["d2h"] == 1
        with pytest.raises(DataDependentOutputException):
            int(a.sum())  # a data-dependent read raises ...
        assert tr.syncs.by_kind["scalar"] == 1  # ... and is counted
        assert torch.nonzero(a).shape == (32, 2)  # worst case shape, flagged
        assert tr.syncs.total == before + 3
        free, total = torch.cuda.mem_get_info()
        assert total == 1024 * MIB and free < total
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(600 * MIB, dtype=torch.uint8, device="cuda")
        tr.reset_peak()
        big = torch.empty(300 * MIB, dtype=torch.uint8, device="cuda")
        del big
        torch.empty(300 * MIB, dtype=torch.uint8, device="cuda")  # the first one was freed
        assert 300 * MIB <= tr.peak < 301 * MIB
    assert not torch.cuda.is_available()


CARDS = {"8GiB": 8192, "24GiB": 24576}
CYCLES = [(QWEN3_30B, c) for c in CARDS] + [(TINY, "8GiB")]


@pytest.mark.parametrize("backend", ["fused", "offload", "hybrid"])
@pytest.mark.parametrize(("geom", "card"), CYCLES, ids=lambda v: getattr(v, "name", v))
def test_backend_cycle_fits_the_card(geom, card, backend) -> None:
    """Load, a 512-token prompt, decode steps of 1 sequence (the per-route kernels) and of 4
    (top-8: 32 routes, the grouped compute), and for slot backends a resize down and up with
    the default slot count; the peak stays within the card, a resize never holds old + new."""
    acc = FakeCudaAccelerator(vram_mib=CARDS[card])
    cap = acc.tracker.capacity
    pool = geom.layers * geom.experts * geom.expert_bytes
    with acc:
        if backend == "fused" and pool > cap:  # every expert resident: fails as CUDA would
            with pytest.raises(torch.OutOfMemoryError):
                run_cycle(acc, geom, backend)
            return
        rep = run_cycle(acc, geom, backend, resize=backend != "fused")
    assert 0 < rep.load_bytes <= rep.peak <= cap
    slot = geom.expert_bytes
    be: Any = rep.backend
    if rep.resized:  # the default slot count used the card; a resize never holds old + new
        default = rep.resized[1]
        assert (default < geom.layers * geom.experts) == (pool > cap * 0.9)
        down, up = rep.resize_peaks
        assert down <= rep.load_bytes + 64 * MIB  # the shrink needs no extra device memory
        assert up <= default * slot + 64 * MIB
        assert be.cache.num_slots == default
    # dense layers are on the host: the MoE output comes back once per layer; hybrid also
    # reads the CPU branch's ids, the grouped compute (fused; > 16 routes) its counts
    per_layer = {"fused": 2, "offload": 1, "hybrid": 2}[backend]
    assert rep.syncs_per_decode_step == per_layer * geom.layers
    batched = per_layer + (backend != "fused" and geom.top_k * 4 > 16)
    assert rep.syncs_batched_step == batched * geom.layers
    print(
        f"\n{geom.name} {backend} {card}: load {rep.load_bytes / MIB:.0f} MiB, peak "
        f"{rep.peak / MIB:.0f} MiB, host syncs per decode step {rep.syncs_per_decode_step:g} "
        f"(4 sequences: {rep.syncs_batched_step:g}) over {geom.layers} MoE layers"
    )
