"""``FakeCudaAccelerator``: the CUDA accelerator's own code on a fake device (ARCHITECTURE §9.2).

It is ``CudaAccelerator`` with the runtime it needs supplied by a ``FakeCudaSession``: the copy
paths, streams and events of the real class run unchanged, on fake tensors. What it cannot
check without a driver it states instead: the zero-copy fill check passes (the pool is pinned
and mapped as ``pin`` asks), and pinning is recorded (host bytes the page-locked pool takes, and
the tracker's pinned storages: ``non_blocking`` copies from them are not host syncs).

Use: ``acc = FakeCudaAccelerator(vram_mib=8192)``, then run everything that touches the device
inside ``with acc:``. ``acc.tracker`` has the device peak and the host-sync counter.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..accelerator import Accelerator, CudaAccelerator
from .session import FakeCudaSession
from .tracker import DeviceTracker

MIB = 1 << 20
# What a CUDA context, cuBLAS workspaces and the allocator's slack take before any tensor
CONTEXT_MIB = 512


class FakeCudaAccelerator(CudaAccelerator):
    name = "fake-cuda"

    def __init__(self, vram_mib: int, context_mib: int = CONTEXT_MIB) -> None:
        Accelerator.__init__(self)  # CudaAccelerator.__init__ asks the driver
        if vram_mib <= context_mib:
            raise ValueError(f"vram_mib {vram_mib} must exceed the CUDA context ({context_mib})")
        self.session = FakeCudaSession(vram_mib * MIB, context_mib * MIB)
        self.device = torch.device("cuda", 0)
        self.copy_stream = self.session._stream  # type: ignore[assignment]
        self.pinned_bytes = 0

    @property
    def tracker(self) -> DeviceTracker:
        return self.session.tracker

    def __enter__(self) -> FakeCudaAccelerator:
        self.session.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.session.__exit__(*exc)

    def open(self) -> None:
        """The process-wide part of the session; device work then runs in ``in_thread()``."""
        self.session.open()

    def in_thread(self) -> AbstractContextManager[None]:
        """The fake device in the calling thread (re-entrant)."""
        return self.session.in_thread()

    def close(self) -> None:
        """Model unload: nothing was pinned; the session's ``torch.cuda`` stand-ins go
        (idempotent; the modes of a ``with`` block are left by its exit)."""
        self.session.close()

    def mem_get_info(self) -> tuple[int, int]:
        return self.session.mem_get_info()

    def to_host(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The copy runs (and is counted as a host sync); what reaches a real host tensor is
        zeros, since the fake device holds no values: the host code after it (dense layers, the
        sampler) runs on real tensors and reads valid token ids, as the engine needs."""
        out = t.to(device)
        if isinstance(out, FakeTensor) and out.device.type == "cpu":
            return torch.zeros(out.shape, dtype=out.dtype)
        return out

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A fake host tensor (no memory behind it), marked pinned for the tracker: copies into
        it with ``non_blocking`` are asynchronous, and a host op that reads it before the copy's
        event was waited on raises (``DeviceTracker``)."""
        return self.tracker.pin(self.session.host_empty(shape, dtype))

    def device_fill_ok(self, src: torch.Tensor) -> bool:
        return True  # assumed: ``pin`` registers the pool mapped (checked on a real GPU only)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            raise RuntimeError(f"pin: host tensor expected, got one on {t.device}")
        self.pinned_bytes += t.numel() * t.element_size()
        return self.tracker.pin(t)  # non_blocking copies from it are then asynchronous

    def _record_on_copy_stream(self, t: torch.Tensor) -> None:
        """The fake stream is no ``torch.Stream``; what a GPU's ``record_stream`` would
        refuse, a tensor not on the device, is refused here too."""
        if t.device.type != "cuda":
            raise RuntimeError(f"record_stream: device tensor expected, got one on {t.device}")

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)  # the session's stand-in counts it
