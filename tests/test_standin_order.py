"""The stand-in accelerator orders copies like a CUDA stream: a copy lands only when compute
waits on it, so a missing wait changes the tokens instead of passing by timing luck; in "chaos"
order copies may also land early and rows in any order, which correct code must not notice."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.experts import devices as acc_mod
from freetokend.experts.accelerator import StandinAccelerator, Transfer
from freetokend.experts.device_backends import OffloadBackend, _PrefillStream


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("qwen3_moe")
    make_tiny("qwen3_moe", d, seed=7)
    return d


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 97, (n,), generator=g).tolist() for n in (40, 5)]


def _generate(model_dir, backend: str, **kw) -> list[list[int]]:  # type: ignore[no-untyped-def]
    llm = LLM(model_dir, backend, max_model_len=128, kv_tokens=512, accelerator="standin", **kw)
    return llm.generate(_prompts(), max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """offload at 4 slots on the stand-in in FIFO order, the code as it is: the same arithmetic
    as every run below (which only drop a wait or reorder the copies), so tokens compare with
    ``==``. Against the cpu backend, whose arithmetic differs, test_moe_backends.py."""
    return _generate(model_dir, "offload", moe_slots=4)


@pytest.fixture(scope="module")
def reference_all(model_dir) -> dict[str, list[list[int]]]:  # type: ignore[no-untyped-def]
    """In FIFO order: offload with every expert resident, hybrid at 6 slots."""
    probe = LLM(model_dir, max_model_len=64, kv_tokens=64)
    return {
        "offload": _generate(model_dir, "offload", moe_slots=probe.banks.num_flat),
        "hybrid": _generate(model_dir, "hybrid", moe_slots=6, bandwidth=(1.0, 2.0)),
    }


class _NoWait(Transfer):
    """The bug under test: the caller drops the wait on its copies."""

    def __init__(self, inner: Transfer) -> None:
        self.inner = inner

    def wait(self) -> None:
        pass


def test_copies_land_only_when_waited_on() -> None:
    acc = StandinAccelerator()
    poisoned = acc.empty((2, 3), torch.bfloat16)
    assert bool(poisoned.isnan().all()) and bool((acc.empty((4,), torch.uint8) == 255).all())
    dst, src = torch.zeros(3, 4), torch.arange(12.0).reshape(3, 4)
    first = acc.copy_rows([(dst, src, [0], [2])])
    second = acc.copy_rows([(dst, src, [1], [1])])
    assert acc.pending() == 2 and not dst.any()  # queued, not copied
    second.wait()  # the stream is FIFO: waiting on the later copy lands both
    assert torch.equal(dst[0], src[2]) and torch.equal(dst[1], src[1]) and acc.pending() == 0
    first.wait()  # already landed: nothing to do
    idx = torch.tensor([2], dtype=torch.int32)
    acc.fill_rows([(dst, src)], idx, torch.tensor([0], dtype=torch.int32), idx * 0 + 1)
    assert not dst[2].any()
    acc.synchronize()
    assert torch.equal(dst[2], src[0])
    with pytest.raises(ValueError, match="stand-in order"):
        StandinAccelerator(order="sometimes")


@pytest.mark.parametrize("where", ["decode fill", "prefill buffer"])
def test_a_missing_wait_changes_the_tokens(
    model_dir, reference, reference_all, monkeypatch, where
) -> None:  # type: ignore[no-untyped-def]
    if where == "decode fill":
        fill = OffloadBackend._fill
        monkeypatch.setattr(OffloadBackend, "_fill", lambda self, plan: _NoWait(fill(self, plan)))
        got, want = _generate(model_dir, "offload", moe_slots=4), reference
    else:
        issue = _PrefillStream._issue

        def issue_no_wait(self, layer):  # type: ignore[no-untyped-def]
            issue(self, layer)
            if layer in self.pending:
                self.pending[layer] = _NoWait(self.pending[layer])

        monkeypatch.setattr(_PrefillStream, "_issue", issue_no_wait)
        probe = LLM(model_dir, max_model_len=64, kv_tokens=64)
        got = _generate(model_dir, "offload", moe_slots=probe.banks.num_flat)
        want = reference_all["offload"]
    assert got != want, "a dropped wait went unnoticed"


@pytest.mark.parametrize("seed", [0, 1])
def test_chaos_order_keeps_the_tokens(model_dir, reference_all, monkeypatch, seed) -> None:  # type: ignore[no-untyped-def]
    """Early landings and shuffled rows are legal on a GPU: offload and hybrid must not care."""
    made: list[StandinAccelerator] = []

    def chaos(name: str) -> StandinAccelerator:
        made.append(StandinAccelerator(order="chaos", seed=seed))
        return made[-1]

    monkeypatch.setattr(acc_mod, "create_accelerator", chaos)
    probe = LLM(model_dir, max_model_len=64, kv_tokens=64)
    offload = _generate(model_dir, "offload", moe_slots=probe.banks.num_flat)
    assert offload == reference_all["offload"]
    assert (
        _generate(model_dir, "hybrid", moe_slots=6, bandwidth=(1.0, 2.0)) == reference_all["hybrid"]
    )
    assert made and all(a.order == "chaos" and a.stats.copies > 0 for a in made)


def test_reclaim_poisons_a_copy_list_the_transfer_does_not_hold(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The reclaim mode itself: a held copy list lands right after the caller dropped it; one
    that ``_hold`` skipped is reused (poisoned) before the copy reads it."""
    src = torch.arange(12.0).reshape(3, 4)

    def fill(acc: StandinAccelerator) -> torch.Tensor:
        dst = torch.zeros(3, 4)
        one = torch.tensor([1], dtype=torch.int32)
        acc.fill_rows([(dst, src)], one, one + 1, one.clone()).wait()
        return dst

    assert torch.equal(fill(StandinAccelerator(reclaim=True))[1], src[2])
    assert torch.equal(fill(StandinAccelerator())[1], src[2])
    monkeypatch.setattr(StandinAccelerator, "_hold", lambda self, transfer, tensors: None)
    assert not torch.equal(fill(StandinAccelerator(reclaim=True))[1], src[2])
    assert torch.equal(fill(StandinAccelerator())[1], src[2])  # reclaim off: nothing reused


def test_prefill_overlap_holds_its_copy_lists(model_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Prefill overlap issues layer l + 1's fill and drops its plan before layer l computes;
    on CUDA the next allocations then reuse the copy list's blocks before the copy stream
    reads them, unless the transfer holds them (``record_stream``). The stand-in's reclaim
    mode reuses what is not held as soon as ``fill_rows`` returns."""
    made: list[StandinAccelerator] = []

    def reclaiming(name: str) -> StandinAccelerator:
        made.append(StandinAccelerator(reclaim=True))
        return made[-1]

    probe = LLM(model_dir, max_model_len=64, kv_tokens=64)
    slots = min(2 * probe.config.num_experts + 1, probe.banks.num_flat)  # streams whole layers
    want = _generate(model_dir, "offload", moe_slots=slots)  # the same, nothing reclaimed
    monkeypatch.setattr(acc_mod, "create_accelerator", reclaiming)
    llm = LLM(model_dir, "offload", moe_slots=slots, max_model_len=128, kv_tokens=512)
    assert isinstance(llm.moe, OffloadBackend) and llm.moe.prefill_overlap
    assert llm.generate(_prompts(), max_tokens=6, ignore_eos=True) == want
    assert llm.moe.counters["prefill_layers_streamed"] > 0
    assert made and all(a.reclaim for a in made) and llm.moe.acc in made
