"""Shared by the native executor tests: one torch thread for the references, ISA skips."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from freetokend.experts.cpu_executor import supported_isas


@pytest.fixture(autouse=True, scope="module")
def single_threaded_reference() -> Iterator[None]:
    """The references' many tiny matmuls are slow with torch's spinning OpenMP threads on a busy
    machine; one thread keeps these files fast. Restored afterwards. (Autouse in every module
    that imports it.)"""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def need_isa(isa: str) -> None:
    """Skip unless this CPU runs ``isa`` (emu512 runs anywhere)."""
    if isa != "emu512" and isa not in supported_isas():
        pytest.skip(f"this CPU lacks {isa} (supports {supported_isas()})")
