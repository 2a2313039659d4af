"""config/freetokend.toml documents every DaemonConfig field with its default, and loads."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import msgspec
import pytest

from freetokend.config import FIELDS, ConfigError, DaemonConfig, resolve

CONFIG = Path(__file__).resolve().parents[1] / "config" / "freetokend.toml"
_COMMENTED = re.compile(r"^#\s*([a-z_]+)\s*=\s*(.+)$")


def _commented_keys(text: str) -> dict[str, str]:
    return {m[1]: m[2] for line in text.splitlines() if (m := _COMMENTED.match(line.strip()))}


def test_file_and_struct_agree() -> None:
    text = CONFIG.read_text(encoding="utf-8")
    values = tomllib.loads(text)
    commented = _commented_keys(text)
    defaults = msgspec.structs.asdict(DaemonConfig())
    # every field appears exactly once: set to its default, or commented out when unset
    assert set(values) | set(commented) == set(FIELDS)
    assert not set(values) & set(commented)
    for key, value in values.items():
        assert value == defaults[key], key
        assert type(value) is type(defaults[key]), key
    for key, example in commented.items():
        assert defaults[key] is None, f"{key} is commented out but has a default"
        # the example is a valid value for the field
        msgspec.convert({key: tomllib.loads(f"x = {example}")["x"]}, DaemonConfig)


def _key_of(line: str) -> str | None:
    m = re.match(r"^#?\s*([a-z_]+)\s*=", line.strip())
    return m[1] if m and m[1] in FIELDS else None


def test_every_key_is_documented() -> None:
    """A comment precedes each key, or the group of keys it belongs to (host/port, vram_*)."""
    lines = CONFIG.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if (key := _key_of(line)) is not None:
            j = i - 1
            while j >= 0 and _key_of(lines[j]) is not None:
                j -= 1
            assert j >= 0 and lines[j].startswith("# "), f"{key} has no comment above it"


def test_file_loads_with_precedence(tmp_path: Path) -> None:
    cfg = resolve({}, str(CONFIG), env={"FREETOKEN_STATE_DIR": str(tmp_path)})
    assert cfg == DaemonConfig(state_dir=str(tmp_path))
    custom = tmp_path / "f.toml"
    custom.write_text("port = 2000\nmax-queue = 3\nvram_low_mb = 10\nauto_switch = true\n")
    env = {"FREETOKEN_PORT": "3000", "FREETOKEN_VRAM_LOW_MB": "20", "FREETOKEN_STATE_DIR": "/s"}
    cfg = resolve({"port": 4000}, str(custom), env=env)
    assert (cfg.port, cfg.max_queue, cfg.vram_low_mb, cfg.auto_switch) == (4000, 3, 20, True)
    cfg = resolve({}, str(custom), env={"FREETOKEN_STATE_DIR": "/s"})
    assert (cfg.port, cfg.vram_low_mb) == (2000, 10)
    assert resolve({}, None, env={"STATE_DIRECTORY": "/var/lib/ft"}).state_dir == "/var/lib/ft"


def test_unknown_key_and_bad_values_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("vram_lo_mb = 5\n")
    with pytest.raises(ConfigError, match="vram_lo_mb"):
        resolve({}, str(bad), env={})
    for cli, key in (
        ({"vram_low_mb": 5000}, "vram_low_mb"),
        ({"accelerator": "tpu"}, "accelerator"),
        ({"moe_slots": 0}, "moe_slots"),
        ({"host_pool_budget_gb": -1.0}, "host_pool_budget_gb"),
        ({"mixed_step_budget": 0.5}, "mixed_step_budget"),
    ):
        with pytest.raises(ConfigError, match=key):
            resolve(cli, None, env={"FREETOKEN_STATE_DIR": "/s"})
