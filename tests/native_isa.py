"""Forcing one of ftdense's kernel paths in a test (FREETOKEN_CPU_ISA's choices)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from freetokend.native import dense_native


def force_isa(isa: str, threads: int, selected: Callable[[], str], want: str) -> None:
    """Configures the pool for ``isa`` with ``threads`` (skips the test where this CPU lacks it)
    and checks that the kernel ``selected`` reports is ``want``."""
    try:
        dense_native.configure(threads, isa=isa)
    except ValueError:
        pytest.skip(f"this CPU lacks {isa}")
    assert selected() == want
