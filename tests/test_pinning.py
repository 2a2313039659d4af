"""Host-pool pinning (cudaHostRegister) with the CUDA runtime faked: the flags zero-copy needs,
one registration per buffer, and every registration undone once (unload, then reload at the
same address must work)."""

from __future__ import annotations

import gc

import pytest
import torch

from freetokend.experts import pinning
from freetokend.experts.accelerator import CudaAccelerator

ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered


class FakeCudart:
    """Records the calls and answers like the runtime: registering a live range fails."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.live: dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", ptr, flags))
        if ptr in self.live:
            return ALREADY_REGISTERED
        self.live[ptr] = flags
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr, 0))
        return 0 if self.live.pop(ptr, None) is not None else NOT_REGISTERED


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    return fake


def _pool() -> torch.Tensor:
    return torch.zeros(64, 32, dtype=torch.bfloat16)


def test_accelerator_pins_mapped_once_and_close_unregisters(cudart: FakeCudart) -> None:
    acc = CudaAccelerator()
    t = _pool()
    acc.pin(t)
    acc.pin(t)  # the backend pins every bank; a repeat must not register twice
    assert cudart.calls == [("register", t.data_ptr(), 3)]  # portable | mapped
    acc.close()  # model unload
    assert cudart.calls[-1] == ("unregister", t.data_ptr(), 0) and not cudart.live
    # reload at the same address: registers afresh instead of failing as already registered
    acc2 = CudaAccelerator()
    acc2.pin(t)
    assert cudart.live == {t.data_ptr(): 3}
    acc2.close()
    acc2.close()  # a second close unregisters nothing more
    registers = [c for c in cudart.calls if c[0] == "register"]
    unregisters = [c for c in cudart.calls if c[0] == "unregister"]
    assert len(registers) == len(unregisters) == 2 and not cudart.live


def test_ftw_pinned_pool_is_mapped_and_not_registered_again(cudart: FakeCudart) -> None:
    from freetokend.checkpoint.ftw_io import pin

    t = _pool()
    assert pin([t, torch.zeros(0)]) == 1
    assert cudart.live == {t.data_ptr(): 3}  # mapped: the zero-copy fill can read it
    CudaAccelerator().pin(t)
    assert [c[0] for c in cudart.calls] == ["register"]
    pinning.unregister(t)
    assert not cudart.live


def test_collected_pool_is_unregistered_once(cudart: FakeCudart) -> None:
    acc = CudaAccelerator()
    t = _pool()
    ptr = t.data_ptr()
    acc.pin(t)
    del t
    gc.collect()  # an unload that drops the model without close: the finalizer undoes it
    assert cudart.calls[-1] == ("unregister", ptr, 0) and not cudart.live
    acc.close()  # nothing left to undo: no second unregister
    assert sum(c[0] == "unregister" for c in cudart.calls) == 1


def test_stale_finalizer_keeps_a_newer_registration(cudart: FakeCudart) -> None:
    t = _pool()
    assert pinning.register(t) == 0
    pinning.unregister(t)
    view = t.view(-1)  # same address, registered again (a reload)
    assert pinning.register(view) == 0
    del t
    gc.collect()  # the first registration's finalizer must not undo the second one
    assert cudart.live == {view.data_ptr(): 3}
    pinning.unregister(view)
    assert not cudart.live


def test_register_failure_is_a_named_error(cudart: FakeCudart, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(cudart, "cudaHostRegister", lambda ptr, size, flags: 2)
    with pytest.raises(RuntimeError, match="cudaHostRegister failed"):
        CudaAccelerator().pin(_pool())


def test_unload_releases_the_accelerator(cudart: FakeCudart) -> None:
    from types import SimpleNamespace

    from freetokend.manager.models import release_device

    acc = CudaAccelerator()
    t = _pool()
    acc.pin(t)
    release_device(SimpleNamespace(moe=SimpleNamespace(acc=acc)))
    assert not cudart.live
    release_device(SimpleNamespace(moe=object()))  # a cpu backend holds no accelerator
