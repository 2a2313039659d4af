"""One table-driven loader from HF safetensors into dense parameters plus expert banks.

Reads a single ``model.safetensors`` or a sharded ``model.safetensors.index.json``. Each tensor
is read once and copied into its final, pre-allocated home (a parameter of the model, or a
flat_id-major slice of the expert banks), so loading never holds two copies of the weights.
Per-expert tensors (``experts.<e>.gate_proj``) and fused ones (``experts.gate_up_proj``) are
both accepted; the family's FamilySpec says how names and layouts map.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from ..experts.banks import ExpertBanks
from ..formats.errors import CheckpointError
from ..formats.gguf_file import GgufHeader, is_gguf
from ..formats.safetensors_io import SafetensorsFile, SafetensorsFormatError, TensorInfo
from .config import ModelConfig
from .config_hf import read_config
from .fill import Filler, allocate_banks
from .fp8_weights import Fp8Scales
from .fp8_weights import block_size as fp8_block_size
from .ftw_loader import load_ftw
from .gguf_loader import GgufCheckpoint, load_gguf
from .model import CausalLM, build_model
from .registry import family_spec
from .release_dense import DenseScales

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointError",
    "load_model",
    "model_config",
    "model_kind",
]


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).exists()]
        if missing:
            raise CheckpointError(f"{index}: shard file {missing[0]} is missing")
        return [model_dir / f for f in files]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


class _Source:
    """One checkpoint tensor, read on demand: straight into a destination when layouts agree."""

    def __init__(self, f: SafetensorsFile, info: TensorInfo) -> None:
        self.f, self.info = f, info
        self.shape, self.dtype = info.shape, info.dtype

    def read(self) -> torch.Tensor:
        try:
            return self.f.read(self.info)
        except (SafetensorsFormatError, OSError) as e:
            raise CheckpointError(
                f"{self.f.path}: tensor '{self.info.name}' cannot be read ({e})"
            ) from None

    def into(self, dest: torch.Tensor) -> None:
        if dest.is_contiguous() and dest.dtype == self.dtype:
            try:
                self.f.read_into(self.info, dest)
                return
            except (SafetensorsFormatError, OSError) as e:
                raise CheckpointError(
                    f"{self.f.path}: tensor '{self.info.name}' cannot be read ({e})"
                ) from None
        dest.copy_(self.read())


def _tensors(path: Path) -> Iterator[tuple[str, _Source]]:
    try:
        f = SafetensorsFile(path)
    except (SafetensorsFormatError, OSError) as e:
        raise CheckpointError(f"{path}: corrupt or unreadable safetensors file ({e})") from None
    with f:
        for name, info in f.tensors.items():
            yield name, _Source(f, info)


def model_kind(path: str | Path) -> str:
    """``gguf`` (a GGUF file or split set), ``ftw`` or ``hf`` (a folder); a clear error for
    anything else."""
    p = Path(path)
    expected = "expected a model folder (config.json + safetensors), an FTW folder or a .gguf file"
    if p.is_dir():
        return "ftw" if (p / "ftw.json").exists() else "hf"
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder; {expected}")

    try:
        if is_gguf(p):
            return "gguf"
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e.strerror}); {expected}") from None
    raise CheckpointError(f"{p}: a file that is not a GGUF checkpoint (wrong magic); {expected}")


def model_config(
    path: str | Path, dtype: str | None = None, gguf_headers: list[GgufHeader] | None = None
) -> ModelConfig:
    """The ModelConfig of any checkpoint ``load_model`` reads (``dtype``: override the weights'
    dtype in memory; ``gguf_headers``: a GGUF's headers parsed before, gguf_file.read_headers)."""
    if model_kind(path) == "gguf":
        with GgufCheckpoint(path, gguf_headers) as ck:
            return ck.config(dtype)
    cfg = read_config(path)
    if dtype is not None and dtype != cfg.torch_dtype:
        cfg = dataclasses.replace(cfg, torch_dtype=dtype)
    return cfg


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig | None = None,
    gguf_headers: list[GgufHeader] | None = None,
    expert_cache_bytes: int | None = None,
    interleave_experts: bool = False,
    host_only: bool = False,
) -> tuple[CausalLM, ExpertBanks]:
    """(model, expert banks) from an HF folder, an FTW folder or a GGUF file / split set
    (``gguf_headers``: its headers parsed before, gguf_file.read_headers). ``expert_cache_bytes``
    (the disk tier, GGUF only for now): the routed experts stay in the file, the banks hold no
    weights and carry the tier (``ExpertBanks.disk``) with a RAM cache of about that size.
    ``interleave_experts``: the banks are the cpu backend's alone; block banks may then be
    filled interleaved (GGUF: ``load_gguf``; elsewhere the backend interleaves them after).
    ``host_only``: the dense part stays on the host (the cpu backend): a GGUF's token embedding
    may then stay in its blocks (``load_gguf``)."""
    model_dir = Path(model_dir)
    kind = model_kind(model_dir)
    if kind == "gguf":
        return load_gguf(
            model_dir, cfg, gguf_headers, expert_cache_bytes, interleave_experts, host_only
        )
    if expert_cache_bytes is not None:
        raise CheckpointError(
            f"{model_dir}: the disk tier (experts read from the file on demand) reads GGUF "
            f"files only for now, not {'FTW' if kind == 'ftw' else 'safetensors'} folders"
        )
    if kind == "ftw":  # pre-laid-out FTW folder (ARCHITECTURE §7)
        stored = read_config(model_dir).torch_dtype
        if cfg is not None and cfg.torch_dtype != stored:
            raise CheckpointError(
                f"{model_dir}: an FTW folder loads in its stored dtype ({stored})"
            )

        return load_ftw(model_dir, cfg)
    cfg = cfg or read_config(model_dir)
    spec = family_spec(cfg.family)
    model = build_model(cfg)
    banks = allocate_banks(cfg)
    filler = Filler(cfg, spec, model, banks)
    files = checkpoint_files(model_dir)
    # fine-grained FP8 dense weights and their block scales, paired across shards
    fp8 = Fp8Scales.find(
        files, fp8_block_size(cfg.raw), skip=lambda n: filler.ignored(n) or filler.mtp(n)
    )
    # a release's packed NVFP4 / INT4 dense weights (not routed experts) and their scales
    packed = DenseScales.find(
        files,
        filler.release.rq if filler.release is not None else None,
        skip=lambda n: filler.ignored(n) or filler.mtp(n) or filler.routed_expert(n),
    )
    mtp_skipped = 0
    for path in files:
        for name, src in _tensors(path):
            if filler.ignored(name) or name in fp8.scale_names or name in packed.sidecars:
                continue
            if filler.mtp(name):
                mtp_skipped += 1
                continue
            in_packed = name in packed.by_weight
            canon = filler.canonical(packed.weight_name(name) if in_packed else name)
            if canon is None:
                raise CheckpointError(f"{path}: unexpected tensor '{name}'")
            if name in fp8.by_weight:
                filler.put(name, canon, fp8.wrap(name, src, path), path)
            elif in_packed:
                filler.put(name, canon, packed.wrap(name, src, path), path)
            else:
                filler.put(name, canon, src, path)
    filler.verify()
    for line in (fp8.summary(), packed.summary()):
        if line is not None:
            log.info("%s: %s", model_dir, line)
    if filler.release is not None:
        log.info(
            "%s: routed experts read packed as %s (%s); their %d activation scale tensors "
            "ignored (activations are not quantized here)",
            model_dir,
            banks.format,
            filler.release.rq.method,
            filler.release.ignored,
        )
    if mtp_skipped:
        log.info(
            "%s: skipped %d tensors of %d multi-token-prediction layer(s) (not used yet)",
            model_dir,
            mtp_skipped,
            cfg.num_mtp_layers,
        )
    model.eval()
    return model, banks
