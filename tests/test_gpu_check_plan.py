"""tests/gpu/check.sh's plan, from its dry run (nothing installed, built or run): the step limits
add up within the deadline, the GPU-only probes come before the broad pytest files, and the
header comment states every step's limit as the plan has it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "gpu" / "check.sh"
STEP = re.compile(r"^\s+(\d+)\s+(\S+)\s+(setup|gpu|after|broad)\s+(\d+)\s")


def _dry_run(**env: str) -> tuple[list[tuple[str, str, int]], str]:
    out = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    steps = []
    for line in out.splitlines():
        m = STEP.match(line)
        if m:
            assert int(m.group(1)) == len(steps) + 1, line  # listed in run order
            steps.append((m.group(2), m.group(3), int(m.group(4))))
    return steps, out


@pytest.fixture(scope="module")
def plan() -> tuple[list[tuple[str, str, int]], str]:
    return _dry_run()


def test_limits_fit_the_deadline_and_gpu_probes_run_first(
    plan: tuple[list[tuple[str, str, int]], str],
) -> None:
    steps, out = plan
    deadline = int(re.search(r"within the (\d+) s deadline", out).group(1))  # type: ignore[union-attr]
    assert sum(limit for _, _, limit in steps) <= deadline
    assert f"TOTAL {sum(limit for _, _, limit in steps)} s" in out
    order = [cls for _, cls, _ in steps]
    rank = {"setup": 0, "gpu": 1, "after": 2, "broad": 3}
    assert order == sorted(order, key=rank.__getitem__), order  # setup, gpu, after, broad
    names = [name for name, _, _ in steps]
    assert {"kernels", "sync", "prefill", "memory", "zerocopy", "park", "hybrid"} <= set(names)
    assert names.index("backends") > names.index("hybrid")  # the broad equality tests last
    # what it would skip here is said (a CI machine has no CUDA device)
    assert "WOULD SKIP" in out
    if "no CUDA device" not in out:
        assert "WOULD SKIP nothing" in out or "compute-sanitizer" in out


def test_header_states_each_limit_and_a_short_deadline_is_flagged(
    plan: tuple[list[tuple[str, str, int]], str],
) -> None:
    steps, _ = plan
    header = "\n".join(
        line for line in SCRIPT.read_text().splitlines()[:60] if line.startswith("#")
    )
    for name, _, limit in steps:
        assert re.search(rf"\b{name} {limit}\b", header), f"header: no '{name} {limit}'"
    total = sum(limit for _, _, limit in steps)
    assert f"add up to {total} s" in header
    _, out = _dry_run(DEADLINE_S=str(total - 1))
    assert "OVER the" in out
