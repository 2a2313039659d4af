"""An FTW folder into a model: the FTW reader (``checkpoint.ftw``) composed with the model's
tensor list; ``load_model`` calls ``load_ftw`` for a folder that has ``ftw.json``."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint.ftw import Spec, read_tensors
from ..checkpoint.ftw_index import FtwError, FtwIndex, read_index
from ..checkpoint.ftw_io import pin
from ..experts.banks import ExpertBanks
from ..experts.formats import get_format, is_known
from ..formats.gguf_blocks import BLOCK_BYTES, row_bytes, supports
from ..native.qlinear_native import QuantWeight
from .config import ModelConfig
from .config_hf import read_config
from .layers.common import Linear, dtype_of
from .model import CausalLM, build_model, model_tables

# ``qblocks.<fmt>.<layer>``: a projection stored in GGUF blocks (uint8 [rows, row bytes]) in
# place of ``model.<layer>.weight``, as loaded from a GGUF file that carried it so
QBLOCKS = "qblocks"


def _block_layers(idx: FtwIndex, model: CausalLM) -> dict[str, tuple[str, Linear]]:
    """{index name: (format, projection)} of the projections the index stores in blocks."""

    out = {}
    for e in idx.tensors:
        if not e.name.startswith(QBLOCKS + "."):
            continue
        fmt, _, layer = e.name[len(QBLOCKS) + 1 :].partition(".")
        try:
            mod = model.get_submodule(layer)
        except AttributeError:
            mod = None
        if fmt not in BLOCK_BYTES or not isinstance(mod, Linear):
            raise FtwError(f"tensor '{e.name}': no projection '{layer}' in {fmt!r} blocks")
        rows, cols = mod.weight.shape
        want = (rows, row_bytes(fmt, cols)) if supports(fmt, cols) else None
        if want is None or e.shape != want or e.dtype != "uint8":
            raise FtwError(f"tensor '{e.name}': {e.dtype} {e.shape}, expected uint8 {want}")
        out[e.name] = (fmt, mod)
    return out


def _expected(
    cfg: ModelConfig, model: CausalLM, expert_format: str, blocks: dict[str, tuple[str, Linear]]
) -> dict[str, Spec]:
    """Every tensor the model needs, with its shape and dtype."""
    if not is_known(expert_format):
        raise FtwError(
            f"expert format {expert_format!r} of this FTW folder is unknown to this build"
        )
    in_blocks = {name.partition(".")[2].partition(".")[2] + ".weight" for name in blocks}
    want: dict[str, Spec] = {
        f"model.{n}": (tuple(p.shape), p.dtype)
        for n, p in model.named_parameters()
        if n not in in_blocks
    }
    want.update({f"model.{n}": (tuple(b.shape), b.dtype) for n, b in model_tables(model).items()})

    for name, (fmt, mod) in blocks.items():
        want[name] = ((mod.weight.shape[0], row_bytes(fmt, mod.weight.shape[1])), torch.uint8)
    n, h, i = cfg.num_moe_layers * cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    dt = dtype_of(cfg.torch_dtype)
    for name, (shape, bank_dt) in get_format(expert_format).shapes(n, h, i, dt).items():
        want[f"experts.{name}"] = (shape, bank_dt)
    if cfg.expert_bias:
        want["experts.gate_up_bias"] = ((n, 2 * i), dt)
        want["experts.down_bias"] = ((n, h), dt)
    return want


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
    cfg = cfg or read_config(folder)
    model = build_model(cfg)  # parameters are torch.empty: untouched pages cost nothing
    blocks = _block_layers(idx, model)
    want = _expected(cfg, model, idx.expert_format, blocks)
    tensors = read_tensors(folder, idx, want, threads=threads, direct=direct, verify=verify)
    for name, (fmt, mod) in blocks.items():
        mod.qweight = QuantWeight.from_raw(tensors.pop(name), fmt, mod.weight.shape[1])
        mod.weight = torch.nn.Parameter(torch.empty(0, dtype=mod.weight.dtype), requires_grad=False)
    for name, p in model.named_parameters():
        if f"model.{name}" in want:  # not the empty placeholder of a projection in blocks
            p.data = tensors[f"model.{name}"]  # tied weights share the Parameter: set once
    for name, b in model_tables(model).items():
        b.copy_(tensors[f"model.{name}"])
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
