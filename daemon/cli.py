"""``freetokend``: the inference daemon's command line."""

from __future__ import annotations

import argparse
import sys

from .config import MOE_BACKENDS, QUANTIZE_FORMATS, QUANTIZE_PRESETS, ConfigError, resolve
from .manager.flags import add_control_flags

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="freetokend",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=None,  # None = not given, so lower layers can fill it
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        help="HF or FTW model folder, or a .gguf file (default: the built-in tiny model, "
        "generated on first use)",
    )
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="model id clients send (default: the folder name)",
    )
    p.add_argument("--host", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port; 0 picks a free one (default: 1919)")
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help="state folder: built-in model, databases (default: $FREETOKEN_STATE_DIR, else "
        "$XDG_STATE_HOME/freetoken, else ~/.local/state/freetoken)",
    )
    p.add_argument(
        "--admin-socket",
        metavar="PATH",
        help="admin gRPC unix socket for ftctl (default: $RUNTIME_DIRECTORY/admin.sock under "
        "systemd, else a per-user runtime path; off = none)",
    )
    p.add_argument(
        "--moe-backend",
        choices=MOE_BACKENDS,
        help="where experts run (default: auto: cpu without a GPU)",
    )
    p.add_argument(
        "--quantize-experts",
        choices=QUANTIZE_FORMATS,
        help="quantize float checkpoints' routed experts at load (mxfp4: 4.25 bits a weight, "
        "about 1/4 of the RAM and of the bytes read per token; checkpoints already quantized "
        "load as stored); default: as stored",
    )
    p.add_argument(
        "--quantize",
        choices=QUANTIZE_PRESETS,
        help="quantize float checkpoints' dense layers (GGUF block formats, native integer "
        "dot products on the CPU) and experts at load, by a named mix per tensor class "
        "(models/dense_quant.py); --quantize-experts is the experts-only form",
    )
    p.add_argument(
        "--max-batch", type=int, metavar="N", help="requests decoded together (default: 32)"
    )
    p.add_argument(
        "--max-queue",
        type=int,
        metavar="N",
        help="requests waiting beyond the batch before 429/529 (default: 64)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="context limit in tokens (default: the model's, at most 32768)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        metavar="S",
        help="seconds SIGTERM waits for requests in flight (default: 30)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require this API key (Authorization: Bearer KEY or x-api-key: KEY); repeat for "
        "several keys. Prefer FREETOKEN_API_KEY or the config file: a flag shows in ps "
        "(default: no key)",
    )
    add_control_flags(p)
    p.add_argument("--config", metavar="FILE", help="TOML settings file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    config_file = args.pop("config")
    if args.get("model_aliases"):  # --model-alias pairs -> the config's table
        args["model_aliases"] = dict(args["model_aliases"])
    try:
        cfg = resolve(args, config_file)
    except ConfigError as e:
        print(f"freetokend: {e}", file=sys.stderr)
        return 2
    from .server.logs import configure_logging
    from .server.run import serve

    configure_logging()
    _stack_dumps_on_sigusr1()
    return serve(cfg)


def _stack_dumps_on_sigusr1() -> None:
    """`kill -USR1 <pid>` writes every thread's Python stack to stderr (the journal under
    systemd): what a hung daemon is doing, without stopping it."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


if __name__ == "__main__":
    sys.exit(main())
