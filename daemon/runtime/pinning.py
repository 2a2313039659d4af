"""Page-locking host banks for the device: ``cudaHostRegister`` once per buffer, undone once.

One registry for the process, shared by the FTW loader (which pins the banks right after filling
them) and ``CudaAccelerator.pin``:
- every registration uses ``portable | mapped``: the decode fills read the host pool in place
  from the device (zero-copy), which needs the mapping; a buffer the FTW loader registered is
  therefore already usable, not registered a second time with other flags;
- a buffer is registered once (a second ``register`` of the same address is a no-op) and
  unregistered once: by ``unregister`` (model unload / accelerator close) or when its tensor is
  collected, whichever comes first. A stale finalizer never unregisters a newer registration at
  the same address (unload + reload often gets the same address back: registering it again
  while the old registration lives fails with cudaErrorHostMemoryAlreadyRegistered).
A failed call's error is read back at once (``cudaGetLastError``): the runtime keeps it as the
thread's last error, and the next kernel launch check would raise it as its own.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every context
HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: the device may read it in place
HOST_REGISTER_FLAGS = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED

# base name of the CUDA runtime library: libcudart.so.12, or a wheel's hashed copy
# (libcudart-9335f6a2.so.11.0)
CUDART_NAME = r"libcudart([.-].*)?\.so(\..*)?"
_lock = threading.Lock()
_registered: dict[int, tuple[object, int]] = {}  # address -> (registration token, bytes)


def _cudart() -> Any:
    return torch.cuda.cudart()


def _clear_last_error(call: str, err: int) -> None:
    """After ``call`` failed with ``err``: reset the calling thread's last CUDA error, which
    the runtime left set (not sticky: reading it clears it). Otherwise the next launch on this
    thread (torch checks ``cudaGetLastError`` after each) fails with a host-memory error."""
    # torch's cudart module binds no cudaGetLastError; a runtime object that has one (a
    # future torch, the tests' fake) is asked first, else the libcudart torch has loaded
    get = getattr(_cudart(), "cudaGetLastError", None) or _loaded_get_last_error()
    if get is None:
        log.warning("%s failed (error %d); the CUDA runtime's last error stays set", call, err)
        return
    last = int(get())  # the callers warn about the failure itself
    log.info("%s failed (error %d); cleared the CUDA runtime's last error (%d)", call, err, last)


@functools.cache
def _loaded_get_last_error() -> Callable[[], int] | None:
    """``cudaGetLastError`` of the libcudart this process has loaded (the instance whose
    per-thread error state torch's calls set), through ctypes; None when none is mapped (a
    runtime linked statically, ROCm)."""
    path = _mapped_library(CUDART_NAME)
    if path is None:
        return None
    fn = ctypes.CDLL(path).cudaGetLastError  # the loaded object again, not a second runtime
    fn.restype, fn.argtypes = ctypes.c_int, []
    return fn  # type: ignore[no-any-return]


def _mapped_library(name: str, maps: str = "/proc/self/maps") -> str | None:
    """Path of the first file mapped into this process whose base name matches ``name``."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and re.fullmatch(name, os.path.basename(fields[5])):
            return fields[5]
    return None


def register(t: torch.Tensor) -> int:
    """Page-lock ``t``'s bytes (portable | mapped) unless this process already did.

    Returns the CUDA error code (0 = registered now or before); the caller decides whether a
    failure is fatal. Empty tensors are left alone (0).
    """
    size = t.numel() * t.element_size()
    if size == 0:
        return 0
    ptr = t.data_ptr()
    with _lock:
        if ptr in _registered:
            return 0
        err = int(_cudart().cudaHostRegister(ptr, size, HOST_REGISTER_FLAGS))
        if err != 0:
            _clear_last_error(f"cudaHostRegister(0x{ptr:x}, {size})", err)
            return err
        token = object()
        _registered[ptr] = (token, size)
    weakref.finalize(t, _release, ptr, token)
    return 0


def unregister(t: torch.Tensor) -> None:
    """Undo ``register`` for ``t`` now (no-op when it is not registered by this process)."""
    _release(t.data_ptr(), None)


def is_registered(t: torch.Tensor) -> bool:
    with _lock:
        return t.data_ptr() in _registered


def _release(ptr: int, token: object | None) -> None:
    with _lock:
        entry = _registered.get(ptr)
        if entry is None or (token is not None and entry[0] is not token):
            return  # already undone, or the address now belongs to a newer registration
        del _registered[ptr]
        err = int(_cudart().cudaHostUnregister(ptr))
        if err != 0:
            _clear_last_error(f"cudaHostUnregister(0x{ptr:x})", err)
    if err != 0:
        log.warning("cudaHostUnregister(0x%x) failed (error %d)", ptr, err)
