"""Shared fixtures, and the opt-in switch for slow tests. Keep this file small."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The checkout's root must not be importable as a folder of modules: its `kernels/` (installed as
# `ftkernels`) would shadow the PyPI package `kernels` that transformers (>= 5.25) imports, and
# every transformers oracle would fail with "cannot import name 'CUDAProperties' from 'kernels'".
# `python -m pytest` puts the working directory first on sys.path; take it off here, and keep
# child processes started from the checkout (`python -m freetokend.cli`, cwd=REPO) from adding it.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
os.environ["PYTHONSAFEPATH"] = "1"
# No test reaches the network: transformers' kernels from the Hub (its `kernels` package) off.
os.environ.setdefault("USE_HUB_KERNELS", "NO")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Property tests draw the same examples on every run of `make test`, so CI is reproducible and
# a red run is never bad luck; `make fuzz` draws fresh ones (the "explore" profile) to look for
# new counterexamples, which then become @example lines. No per-example deadline (Hypothesis'
# default is 200 ms) and no too-slow data-generation check: on a loaded machine a slow example
# is not a failing one.
_UNTIMED = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", derandomize=True, print_blob=True, **_UNTIMED)
settings.register_profile("explore", derandomize=False, print_blob=True, **_UNTIMED)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def builtin_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny Qwen3.5-MoE checkpoint, generated once per test session."""
    from freetokend.models.builtin import ensure_builtin_model

    return ensure_builtin_model(tmp_path_factory.mktemp("state"))


# --- opt-in slow tests (real agent clients, schemathesis): `pytest --runslow` or FT_RUN_SLOW=1


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--runslow",
        action="store_true",
        default=False,
        help="also run tests marked slow (or set FT_RUN_SLOW=1)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow") or os.environ.get("FT_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow test: run with --runslow or FT_RUN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def experts_dequantized(monkeypatch):
    """Experts loaded dequantized, whatever their type: these tests check placement and layout
    through transformers, whose experts compute on float weights. Experts kept in their blocks
    have their own tight oracle (a torch reference of the block kernels, test_gguf_experts.py);
    dense projections kept in blocks run the kernels' reference in transformers here
    (``int_dot_reference``)."""
    from freetokend.models import gguf_experts

    monkeypatch.setattr(gguf_experts, "block_expert_format", lambda *a: None)
