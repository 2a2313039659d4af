"""The fake-CUDA tier (ARCHITECTURE §9.2): the real CUDA code path on FakeTensorMode with device cuda.

Placement (a host/device mix raises as on a GPU), device bytes against simulated 8 and 24 GiB
cards, and host syncs per decode step, for fused / offload / hybrid on a tiny geometry and on
Qwen3-30B-A3B's layer geometry (few layers, data-less banks)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from fake_cuda_support import MIB, QWEN3_30B, TINY, fake_banks, routes, run_cycle
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
CYCLES = [(g, c) for g in (QWEN3_30B, TINY) for c in CARDS]


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
    # this driver passes the layer input from the host (as when the dense part ran there): x,
    # the ids and the gate weights cross per layer (3 blocking host -> device copies, ``h2d``)
    # and the MoE output comes back once; hybrid also reads the CPU branch's ids, the grouped
    # compute (> 16 routes) its counts
    per_layer = 3 + {"fused": 1, "offload": 1, "hybrid": 2}[backend]
    assert rep.syncs_per_decode_step == per_layer * geom.layers
    batched = per_layer + (geom.top_k * 4 > 16)
    assert rep.syncs_batched_step == batched * geom.layers
    print(
        f"\n{geom.name} {backend} {card}: load {rep.load_bytes / MIB:.0f} MiB, peak "
        f"{rep.peak / MIB:.0f} MiB, host syncs per decode step {rep.syncs_per_decode_step:g} "
        f"(4 sequences: {rep.syncs_batched_step:g}) over {geom.layers} MoE layers"
    )


QWEN3_30B_FULL = replace(QWEN3_30B, layers=48)


@pytest.mark.parametrize("card", list(CARDS))
def test_default_slots_fit_the_card(card) -> None:
    """The whole Qwen3-30B-A3B pool (48 x 128 experts, 54 GiB in bf16) with the default slot
    count: sized from the card's free memory, not half of all experts (27 GiB), so the load and
    a prompt chunk fit an 8 GiB card."""
    acc = FakeCudaAccelerator(vram_mib=CARDS[card])
    g = QWEN3_30B_FULL
    with acc:
        for backend in ("offload", "auto"):
            be: Any = create_backend(
                backend, fake_banks(acc, g), g.layers, g.experts, ActivationSpec(),
                accelerator=acc,
            )  # fmt: skip
            slots, slot = be.cache.num_slots, be.slot_bytes
            assert 2 * g.experts <= slots < g.layers * g.experts // 2
            free_after = acc.mem_get_info()[0]
            assert slots * slot <= 0.9 * (free_after + slots * slot)
            x = torch.randn(512, g.hidden)
            ids, w = routes(g, 512)
            be.begin_step(512, prefill=True)
            for layer in range(2):
                be.forward(layer, x, ids, w)
            be.end_step()
            assert acc.tracker.peak <= acc.tracker.capacity
            del be


def test_decode_batches_of_32_sequences_do_not_stream_layers() -> None:
    """A step of 40 decode sequences (no prompt) is served by the cache: no prefill stream, no
    whole-layer copies, the cached experts stay."""
    acc = FakeCudaAccelerator(vram_mib=8192)
    g = QWEN3_30B
    with acc:
        be: Any = create_backend(
            "offload", fake_banks(acc, g), g.layers, g.experts, ActivationSpec(),
            accelerator=acc, moe_slots=3 * g.experts,
        )  # fmt: skip
        x = torch.randn(40, g.hidden)
        ids, w = routes(g, 40)
        before = acc.stats.bytes
        be.begin_step(40)  # decode: prefill=False
        assert be._prefill is None  # no layer streaming, no slots reserved for it
        be.forward(0, x, ids, w)
        be.end_step()
        assert be._counters["prefill_layers_streamed"] == 0
        assert acc.stats.bytes == before  # fills go through the device copy list, not layers


def test_vram_watcher_sizes_slots_in_the_device_format() -> None:
    """An mxfp4 pool has bf16 device slots: the watcher's slot size is the device's (3.5x the
    packed host expert), else a shrink frees 3.5x less than it planned."""
    from types import SimpleNamespace

    from freetokend.experts.formats import allocate
    from freetokend.manager.control import ControlPlane

    acc = FakeCudaAccelerator(vram_mib=8192)
    with acc:
        with acc.session.fake_mode:
            banks = allocate("mxfp4", 2 * 8, 512, 256, torch.bfloat16)
        be: Any = create_backend(
            "offload", banks, 2, 8, ActivationSpec(), accelerator=acc, moe_slots=8
        )
        llm = SimpleNamespace(moe=be, banks=banks)
        stub = SimpleNamespace(
            manager=SimpleNamespace(active=SimpleNamespace(llm=llm)),
            cache=SimpleNamespace(target=lambda model: 8),
        )
        sizes = ControlPlane.slot_sizes(stub)  # type: ignore[arg-type]
        assert sizes is not None
        device_slot = 3 * 512 * 256 * 2  # bf16 gate_up + down
        assert sizes.slot_bytes == device_slot == be.slots.nbytes_per_expert()
        assert banks.nbytes_per_expert() * 3 < device_slot


def test_quantized_pool_is_dequantized_expert_by_expert() -> None:
    """Dequantizing an mxfp4 pool for the device never holds a whole fp32 copy: the host peak
    is the packed pool + the bf16 pool + a few experts in fp32."""
    from freetokend.experts.formats import allocate

    acc = FakeCudaAccelerator(vram_mib=8192)
    h, inter, n = 512, 256, 32
    with acc:
        with acc.session.fake_mode:
            banks = allocate("mxfp4", n, h, inter, torch.bfloat16)
        tr = acc.tracker
        tr.host.reset_peak()
        packed = tr.host.sweep()
        be: Any = create_backend(
            "offload", banks, 2, n // 2, ActivationSpec(), accelerator=acc, moe_slots=4
        )
        bf16 = n * 3 * h * inter * 2
        fp32_expert = 3 * h * inter * 4
        assert be.host.gate_up.dtype == torch.bfloat16
        assert tr.host.peak - packed <= bf16 + 4 * fp32_expert, (tr.host.peak - packed) / MIB


def test_prefill_streams_only_missing_experts_and_keeps_the_cache() -> None:
    """Prompt chunks stream through the slot cache (on the stand-in, whose copies are counted):
    experts already resident are neither copied nor moved, a second chunk copies nothing the
    first one brought, and the output is the reference's."""
    from freetokend.experts.accelerator import StandinAccelerator
    from freetokend.experts.banks import ExpertBanks, moe_reference

    layers, e, h, i = 3, 8, 32, 16
    g = torch.Generator().manual_seed(0)
    banks = ExpertBanks(
        torch.randn(layers * e, 2 * i, h, generator=g), torch.randn(layers * e, h, i, generator=g)
    )
    acc = StandinAccelerator()
    be: Any = create_backend(
        "offload", banks, layers, e, ActivationSpec(), accelerator=acc, moe_slots=layers * e
    )
    x = torch.randn(40, h, generator=g)
    ids = torch.rand(40, e, generator=g).topk(2, dim=-1).indices
    w = torch.rand(40, 2, generator=g)
    be.begin_step(1)  # a decode step caches two experts of layer 0
    be.forward(0, x[:1], ids[:1], w[:1])
    be.end_step()
    st = be.cache.state
    cached = {f: int(st.slot_of[f]) for f in ids[0].tolist()}
    assert acc.stats.copies == 2 * len(cached) == 4  # gate_up + down per expert

    def chunk() -> int:
        before = acc.stats.copies
        be.begin_step(40, prefill=True)
        for layer in range(layers):
            out = be.forward(layer, x, ids, w)
            ref = moe_reference(x, ids.long() + layer * e, w, banks, ActivationSpec())
            assert torch.equal(out, ref)
        be.end_step()
        return (acc.stats.copies - before) // 2  # experts copied

    assert chunk() == layers * e - len(cached)  # the cached experts were not copied again
    assert {f: int(st.slot_of[f]) for f in cached} == cached  # nor moved
    assert chunk() == 0  # everything the first chunk brought stayed
    assert be._counters["prefill_layers_streamed"] == 2 * layers
    assert int(st.reserved.sum()) == 0  # nothing stays reserved after the step


