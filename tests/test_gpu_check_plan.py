"""tests/gpu/check.sh's plan, from its dry run (nothing installed, built or run): the step limits
add up within the deadline, the GPU-only probes come before the broad pytest files, and the
header comment states every step's limit as the plan has it. The probes check.sh names exist in
tests/gpu/probes.py, and the ones added for the CUDA fixes (copy-list hold, pinning's refused
calls, the VRAM watcher, the slot-cache kernel under a long decode) run in their CPU smoke mode."""

from __future__ import annotations

import importlib.util
import itertools
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
    assert {"kernels", "slotstress", "sync", "prefill", "memory", "zerocopy", "park",
            "hybrid"} <= set(names)  # fmt: skip
    assert names.index("backends") > names.index("hybrid")  # the broad equality tests last
    assert names.index("slotstress") == names.index("kernels") + 1  # its compiles cached
    # what it would skip here is said (a CI machine has no CUDA device)
    assert "WOULD SKIP" in out
    if "no CUDA device" not in out:
        assert "WOULD SKIP nothing" in out or "compute-sanitizer" in out


def test_header_states_each_limit_and_a_short_deadline_is_flagged(
    plan: tuple[list[tuple[str, str, int]], str],
) -> None:
    steps, _ = plan
    lines = SCRIPT.read_text().splitlines()
    header = "\n".join(itertools.takewhile(lambda line: line.startswith("#"), lines))
    for name, _, limit in steps:
        assert re.search(rf"\b{name} {limit}\b", header), f"header: no '{name} {limit}'"
    total = sum(limit for _, _, limit in steps)
    assert f"add up to {total} s" in header
    _, out = _dry_run(DEADLINE_S=str(total - 1))
    assert "OVER the" in out


def test_the_probes_check_sh_names_exist() -> None:
    """Every ``probes.py`` subcommand check.sh runs is one, the four fixes' probes among them."""
    named = set()
    for line in SCRIPT.read_text().splitlines():
        m = re.search(r'"\$\{probes\[@\]\}" (.*)$', line)
        if m:
            words = m.group(1).split()  # the probes, then options (--budget ...)
            named |= set(itertools.takewhile(re.compile(r"[a-z][a-z-]*").fullmatch, words))
    spec = importlib.util.spec_from_file_location("gpu_probes", SCRIPT.parent / "probes.py")
    assert spec is not None and spec.loader is not None
    probes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probes)
    assert named and named <= set(probes.PROBES), named - set(probes.PROBES)
    assert {"copylist", "pinerrors", "vram", "slotstress"} <= named


def test_the_fixes_probes_smoke_on_the_cpu(tmp_path: Path) -> None:
    """The new probes on the CPU stand-in (the API they drive; the device checks n/a): each
    passes, and the copy-list control shows the race without the hold."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT.parent / "probes.py"), "copylist", "pinerrors", "vram",
         "slotstress", "--device", "standin", "--steps", "3", "--work", str(tmp_path / "w"),
         "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    verdicts = [line for line in out.stdout.splitlines() if line.startswith("VERDICT: ")]
    assert len(verdicts) == 5 and verdicts[-1].startswith("VERDICT: PASS copylist, pinerrors")
    assert "without the hold the slots come out wrong" in out.stdout
