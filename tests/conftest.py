"""Shared fixtures. Keep this file small: fixtures only."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def builtin_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny Qwen3.5-MoE checkpoint, generated once per test session."""
    from freetokend.models.builtin import ensure_builtin_model

    return ensure_builtin_model(tmp_path_factory.mktemp("state"))
