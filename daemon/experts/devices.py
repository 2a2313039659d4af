"""Choosing the accelerator by name: the real CUDA device, the CPU stand-in, or the fake CUDA
card (``fakecuda/``), which builds on the accelerator classes and so lives beside them, not
inside ``accelerator.py``."""

from __future__ import annotations

import torch

from .accelerator import Accelerator, CudaAccelerator, StandinAccelerator
from .fakecuda import FakeCudaAccelerator

ACCELERATORS = ("auto", "standin", "cuda", "fake-cuda")


def create_accelerator(name: str, vram_mib: int | None = None) -> Accelerator:
    """``vram_mib``: the simulated card of ``fake-cuda`` (enter the returned accelerator as a
    context manager around everything that touches the device)."""
    if name not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; choose one of {', '.join(ACCELERATORS)}")
    if name == "fake-cuda":
        if vram_mib is None:
            raise ValueError("accelerator 'fake-cuda' needs vram_mib (the simulated card)")
        return FakeCudaAccelerator(vram_mib)
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return CudaAccelerator()
    return StandinAccelerator()
