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
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every context
HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: the device may read it in place
HOST_REGISTER_FLAGS = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED

_lock = threading.Lock()
_registered: dict[int, tuple[object, int]] = {}  # address -> (registration token, bytes)


def _cudart() -> Any:
    return torch.cuda.cudart()


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
        log.warning("cudaHostUnregister(0x%x) failed (error %d)", ptr, err)