def test_fake_cuda_is_a_registered_accelerator() -> None:
    from freetokend.experts.devices import ACCELERATORS, create_accelerator

    assert "fake-cuda" in ACCELERATORS
    acc = create_accelerator("fake-cuda", vram_mib=8192)
    assert isinstance(acc, FakeCudaAccelerator) and acc.tracker.capacity == (8192 - 512) * MIB
    with pytest.raises(ValueError, match="vram_mib"):
        create_accelerator("fake-cuda")
    with acc, pytest.raises(RuntimeError, match="already active"):
        FakeCudaAccelerator(vram_mib=4096).__enter__()  # the torch.cuda patches are global


def test_kernel_ops_run_the_kernels_and_have_fake_shapes() -> None:
    """The custom-op wrappers: the real implementation launches the Triton kernel (here in
    the interpreter, on host tensors: ftkernels.interp, no process-wide TRITON_INTERPRET,
    which only takes effect when the kernel modules are first imported), the fake one gives
    shapes on the fake device."""
    from ftkernels import ops

    src = torch.arange(5 * 8, dtype=torch.float32).view(5, 8)
    dst = torch.zeros(3, 8)
    idx = torch.tensor([2, 0, 1], dtype=torch.int32)
    ops.copy_rows(dst, src, idx, torch.tensor([4, 1, 3], dtype=torch.int32), torch.tensor([2]))
    assert dst[2].equal(src[4]) and dst[0].equal(src[1]) and dst[1].eq(0).all()
    acc = FakeCudaAccelerator(vram_mib=1024)
    with acc:
        d = torch.empty(3, 8, device="cuda")
        with pytest.raises(RuntimeError, match="different devices"):
            ops.copy_rows(d, src, idx, idx, torch.tensor([2]))  # a host copy list
        cnt = torch.tensor([2], dtype=torch.int32, device="cuda")
        ops.copy_rows(d, src, idx.to("cuda"), idx.to("cuda"), cnt)  # src: the mapped host pool
        bank = torch.empty(4, 16, 8, device="cuda")
        y = ops.moe_decode(
            torch.empty(2, 8, device="cuda"), torch.zeros(2, 3, dtype=torch.int32, device="cuda"),
            torch.empty(2, 3, device="cuda"), bank, torch.empty(4, 8, 8, device="cuda"),
            None, None, False, 1.0, 7.0,
        )  # fmt: skip
        assert y.shape == (2, 8) and y.dtype == torch.float32 and y.device.type == "cuda"


