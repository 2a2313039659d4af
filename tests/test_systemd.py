"""The systemd files: the unit passes `systemd-analyze verify` without a warning, the sysusers
file creates the user, the tmpfiles lines parse; the unit keeps what the daemon relies on."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SYSTEMD = Path(__file__).resolve().parents[1] / "systemd"
UNIT = SYSTEMD / "freetokend.service"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed")
    return path


def _unit() -> configparser.RawConfigParser:
    p = configparser.RawConfigParser(strict=False, delimiters=("=",))
    p.optionxform = str  # type: ignore[assignment,method-assign]
    p.read_string(UNIT.read_text(encoding="utf-8"))
    return p


def test_unit_verifies(tmp_path: Path) -> None:
    tool = _tool("systemd-analyze")
    daemon = Path(sys.executable).with_name("freetokend")
    if not daemon.exists():
        pytest.skip("the freetokend console script is not installed")
    unit = tmp_path / UNIT.name  # ExecStart must name an existing program on this machine
    unit.write_text(UNIT.read_text().replace("/usr/bin/freetokend", str(daemon)))
    proc = subprocess.run(
        [tool, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert UNIT.name not in proc.stderr + proc.stdout, proc.stderr  # no warning names the unit


def test_unit_contents() -> None:
    svc = _unit()["Service"]
    assert svc["Type"] == "notify" and svc["LimitMEMLOCK"] == "infinity"
    assert svc["StateDirectory"] == "freetokend" and svc["RuntimeDirectory"] == "freetokend"
    assert svc["User"] == "freetokend" and svc["PrivateDevices"] == "no"
    assert "/etc/freetoken/freetokend.toml" in svc["ExecStart"]
    text = UNIT.read_text()
    for node in ("char-nvidia-frontend", "/dev/nvidiactl", "/dev/nvidia-uvm"):
        assert f"DeviceAllow={node} rw" in text
    assert "MemoryDenyWriteExecute=yes" not in text  # Triton/CUDA JIT need W+X pages


def test_sysusers_creates_the_user(tmp_path: Path) -> None:
    tool = _tool("systemd-sysusers")
    (tmp_path / "etc").mkdir()
    proc = subprocess.run(
        [tool, f"--root={tmp_path}", str(SYSTEMD / "freetokend.sysusers")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text()
    assert any(line.startswith("freetokend:") for line in passwd.splitlines())


def test_tmpfiles_lines_apply(tmp_path: Path) -> None:
    tool = _tool("systemd-tmpfiles")
    # tmpfiles resolves users on the host: check the lines with root as the owner
    conf = tmp_path / "ft.conf"
    conf.write_text(
        (SYSTEMD / "freetokend.tmpfiles")
        .read_text()
        .replace(" freetokend freetokend ", " root root ")
    )
    root = tmp_path / "root"
    root.mkdir()
    proc = subprocess.run(
        [tool, f"--root={root}", "--create", str(conf)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert (root / "var/lib/freetokend/models").is_dir() and (root / "etc/freetoken").is_dir()
