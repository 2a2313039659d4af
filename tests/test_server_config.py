"""Daemon settings: defaults < TOML file < environment < command line; clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from freetokend.cli import build_parser, main
from freetokend.config import ConfigError, default_state_dir, resolve


def cli(*argv: str) -> dict:
    args = vars(build_parser().parse_args(list(argv)))
    args.pop("config")
    return args


def test_precedence_cli_over_env_over_file(tmp_path: Path):
    f = tmp_path / "d.toml"
    f.write_text('port = 7000\nhost = "0.0.0.0"\nmax-queue = 5\nmoe_backend = "cpu"\n')
    env = {"FREETOKEN_PORT": "7100", "FREETOKEN_MAX_BATCH": "3", "FREETOKEN_STATE_DIR": "/s"}
    cfg = resolve(cli("--port", "7200"), str(f), env)
    assert cfg.port == 7200  # cli
    assert cfg.max_batch == 3  # env
    assert (cfg.host, cfg.max_queue, cfg.moe_backend) == ("0.0.0.0", 5, "cpu")  # file
    assert cfg.state_dir == "/s"
    assert resolve(cli(), str(f), env).port == 7100
    assert resolve(cli(), str(f), {}).port == 7000
    default = resolve(cli(), None, {"HOME": "/h"})
    assert (default.port, default.host, default.moe_backend) == (1919, "127.0.0.1", "auto")


def test_unknown_or_bad_keys_are_named(tmp_path: Path):
    f = tmp_path / "d.toml"
    f.write_text("prot = 1\n")
    with pytest.raises(ConfigError, match="prot"):
        resolve(cli(), str(f), {})
    f.write_text('port = "high"\n')
    with pytest.raises(ConfigError, match="port"):
        resolve(cli(), str(f), {})
    with pytest.raises(ConfigError, match="max_batch"):
        resolve(cli(), None, {"FREETOKEN_MAX_BATCH": "lots"})
    with pytest.raises(ConfigError, match="moe_backend"):
        resolve({}, None, {"FREETOKEN_MOE_BACKEND": "gpu"})
    with pytest.raises(ConfigError, match="max_queue"):
        resolve(cli("--max-queue", "-1"), None, {})
    for bad in ("anchor", "interval:0", "interval:x"):
        with pytest.raises(ConfigError, match="snapshot_policy"):
            resolve(cli("--snapshot-policy", bad), None, {})
    with pytest.raises(ConfigError, match="spill_budget_mb"):
        resolve(cli("--spill-budget-mb", "-1"), None, {})
    ok = resolve(cli("--snapshot-policy", "interval:64", "--prefix-cache", "off"), None, {})
    assert (ok.snapshot_policy, ok.prefix_cache) == ("interval:64", False)


def test_state_dir_defaults():
    assert default_state_dir({"FREETOKEN_STATE_DIR": "/a"}) == Path("/a")
    assert default_state_dir({"XDG_STATE_HOME": "/x"}) == Path("/x/freetoken")
    assert default_state_dir({}) == Path.home() / ".local/state/freetoken"


def test_help_and_config_errors(capsys, tmp_path: Path):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--model",
        "--host",
        "--port",
        "--state-dir",
        "--admin-socket",
        "--moe-backend",
        "--config",
        "--max-queue",
        "--max-batch",
    ):
        assert flag in out
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = not toml =\n")
    assert main(["--config", str(bad)]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_every_setting_has_a_flag_with_help(capsys):
    """The flags come from DaemonConfig's fields (config.settings): each field has one, with
    its help text and, where the field has a plain default, that default."""
    from freetokend.config import FIELDS, settings

    actions = {a.dest: a for a in build_parser()._actions}
    assert [s.key for s in settings()] == list(FIELDS)
    for s in settings():
        action = actions.get(s.key)
        assert action is not None, f"{s.key} has no flag"
        assert s.flag in action.option_strings
        assert s.help and s.help in (action.help or ""), s.key
        if s.default_text is not None:
            assert (action.help or "").endswith(f"(default: {s.default_text})"), s.key
        if s.choices:
            assert tuple(action.choices or ()) == s.choices, s.key
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for s in settings():
        assert s.flag in out


def test_flags_give_every_kind_of_value():
    args = cli(
        "--cuda-graphs", "on", "--huge-pages", "no", "--attention-kernel", "triton",
        "--allowed-hosts", "a.example", "--allowed-hosts", "b.example",
        "--model-alias", "fast=/m/a", "--model-alias", " slow = /m/b ",
        "--api-key", "k1", "--api-key", "k2", "--drain-timeout", "1.5",
    )  # fmt: skip
    cfg = resolve(args, None, {"FREETOKEN_STATE_DIR": "/s"})
    assert (cfg.cuda_graphs, cfg.huge_pages, cfg.attention_kernel) == (True, False, "triton")
    assert cfg.allowed_hosts == ["a.example", "b.example"]
    assert cfg.model_aliases == {"fast": "/m/a", "slow": "/m/b"}
    assert (cfg.api_keys, cfg.drain_timeout) == (("k1", "k2"), 1.5)
    for bad in (("--cuda-graphs", "maybe"), ("--model-alias", "x"), ("--moe-backend", "gpu")):
        with pytest.raises(SystemExit):
            cli(*bad)
