"""A fake-aware stand-in for the native CPU expert executor (the hybrid backend's CPU branch).

The native executor reads bank memory through raw pointers: on fake (data-less) host banks it
would read nothing valid. This stand-in checks what the native call requires (host tensors of
the shapes it reads) and returns an output of the right shape, fp32, on the host, without
computing: the hybrid path around it runs as it does with the real executor.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from ..banks import ExpertBanks


class FakeCpuExecutor:
    def __init__(self, banks: ExpertBanks) -> None:
        for name, t in banks.all_tensors().items():
            if t.device.type != "cpu":
                raise RuntimeError(f"CPU executor: bank {name} is on {t.device}, not the host")
        self.hidden = int(banks.down.shape[1])
        self.calls = 0

    def forward(
        self, x: torch.Tensor, flat_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] fp32, flat_ids [T, K] int32, weights [T, K] fp32, all on the host."""
        for name, t in (("x", x), ("flat_ids", flat_ids), ("weights", weights)):
            if t.device.type != "cpu":
                raise RuntimeError(f"CPU executor: {name} is on {t.device}, not the host")
        if x.dtype != torch.float32 or weights.dtype != torch.float32:
            raise TypeError("CPU executor: x and weights must be fp32")
        if flat_ids.dtype != torch.int32 or flat_ids.shape != weights.shape:
            raise TypeError("CPU executor: flat_ids must be int32 [T, K] like weights")
        if x.shape[1] != self.hidden or x.shape[0] != flat_ids.shape[0]:
            raise ValueError(f"CPU executor: x {tuple(x.shape)} vs ids {tuple(flat_ids.shape)}")
        self.calls += 1
        return x.new_zeros((x.shape[0], self.hidden))


class InlinePool:
    """Runs a submitted call at once in the caller's thread. The fake mode is not thread-safe
    (a FakeTensor reports device ``meta`` to other threads while the mode dispatches), so on
    the fake device the hybrid CPU branch runs inline: placement and shapes are what is
    checked there, not overlap."""

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # delivered by .result(), as a pool would
            fut.set_exception(e)
        return fut
