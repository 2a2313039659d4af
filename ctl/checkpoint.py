"""`ftctl checkpoint`: convert a model folder into FTW, the pre-laid-out weight format (ARCHITECTURE §7).

    ftctl checkpoint --model DIR --out DIR [--force] [--quantize-experts mxfp4|nvfp4|fp8_block|q8_0|q6_k|q5_k|q4_k|q5_0|q4_0]

Loads the model (HF safetensors, or an FTW folder), writes the FTW folder atomically with a
progress bar of bytes written and verified, and prints the result. On error: exit status 1 and a
one-line reason on stderr; an interrupted conversion leaves nothing at ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("checkpoint", help="convert a model folder to FTW (fast loading)")
    p.add_argument(
        "--model", required=True, help="model folder (HF safetensors or FTW) or a .gguf file"
    )
    p.add_argument("--out", required=True, help="FTW folder to create")
    p.add_argument("--force", action="store_true", help="replace an existing FTW folder at --out")
    p.add_argument(
        "--quantize-experts",
        choices=("fp8_block", "mxfp4", "nvfp4", "q8_0", "q4_k"),
        help="store a float checkpoint's routed experts quantized (mxfp4: 4.25 bits a weight); "
        "the daemon then loads them as stored, without quantizing at every start",
    )
    p.set_defaults(run=run)
    return p


def _fail(reason: object) -> int:
    print(f"ftctl checkpoint: {' '.join(str(reason).split())}", file=sys.stderr)
    return 1


def _progress_bar() -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description:<8}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )


def run(args: argparse.Namespace) -> int:
    model, out = Path(args.model), Path(args.out)
    from freetokend.checkpoint.ftw_write import check_destination
    from freetokend.models.config import ConfigError
    from freetokend.models.ftw_convert import convert
    from freetokend.models.loader import CheckpointError, model_config

    try:
        model_config(model)  # fail before the bar on the cheap checks (folder or GGUF file)
        check_destination(out.absolute(), args.force)
        with _progress_bar() as bar:
            loading = bar.add_task("load", total=None)
            tasks: dict[str, Any] = {}

            def progress(phase: str, done: int, total: int) -> None:
                if phase not in tasks:
                    if loading in bar.task_ids:
                        bar.remove_task(loading)
                    tasks[phase] = bar.add_task(phase, total=total)
                bar.update(tasks[phase], completed=done)

            index = convert(
                model,
                out,
                force=args.force,
                progress=progress,
                quantize_experts=args.quantize_experts,
            )
    except (CheckpointError, ConfigError, OSError, ValueError) as e:
        return _fail(e)
    except KeyboardInterrupt:
        return _fail(f"interrupted; nothing was written to {out}") + 129
    size = sum(index.files.values())
    print(
        f"wrote {out} ({len(index.tensors)} tensors, {size / 2**30:.2f} GiB, "
        f"experts {index.expert_format}, fingerprint {index.fingerprint[:16]})"
    )
    return 0
