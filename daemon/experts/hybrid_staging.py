"""The hybrid backend's crossings (device_backends.OffloadBackend) when the dense part runs on
the accelerator's device: the CPU share's inputs (activations, gate weights, expert ids) packed
into one buffer and copied to the host asynchronously, its output written into a page-locked
buffer that joins the device without a host wait (ARCHITECTURE §4.3, the q* split)."""

from __future__ import annotations

import torch

from .accelerator import Accelerator, HostCopy

# The hybrid CPU share of a step with at most this many rows crosses through the backend's
# page-locked buffers (decode); a larger one (an on-demand prefill layer) takes a plain copy
# rather than growing them to the prompt's size.
STAGED_MAX_ROWS = 256


class HybridStaging:
    """The hybrid CPU share's crossings when the dense part runs on the device: per MoE layer
    one asynchronous device -> host copy of its inputs (activations, gate weights and expert
    ids packed in one buffer) and one asynchronous host -> device copy of its output, both
    through page-locked buffers allocated once and grown to the largest step.

    The host thread that runs the step never waits: it queues the packing and the copy, hands
    the CPU branch the copy's handle and goes on to queue the fills and the device GEMVs. The
    branch waits for the copy in its own thread, computes, writes its output into the output
    buffer and the step joins it on the device. Reuse is safe without further waits: the next
    layer's input copy is queued behind this layer's output copy on the same stream, and the
    branch writes the output buffer only after its input copy (hence that output copy) landed;
    the step joins each branch before it queues the next one."""

    def __init__(self, acc: Accelerator) -> None:
        self.acc = acc
        self._in: torch.Tensor | None = None  # fp32: x | weights | ids (int32 bits), row-major
        self._out: torch.Tensor | None = None  # fp32 [rows, hidden]

    def send(
        self, x: torch.Tensor, weights: torch.Tensor, cpu_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, HostCopy]:
        """Host views (x [T, H] fp32, weights [T, K] fp32, ids [T, K] int32) of the packed copy
        and its handle: none of them may be read before ``handle.wait()``."""
        packed = pack_cpu_inputs(x, weights, cpu_ids)
        n = packed.numel()
        if self._in is None or self._in.numel() < n:
            self._in = self.acc.host_buffer((_grown(n),), torch.float32)
        buf = self._in[:n]
        handle = self.acc.to_host_async(buf, packed)
        return (*unpack_cpu_inputs(buf, x.shape[0], x.shape[1]), handle)

    def output(self, rows: int, hidden: int) -> torch.Tensor:
        """The page-locked [rows, hidden] fp32 buffer the branch writes its result into."""
        if self._out is None or self._out.shape[0] < rows or self._out.shape[1] != hidden:
            self._out = self.acc.host_buffer((_grown(rows), hidden), torch.float32)
        return self._out[:rows]


def pack_cpu_inputs(x: torch.Tensor, weights: torch.Tensor, cpu_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H], weights [T, K] and cpu_ids [T, K] (int32) in one flat fp32 tensor: x | weights
    | the ids' bits (reinterpreted, not converted), so that they cross in one copy."""
    return torch.cat(
        [
            x.float().reshape(-1),
            weights.float().reshape(-1),
            cpu_ids.int().reshape(-1).view(torch.float32),
        ]
    )


def unpack_cpu_inputs(
    buf: torch.Tensor, t: int, h: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contiguous views (x [T, H] fp32, weights [T, K] fp32, ids [T, K] int32) of a
    ``pack_cpu_inputs`` buffer."""
    k = (buf.numel() - t * h) // (2 * t)
    xh = buf[: t * h].view(t, h)
    wh = buf[t * h : t * (h + k)].view(t, k)
    ids = buf[t * (h + k) :].view(torch.int32).view(t, k)
    return xh, wh, ids


def _grown(n: int) -> int:
    """``n`` rounded up to a power of two (buffers grow a few times, then stay)."""
    return 1 << max(0, n - 1).bit_length()
