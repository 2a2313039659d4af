"""``ftctl bench bw`` in the daemon: measure the disk's read rate B_D on the active model's
weights file as the disk tier reads it (formats/disk_rate.py), then B_P and B_H on its expert
pool with the real copy path and the real CPU executor; store the profile, and give the running
hybrid backend the new q* ratio.

It runs at a safe point with admission paused and no request running, so serving traffic does
not distort the measurement (and the measurement does not slow requests down). The disk goes
first: B_P and B_H do not read the file, and the disk tier's reads are idle then too.

The file read is the one the model's experts live in (``experts_file``): a GGUF file (the
largest part of a split set), an FTW folder's experts file, or the largest safetensors file of
a model folder. A file that cannot be read (moved away since the load, empty) leaves B_D at 0
with the reason in ``disk_note``; B_P and B_H are still measured.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from ..checkpoint.ftw_write import EXPERTS_FILE
from ..engine.resize import slot_backend
from ..experts.backend import CpuBackend
from ..experts.bandwidth import measure
from ..experts.devices import create_accelerator
from ..formats.disk_rate import measure_disk_rate
from ..formats.gguf_file import split_files
from ..models.loader import model_kind
from ..runtime import heartbeat
from ..runtime.bandwidth import BandwidthProfile
from .hub import NOT_YET
from .models import ModelManager
from .store_api import ControlStore
from .ticket import Ticket


def _cpu_backend(moe: Any, banks: Any, num_experts: int) -> Any:
    inner = getattr(moe, "inner", moe)
    if isinstance(inner, CpuBackend):
        return inner
    be = slot_backend(inner)
    if be is not None and isinstance(be.cpu, CpuBackend):
        return be.cpu
    return CpuBackend(banks, num_experts, inner.act)


def experts_file(path: Path) -> tuple[Path | None, str]:
    """The file of the model at ``path`` that holds its experts, and what it is (the note
    ``ftctl bench bw`` shows); None, with the reason, when there is none."""
    kind = model_kind(path)
    if kind == "gguf":
        parts = split_files(path)
        if len(parts) == 1:
            return parts[0], "the GGUF file"
        return max(parts, key=lambda p: p.stat().st_size), f"the largest of {len(parts)} GGUF parts"
    if kind == "ftw":
        f = path / EXPERTS_FILE
        return (f, "the FTW folder's experts file") if f.is_file() else (None, f"no {f.name}")
    files = list(path.glob("*.safetensors"))
    if not files:
        return None, "no safetensors file in the folder"
    if len(files) == 1:
        return files[0], "the folder's safetensors file"
    largest = max(files, key=lambda p: p.stat().st_size)
    return largest, f"the largest of the folder's {len(files)} safetensors files"


def disk_fields(path: Path) -> dict[str, Any]:
    """B_D of the model at ``path`` as BandwidthProfile's disk fields (b_d 0 when not measured,
    ``disk_note`` saying why)."""
    try:
        f, note = experts_file(path)
        if f is None:
            return {"b_d": 0.0, "disk_note": f"not measured: {note}"}
        rate = measure_disk_rate(f)
    except (OSError, ValueError) as e:  # moved away since the load, empty, unreadable
        return {"b_d": 0.0, "disk_note": f"not measured: {e}"}
    finally:
        heartbeat.beat()  # at most 256 MiB read: seconds on a slow disk
    return {
        "b_d": rate.bytes_per_s,
        "disk_direct": rate.direct,
        "disk_path": rate.path,
        "disk_note": note,
    }


def bench_bandwidth(manager: ModelManager, store: ControlStore, accelerator: str) -> Ticket:
    """Queue the measurement; the ticket resolves to the stored BandwidthProfile."""
    assert manager.hub is not None

    def attempt() -> BandwidthProfile | object:
        model = manager.active
        if model.lane.core.stats().running:
            return NOT_YET
        llm = model.llm
        be = slot_backend(llm.moe)
        acc = be.acc if be is not None else create_accelerator(accelerator)
        llm.banks.wait_filled()  # (a daemon serving while its experts are read)
        cpu = _cpu_backend(llm.moe, llm.banks, llm.config.num_experts)
        disk = disk_fields(model.path)  # first: the file's reads alone on the disk
        profile = replace(measure(llm.banks, acc, cpu, top_k=llm.config.top_k), **disk)
        store.save_bandwidth(profile)
        if be is not None and be.hybrid:
            be.cache.set_fill_policy(profile.b_p, profile.b_h)
        return profile

    return manager.hub.run_at_safe_point("bench bw", attempt, drain=True)
