"""Host-pool pinning (cudaHostRegister) with the CUDA runtime faked: the flags zero-copy needs,
one registration per buffer, and every registration undone once (unload, then reload at the
same address must work)."""

from __future__ import annotations

import gc

import pytest
import torch

from freetokend.experts.accelerator import CudaAccelerator
from freetokend.runtime import pinning

ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered


class FakeCudart:
    """Records the calls and answers like the runtime: registering a live range fails, and a
    failed call leaves its error as the last error until ``cudaGetLastError`` reads it.
    ``fail_register``: the error every registration returns (0: none)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.live: dict[int, int] = {}
        self.last = 0
        self.fail_register = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", ptr, flags))
        if self.fail_register or ptr in self.live:
            return self._failed(self.fail_register or ALREADY_REGISTERED)
        self.live[ptr] = flags
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr, 0))
        return 0 if self.live.pop(ptr, None) is not None else self._failed(NOT_REGISTERED)

    def cudaGetLastError(self) -> int:  # noqa: N802
        self.calls.append(("get_last_error", 0, 0))
        last, self.last = self.last, 0
        return last

    def _failed(self, err: int) -> int:
        self.last = err
        return err

    def cleared_after(self, call: str) -> bool:
        """Whether the last error was read right after the latest ``call`` and is clear."""
        names = [c[0] for c in self.calls]
        i = len(names) - 1 - names[::-1].index(call)
        return names[i + 1 : i + 2] == ["get_last_error"] and self.last == 0


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


def test_failed_calls_clear_the_runtimes_last_error(cudart: FakeCudart) -> None:
    """A failed cudaHostRegister / cudaHostUnregister leaves its error as the thread's last
    error, which the next kernel launch check would raise as its own: it is read back at
    once, whoever called (the FTW loader, the accelerator, an unload), and only on failure."""
    from freetokend.checkpoint.ftw_io import pin

    t = _pool()
    assert pinning.register(t) == 0
    pinning.unregister(t)
    assert all(c[0] != "get_last_error" for c in cudart.calls)  # success: nothing to read
    cudart.live[t.data_ptr()] = 3  # registered behind the registry's back
    assert pinning.register(t) == ALREADY_REGISTERED and cudart.cleared_after("register")
    cudart.live.clear()
    cudart.fail_register = 2  # cudaErrorMemoryAllocation: LimitMEMLOCK too low
    assert pin([t]) == 0 and cudart.cleared_after("register")  # the tensor stays pageable
    with pytest.raises(RuntimeError, match="cudaHostRegister failed"):
        CudaAccelerator().pin(t)
    assert cudart.cleared_after("register")
    cudart.fail_register = 0
    assert pinning.register(t) == 0
    cudart.live.clear()  # unregistered behind the registry's back: the unregister fails
    pinning.unregister(t)
    assert cudart.calls[-2][0] == "unregister" and cudart.cleared_after("unregister")


def test_without_a_bound_get_last_error_the_loaded_runtimes_is_read(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """torch's cudart module binds no cudaGetLastError: the ctypes one of the loaded libcudart
    is read instead, and with none loaded the failure is logged as left set."""

    class TorchCudart:  # what torch.cuda.cudart() offers: no cudaGetLastError
        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
            return 2

    reads: list[int] = []

    def get_last_error() -> int:
        reads.append(2)
        return 2

    monkeypatch.setattr(torch.cuda, "cudart", TorchCudart)
    monkeypatch.setattr(pinning, "_loaded_get_last_error", lambda: get_last_error)
    assert pinning.register(_pool()) == 2 and reads == [2]
    monkeypatch.setattr(pinning, "_loaded_get_last_error", lambda: None)
    assert pinning.register(_pool()) == 2 and reads == [2]  # nothing to read it with: logged


def test_the_loaded_runtime_is_found_in_the_process_maps(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """cudaGetLastError comes from the libcudart already mapped (torch binds none): the same
    runtime whose per-thread error state torch's own calls set."""
    maps = tmp_path / "maps"
    pattern = pinning.CUDART_NAME
    lib = "/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f02-7f03 rw-p 00000000 00:00 0 \n"
        f"7f04-7f05 r-xp 00000000 08:01 13 {lib}\n"
    )
    assert pinning._mapped_library(pattern, str(maps)) == lib
    bundled = "/torch/lib/libcudart-9335f6a2.so.11.0"  # older wheels bundle a hashed copy
    maps.write_text(f"7f04-7f05 r-xp 00000000 08:01 13 {bundled}\n")
    assert pinning._mapped_library(pattern, str(maps)) == bundled
    maps.write_text("7f04-7f05 r-xp 00000000 08:01 13 /lib/libcudart_static_helper.so\n")
    assert pinning._mapped_library(pattern, str(maps)) is None
    assert pinning._mapped_library(pattern, str(tmp_path / "absent")) is None
