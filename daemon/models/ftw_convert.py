"""Writes an FTW folder (ARCHITECTURE §7) from any checkpoint ``load_model`` reads: an HF folder, an
FTW folder or a GGUF file (whose config, tokenizer and chat template are written out as the HF
files they describe, so the FTW folder is self-contained)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from ..checkpoint.ftw_index import FtwError, FtwIndex
from ..checkpoint.ftw_write import Progress, aux_files, check_destination, write_ftw
from ..engine.gguf_tokenizer import gguf_tokenizer_files
from ..experts.banks import ExpertBanks
from .expert_quant import quantize_experts_at_load
from .ftw_loader import QBLOCKS
from .gguf_config import hf_fields
from .gguf_loader import GgufCheckpoint
from .layers.common import Linear, widen_kept_blocks
from .loader import load_model, model_kind
from .model import CausalLM, model_tables


def model_tensors(model: CausalLM, banks: ExpertBanks) -> list[tuple[str, torch.Tensor]]:
    """The tensors an FTW folder stores: ``model.<parameter>`` (tied weights once),
    ``qblocks.<fmt>.<layer>`` for a projection kept in GGUF blocks (its raw rows, in place of its
    empty float placeholder; see ``ftw_loader``) and ``experts.<bank>`` (gate_up, down, biases
    and the format's scale banks). Blocks kept outside `Linear` (MLA's kv_b parts, V4's
    grouped o_a_proj and hyper-connection mixes) are stored widened (``widen_kept_blocks``)."""
    widen_kept_blocks(model)
    quantized = {
        name: mod.qweight
        for name, mod in model.named_modules()
        if isinstance(mod, Linear) and mod.qweight is not None
    }
    # blocks whose inputs are in another order (QuantWeight.in_perm) are stored dequantized
    blocks = {n: q for n, q in quantized.items() if q.in_perm is None}
    out = [
        (f"model.{n}", p.data)
        for n, p in model.named_parameters()
        if n.removesuffix(".weight") not in quantized
    ]
    out += [(f"model.{n}", b) for n, b in model_tables(model).items()]
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    out += [
        (f"model.{n}.weight", q.dequantize().to(dtype))
        for n, q in quantized.items()
        if q.in_perm is not None
    ]
    out += [(f"{QBLOCKS}.{q.fmt}.{name}", q.gguf_raw()) for name, q in blocks.items()]
    # FTW stores GGUF rows: banks a cpu backend interleaved in place (formats.interleave_banks)
    # would need their rows back first; ``convert`` reads them fresh from load_model
    if banks.interleaved:
        raise ValueError("interleaved expert banks cannot be written to FTW as they are")
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
    with tempfile.TemporaryDirectory() as tmp:
        if model_kind(src) == "gguf":
            config_bytes, aux = _gguf_sidecars(src, model.cfg.torch_dtype, Path(tmp))
        else:
            config_bytes, aux = (src / "config.json").read_bytes(), aux_files(src)
        return write_ftw(
            dest,
            model_tensors(model, banks),
            config_bytes,
            aux,
            banks.format,
            force=force,
            progress=progress,
        )


def _gguf_sidecars(src: Path, dtype: str, tmp: Path) -> tuple[bytes, list[Path]]:
    """config.json bytes and tokenizer.json / tokenizer_config.json files (in ``tmp``) that
    describe a GGUF file's model, tokenizer and chat template."""

    with GgufCheckpoint(src) as ck:
        infos = {n: t for n, (_, t) in ck.tensors.items()}
        fields = hf_fields(ck.metadata, infos, dtype, str(src))
        has_tokenizer = "tokenizer.ggml.tokens" in ck.metadata
    aux = gguf_tokenizer_files(src, tmp) if has_tokenizer else []
    return json.dumps(fields, indent=2).encode(), aux
