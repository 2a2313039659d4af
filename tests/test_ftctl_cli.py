"""ftctl's command line: the global options (--json, --socket) go before or after the command,
as git, docker and kubectl users type them (issue 15). No daemon needed: a socket path where
nothing listens gives the one-line error that names it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftctl.main import build_parser, main


def parse(*argv: str):  # type: ignore[no-untyped-def]
    """The namespace a command sees (main() fills the defaults of options given nowhere)."""
    args = build_parser().parse_args(list(argv))
    args.json, args.socket = getattr(args, "json", False), getattr(args, "socket", None)
    return args


@pytest.mark.parametrize(
    "argv",
    [
        ("--json", "--socket", "S", "status"),
        ("--socket", "S", "status", "--json"),
        ("status", "--json", "--socket", "S"),
        ("--json", "models", "--socket", "S", "list"),
        ("models", "--json", "load", "DIR", "--socket", "S"),
        ("--socket", "S", "cache", "--moe", "8", "--json"),
    ],
)
def test_global_options_anywhere(argv: tuple[str, ...]) -> None:
    args = parse(*argv)
    assert args.json is True and args.socket == "S"


def test_defaults_when_not_given() -> None:
    args = parse("models", "load", "DIR")
    assert args.json is False and args.socket is None
    assert parse("--json", "bench", "cache", "--trace", "t.csv").json is True
    assert parse("bench", "cache", "--trace", "t.csv").json is False


@pytest.mark.parametrize("before", [True, False])
def test_socket_before_the_command_reaches_the_client(
    before: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sock = str(tmp_path / "nothing.sock")
    argv = (
        ["--json", "--socket", sock, "status"] if before else ["status", "--json", "--socket", sock]
    )
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ftctl: no daemon listening at {sock}") and err.count("\n") == 1
