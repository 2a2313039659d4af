"""FTW, the fast weight format (DESIGN §4): the checkpoint pre-laid-out in runtime layout.

Not a quantisation: every dense parameter and every flat_id-major expert bank is one raw,
4 KiB-aligned extent (``dense.bin``, ``experts.bin``), indexed by ``ftw.json`` (see
``ftw_index``). ``convert`` writes one from any folder ``load_model`` reads; ``load_ftw``
allocates exact-size tensors, fills them with parallel direct reads and pins the expert banks.
``load_model`` calls ``load_ftw`` for a folder that has ``ftw.json``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..experts.banks import ExpertBanks
from ..experts.formats import FORMATS, get_format
from ..models.config import ModelConfig
from ..models.expert_quant import quantize_experts_at_load
from ..models.layers.common import dtype_of
from ..models.loader import load_model
from ..models.model import CausalLM, build_model
from .ftw_index import INDEX_NAME, Entry, FtwError, FtwIndex, read_index
from .ftw_io import ReadJob, aligned_empty, default_threads, pin, read_all, sha256_tensor
from .ftw_write import Progress, aux_files, check_destination, write_ftw

__all__ = ["FtwError", "FtwIndex", "convert", "load_ftw", "model_tensors", "INDEX_NAME"]

Spec = tuple[tuple[int, ...], torch.dtype]


def model_tensors(model: CausalLM, banks: ExpertBanks) -> list[tuple[str, torch.Tensor]]:
    """The tensors an FTW folder stores: ``model.<parameter>`` (tied weights once) and
    ``experts.<bank>`` (gate_up, down, biases and the format's scale banks)."""
    out = [(f"model.{n}", p.data) for n, p in model.named_parameters()]
    return out + [(f"experts.{n}", t) for n, t in banks.all_tensors().items()]


def convert(
    model_dir: str | Path,
    out: str | Path,
    *,
    force: bool = False,
    progress: Progress | None = None,
    quantize_experts: str | None = None,
) -> FtwIndex:
    """Converts a model folder (HF safetensors, or FTW) into an FTW folder at ``out``.
    ``quantize_experts``: store float experts quantized to that format (the index records it;
    config.json is kept as it is), so a daemon loads them quantized without requantizing."""
    src, dest = Path(model_dir), Path(out).absolute()
    if dest.exists() and dest.resolve() == src.resolve():
        raise FtwError(f"{dest}: the output folder is the model folder")
    check_destination(dest, force)  # before the minutes of loading, not after
    model, banks = load_model(src)
    if quantize_experts is not None:
        per_expert = banks.nbytes_per_expert()

        def step(done: int, total: int) -> None:
            if progress is not None:
                progress("quantize", done * per_expert, total * per_expert)

        banks = quantize_experts_at_load(banks, model.cfg, quantize_experts, step)
    config_bytes = (src / "config.json").read_bytes()
    return write_ftw(
        dest,
        model_tensors(model, banks),
        config_bytes,
        aux_files(src),
        banks.format,
        force=force,
        progress=progress,
    )


def _expected(cfg: ModelConfig, model: CausalLM, expert_format: str) -> dict[str, Spec]:
    """Every tensor the model needs, with its shape and dtype."""
    if expert_format not in FORMATS:
        raise FtwError(
            f"expert format {expert_format!r} of this FTW folder is unknown to this build"
        )
    want: dict[str, Spec] = {
        f"model.{n}": (tuple(p.shape), p.dtype) for n, p in model.named_parameters()
    }
    n, h, i = cfg.num_moe_layers * cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    dt = dtype_of(cfg.torch_dtype)
    for name, (shape, bank_dt) in get_format(expert_format).specs(h, i, dt).items():
        want[f"experts.{name}"] = ((n, *shape), bank_dt)
    if cfg.expert_bias:
        want["experts.gate_up_bias"] = ((n, 2 * i), dt)
        want["experts.down_bias"] = ((n, h), dt)
    return want


def _match(idx: FtwIndex, want: dict[str, Spec], folder: Path) -> list[Entry]:
    have = {e.name: e for e in idx.tensors}
    for name in want:
        if name not in have:
            raise FtwError(f"{folder}: tensor '{name}' is missing from {INDEX_NAME}")
    for name, e in have.items():
        if name not in want:
            raise FtwError(f"{folder}: unexpected tensor '{name}' (the model has no such weight)")
        shape, dt = want[name]
        if e.shape != shape or e.torch_dtype != dt:
            raise FtwError(
                f"{folder}: tensor '{name}' is {e.shape} {e.dtype}; the model needs {shape} {dt}"
            )
    return list(idx.tensors)


def _verify(entries: list[Entry], tensors: dict[str, torch.Tensor], threads: int | None) -> None:
    with ThreadPoolExecutor(threads or default_threads()) as pool:
        digests = pool.map(lambda e: sha256_tensor(tensors[e.name]), entries)
        for e, d in zip(entries, digests, strict=True):
            if d != e.sha256:
                raise FtwError(
                    f"{e.file}: tensor '{e.name}' content hash mismatch (data file corrupted)"
                )


def load_ftw(
    folder: str | Path,
    cfg: ModelConfig | None = None,
    *,
    threads: int | None = None,
    direct: bool = True,
    pin_banks: bool = True,
    verify: bool = False,
) -> tuple[CausalLM, ExpertBanks]:
    """Loads an FTW folder: the same (CausalLM, ExpertBanks) ``load_model`` returns.

    threads    parallel read requests (default: 2 per core, 4..16)
    direct     use O_DIRECT where the filesystem allows it (buffered reads otherwise)
    pin_banks  cudaHostRegister the expert banks after filling (only when CUDA is available)
    verify     re-hash every tensor after reading (slow; the index and sizes are always checked)
    """
    folder = Path(folder)
    idx = read_index(folder)
    cfg = cfg or ModelConfig.from_hf(folder)
    model = build_model(cfg)  # parameters are torch.empty: untouched pages cost nothing
    entries = _match(idx, _expected(cfg, model, idx.expert_format), folder)
    tensors: dict[str, torch.Tensor] = {}
    jobs = []
    for e in entries:
        t, region = aligned_empty(e.shape, e.torch_dtype)
        tensors[e.name] = t
        jobs.append(ReadJob(folder / e.file, e.offset, region, e.nbytes))
    read_all(jobs, threads, direct)
    if verify:
        _verify(entries, tensors, threads)
    for name, p in model.named_parameters():
        p.data = tensors[f"model.{name}"]  # tied weights share the Parameter: set once
    bank = {k.removeprefix("experts."): t for k, t in tensors.items() if k.startswith("experts.")}
    banks = ExpertBanks(
        gate_up=bank.pop("gate_up"),
        down=bank.pop("down"),
        gate_up_bias=bank.pop("gate_up_bias", None),
        down_bias=bank.pop("down_bias", None),
        format=idx.expert_format,
        extra=bank,
    )
    if pin_banks:
        pin(list(banks.all_tensors().values()))
    model.eval()
    return model, banks
