"""Per-step metadata to the device without a host sync.

A blocking host -> device copy (``torch.tensor(data, device="cuda")``, ``.to("cuda")`` of
pageable memory) returns only when the copy is done, so the host waits for everything queued
before it on the stream: one such copy per attention layer stalls a decode step as often as a
read would. ``to_device`` instead puts a host tensor in page-locked memory and copies it with
``non_blocking=True``, which only queues the copy (torch's pinned allocator keeps the block
until the copy has run). Build a step's small tensors (token ids, positions, page tables,
sampling parameters) into one host tensor and send it with one call.

Where the device is the host (the CPU backend, the CPU stand-in) the tensor is returned as is.
On the fake CUDA device (CPU build of torch: no pinned allocator) the tensor is marked pinned
for the tracker instead, which then counts the copy as asynchronous, not as a sync.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# How the open fake CUDA session marks a host tensor pinned (its tracker's ``pin``), installed by
# experts/fakecuda/session.py while the session is open; None: real page-locked memory. Passed
# in rather than imported: this module sits below the fake device's package.
_fake_pin: Callable[[torch.Tensor], torch.Tensor] | None = None


def set_fake_pin(pin: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    """Install (a fake CUDA session opening) or remove (closing: None) the fake device's pin."""
    global _fake_pin
    _fake_pin = pin


def pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a host tensor) in page-locked memory."""
    pin = _fake_pin
    if pin is not None:
        return pin(t)
    return t.pin_memory()


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``: one asynchronous copy on CUDA, nothing elsewhere."""
    if device.type != "cuda":
        return host.to(device)
    return pinned(host).to(device, non_blocking=True)
