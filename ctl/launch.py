"""``ftctl launch claude|codex|opencode|openclaw``: point a coding agent at the daemon, run it.

Writes the agent's provider configuration (see ``ftctl.agents``) for the daemon's API address,
active model and API key (asked over the admin socket, or --url/--model/--api-key), then runs
the agent with it. The files hold the key: they are written 0600 in 0700 folders.
``--dry-run`` prints the files, environment and command instead; arguments after ``--`` go to
the agent (``ftctl launch codex -- --full-auto``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

from .agents import AGENTS, KEY_ENV, build, config_home
from .client import AdminClient, CtlError, pb
from .output import add_common, print_json


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("launch", help="run a coding agent against the daemon")
    p.add_argument("agent", choices=AGENTS)
    p.add_argument("--dry-run", action="store_true", help="print the configuration, run nothing")
    p.add_argument("--url", help="daemon API address (default: asked from the daemon)")
    p.add_argument("--model", help="model id (default: the daemon's active model)")
    p.add_argument("--context", type=int, default=0, help="context window to announce")
    p.add_argument(
        "--api-key",
        help="the daemon's API key (default: $FREETOKEN_API_KEY, else asked from the daemon)",
    )
    add_common(p)
    p.set_defaults(run=run)
    return p


def _daemon_target(args: argparse.Namespace) -> tuple[str, str, int, str]:
    """(API URL, model, context window, API key): what was given, the rest from the daemon."""
    url, model, context = args.url, args.model, args.context
    key = args.api_key or os.environ.get(KEY_ENV, "")
    if not (url and model and context):
        with AdminClient(args.socket) as client:
            status = client.call("Status", pb.StatusRequest())
            models = client.call("ListModels", pb.ListModelsRequest()).models
        url = url or status.http_url
        model = model or status.active_model
        key = key or status.api_key
        if not context:
            context = next((m.max_model_len for m in models if m.name == model), 32768)
        if not url:
            raise CtlError("the daemon does not listen for API requests yet; retry shortly")
    # an agent on this machine reaches a wildcard listener through loopback
    return url.replace("://0.0.0.0:", "://127.0.0.1:"), model, int(context), key


def _write_private(path: Path, text: str) -> None:
    """``text`` into ``path`` (0600, its folder 0700), replacing it atomically."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)  # an older file of the same name kept its mode
        f.write(text)
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> int:
    url, model, context, key = _daemon_target(args)
    extra = list(getattr(args, "passthrough", []))
    launch = build(args.agent, url, model, context, config_home(), extra, key)
    if args.dry_run or args.json:
        data = {
            "agent": launch.agent,
            "command": launch.argv,
            "env": launch.env,
            "files": {str(p): text for p, text in launch.files.items()},
        }
        if args.json:
            print_json(data)
        else:
            for path, text in launch.files.items():
                print(f"# {path}\n{text}")
            env = " ".join(f"{k}={v}" for k, v in launch.env.items())
            print(f"# command\n{env + ' ' if env else ''}{' '.join(launch.argv)}")
        if args.dry_run:
            return 0
    for path, text in launch.files.items():
        _write_private(path, text)
    if shutil.which(launch.argv[0]) is None:
        written = ", ".join(str(p) for p in launch.files)
        raise CtlError(f"{launch.argv[0]} is not installed (configuration written: {written})")
    return subprocess.call(launch.argv, env={**os.environ, **launch.env})