def test_async_copy_to_pinned_host_memory_is_read_only_after_its_event() -> None:
    """A non_blocking copy into pinned host memory is queued, not a sync; reading the buffer
    before a wait on an event recorded after it raises (stale bytes on CUDA); views do not."""
    acc = FakeCudaAccelerator(vram_mib=1024)
    with acc:
        tr = acc.tracker
        dev = torch.zeros(4, 8, device="cuda")
        buf = acc.host_buffer((64,), torch.float32)
        syncs = tr.syncs.total
        handle = acc.to_host_async(buf[:32], dev.reshape(-1))
        assert tr.async_d2h == 1 and tr.syncs.total == syncs  # queued, no host wait
        view = buf[:32].view(4, 8)  # a view reads nothing
        with pytest.raises(RuntimeError, match="not waited on"):
            view + 1
        handle.wait()
        assert tr.syncs.by_kind["event"] == 1  # the wait is the host's, counted
        assert (view + 1).shape == (4, 8)
        # an event recorded before the copy does not cover it
        early = torch.cuda.Event()
        early.record()
        acc.to_host_async(buf[32:], dev.reshape(-1))
        early.synchronize()
        with pytest.raises(RuntimeError, match="not waited on"):
            buf[32:].sum()
        torch.cuda.synchronize()  # the whole device: every queued copy landed
        assert buf[32:].sum().shape == ()
        # into pageable memory the copy is a blocking read
        reads = tr.syncs.by_kind["d2h"]
        torch.empty(32).copy_(dev.reshape(-1), non_blocking=True)
        assert tr.syncs.by_kind["d2h"] == reads + 1 and tr.async_d2h == 2
