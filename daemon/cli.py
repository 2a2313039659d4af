"""``freetokend``: the inference daemon's command line."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import signal
import sys
from typing import Any

from .config import ConfigError, Setting, resolve, settings
from .formats import gguf_early
from .runtime import readahead

DESCRIPTION = """\
Serve a Mixture-of-Experts model over HTTP: OpenAI (/v1/chat/completions, /v1/completions,
/v1/responses, /v1/models), Anthropic (/v1/messages, /v1/messages/count_tokens), /health and
/metrics (Prometheus).

Settings come from, highest first: these flags, FREETOKEN_<KEY> environment variables
(e.g. FREETOKEN_PORT=8080), the --config TOML file (keys mirror the flags: port = 8080,
max_queue = 16), then the defaults shown below.
"""

EPILOG = """\
examples:
  freetokend                                 # the built-in tiny model on 127.0.0.1:1919
  freetokend --model ~/models/Qwen3-30B-A3B --port 8000
  freetokend --config /etc/freetoken/daemon.toml

SIGTERM drains: new requests get 503, requests in flight finish (up to --drain-timeout
seconds), then the daemon exits 0.
"""


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=MODEL, got {text!r}")
    return name.strip(), value.strip()


class _Pairs(argparse.Action):
    """A repeatable NAME=VALUE flag that collects a dict (a table in TOML)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest) or {}), **dict([values])})


def _add_flag(group: Any, s: Setting) -> None:
    """One setting's flag; its value is None when not given, so lower layers can fill it."""
    default = s.default_text
    kw: dict[str, Any] = {
        "dest": s.key,
        "help": f"{s.help} (default: {default})" if default is not None else s.help,
    }
    if s.metavar:
        kw["metavar"] = s.metavar
    if s.choices:
        kw["choices"] = s.choices
    if s.kind in ("int", "float"):
        kw["type"] = int if s.kind == "int" else float
    elif s.kind == "bool":
        kw.update(type=_bool, metavar=s.metavar or "BOOL")
    elif s.kind == "list":
        kw["action"] = "append"
    elif s.kind == "dict":
        kw.update(type=_pair, action=_Pairs)
    group.add_argument(s.flag, **kw)


def build_parser() -> argparse.ArgumentParser:
    """Every DaemonConfig field as a flag (config.settings: name, kind, default, help), then
    --config."""
    p = argparse.ArgumentParser(
        prog="freetokend",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=None,  # None = not given, so lower layers can fill it
    )
    groups: dict[str | None, Any] = {None: p}
    for s in settings():
        if s.section not in groups:
            groups[s.section] = p.add_argument_group(s.section)
        _add_flag(groups[s.section], s)
    p.add_argument("--config", metavar="FILE", help="TOML settings file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    config_file = args.pop("config")
    try:
        cfg = resolve(args, config_file)
    except ConfigError as e:
        print(f"freetokend: {e}", file=sys.stderr)
        return 2
    # the experts go into their banks while the imports run, where the load is likely to take
    # them, and the disk reads the file ahead meanwhile: the loader's own tensors first, so a
    # cold start can serve while the experts are still read (gguf_early)
    fill = gguf_early.start(cfg)
    if cfg.model and cfg.disk_tier != "on":
        readahead.start(cfg.model, None if fill is None else gguf_early.dense_ranges(fill.header))
    # The imports below create ~220k objects that live as long as the process, and the cyclic
    # collector would walk them again and again as they arrive (0.3-0.5 s of CPU, measured on
    # a 2-core EPYC) to free ~7k: off while they run, then frozen (never walked again, also
    # not by the full collections of a serving daemon) and back on.
    gc.disable()
    # deferred: torch (the CLI and `import freetokend` start without it)
    from .server.logs import configure_logging

    # deferred: torch (the CLI and `import freetokend` start without it)
    from .server.run import serve

    gc.freeze()
    gc.enable()
    configure_logging()
    _stack_dumps_on_sigusr1()
    return serve(cfg)


def _stack_dumps_on_sigusr1() -> None:
    """`kill -USR1 <pid>` writes every thread's Python stack to stderr (the journal under
    systemd): what a hung daemon is doing, without stopping it."""

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


if __name__ == "__main__":
    sys.exit(main())
